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
#
# A row `crate::module` follows its crate for each module named in PUBLIC_ITEMS_MODULES
# (space-separated, default `candle_fused::cuda_kernels`): the same two figures for the items
# below that module (its own path not counted; a crate-private module has none).
set -euo pipefail
crates=("$@")
if [ ${#crates[@]} -eq 0 ]; then
  crates=(candle-remat candle-amp candle-pipeline candle-fused candle-peft candle-comm candle-pipeline-comm test-support candle-data candle-models trainer)
fi
target=${PUBLIC_ITEMS_TARGET:-target/public-items}
modules=${PUBLIC_ITEMS_MODULES-candle_fused::cuda_kernels}
printf '%-28s %9s %7s\n' crate nameable items
for c in "${crates[@]}"; do
  CARGO_TARGET_DIR="$target" cargo +nightly rustdoc -q -p "$c" --lib -- -Z unstable-options --output-format json 2>/dev/null
  json="$target/doc/${c//-/_}.json"
  python3 - "$json" "$c" "$modules" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
index = doc["index"]
krate = sys.argv[2].replace("-", "_")


def public(i):
    return (i["crate_id"] == 0 and i.get("visibility") == "public"
            and not any(k in i["inner"] for k in ("impl", "use")))


def below(ids):
    """The ids reachable from `ids` through module items, fields, variants and impls."""
    seen, todo = set(), list(ids)
    while todo:
        i = todo.pop()
        if i in seen or str(i) not in index:
            continue
        seen.add(i)
        stack = [index[str(i)]["inner"]]
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                for k, w in v.items():
                    if k in ("items", "fields", "variants", "impls") and isinstance(w, list):
                        todo += [x for x in w if isinstance(x, (int, str))]
                    else:
                        stack.append(w)
            elif isinstance(v, list):
                stack += v
    return seen


nameable = sum(1 for p in doc["paths"].values() if p["crate_id"] == 0)
items = sum(1 for i in index.values() if public(i))
print(f"{sys.argv[2]:28} {nameable:9} {items:7}")
for module in sys.argv[3].split():
    path = module.split("::")
    if path[0] != krate:
        continue
    named = [k for k, p in doc["paths"].items() if p["crate_id"] == 0 and p["path"][:len(path)] == path]
    inner = [k for k in named if len(doc["paths"][k]["path"]) > len(path)]
    roots = [k for k in named if len(doc["paths"][k]["path"]) == len(path) and doc["paths"][k]["kind"] == "module"]
    reach = below(int(k) if k.isdigit() else k for k in roots) - {int(k) if k.isdigit() else k for k in roots}
    count = sum(1 for i in reach if public(index[str(i)]))
    print(f"{module:28} {len(inner):9} {count:7}")
PY
done
