#!/usr/bin/env bash
# Public items per workspace crate, counted from rustdoc's JSON (needs a nightly toolchain:
# `rustup toolchain install nightly`). Run from the repository root:
#
#     bash scripts/measure/public_items.sh [crate ...]     # default: every library crate
#
# Two figures per crate: `nameable` = items with a public path (modules, types, traits,
# functions, constants, macros: rustdoc JSON's `paths` of the crate), and `items` = every
# public item of the crate's index (those plus public methods, fields and variants).
# A module-private item (`pub(crate)`) counts in neither. The JSON goes to its own target
# directory, so the normal build is not disturbed.
set -euo pipefail
crates=("$@")
if [ ${#crates[@]} -eq 0 ]; then
  crates=(candle-remat candle-amp candle-pipeline candle-fused candle-peft candle-comm candle-pipeline-comm test-support trainer)
fi
target=${PUBLIC_ITEMS_TARGET:-target/public-items}
printf '%-22s %9s %7s\n' crate nameable items
for c in "${crates[@]}"; do
  CARGO_TARGET_DIR="$target" cargo +nightly rustdoc -q -p "$c" --lib -- -Z unstable-options --output-format json 2>/dev/null
  json="$target/doc/${c//-/_}.json"
  python3 - "$json" "$c" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
index = doc["index"]
nameable = sum(1 for p in doc["paths"].values() if p["crate_id"] == 0)
items = sum(1 for i in index.values()
            if i["crate_id"] == 0 and i.get("visibility") == "public"
            and not any(k in i["inner"] for k in ("impl", "use")))
print(f"{sys.argv[2]:22} {nameable:9} {items:7}")
PY
done
