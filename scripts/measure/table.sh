#!/usr/bin/env bash
# The table of issue #35 ("One house again"), measured on the working tree. Run from the
# repository root:
#
#     bash scripts/measure/table.sh             # every row
#     bash scripts/measure/table.sh --quick     # without public items (no nightly rustdoc run)
#
# Rows and where they come from:
# - duplicate pairs (runs of 6+ lines, same or same shape; and of 10+): the `duplicates` command,
#   when it is on PATH (otherwise the row says so), over the files git tracks;
# - lines of the trainer's crates, library functions of 100+ lines, circles of files, files over
#   600 lines, files importing the run config: house.py beside this script (standard library
#   Python; its docstring defines each);
# - public items of the trainer's crates (summed) and of candle-fused's `cuda_kernels` module:
#   public_items.sh beside this script (rustdoc JSON, needs `cargo +nightly`; the first run
#   builds the dependencies' metadata in target/public-items, a few minutes).
# The trainer's crates are TRAINER_CRATES (space-separated, default `candle-data candle-models trainer`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
quick=0
[ "${1-}" = "--quick" ] && quick=1
trainer_crates=${TRAINER_CRATES:-candle-data candle-models trainer}

pairs() {
  # The number of pairs `duplicates` reports for runs of $1+ lines ("no duplicates" = 0).
  local out first
  out=$(duplicates --min-lines "$1" --most 1 --seconds 300)
  first=$(head -n 1 <<<"$out")
  case "$first" in
    "no duplicates"*) printf '0' ;;
    *) printf '%s' "${first%% *}" ;;
  esac
  if grep -q '^incomplete:' <<<"$out"; then printf ' (incomplete)'; fi
}

if command -v duplicates >/dev/null 2>&1; then
  dups="$(pairs 6) / $(pairs 10)"
else
  dups="n/a (the \`duplicates\` command is not on PATH)"
fi

read -r long_files long_fns circles lines config < <(
  python3 "$here/house.py" --json --trainer "${trainer_crates// /,}" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["long_files"], d["long_functions"], d["circles"], d["trainer_lines"], d["config_users"])'
)

if [ "$quick" = 1 ]; then
  public="not measured (--quick)"
  kernels="not measured (--quick)"
elif ! cargo +nightly --version >/dev/null 2>&1; then
  public="n/a (no nightly toolchain)"
  kernels="n/a (no nightly toolchain)"
else
  # shellcheck disable=SC2086
  rows=$(bash "$here/public_items.sh" $trainer_crates candle-fused)
  public=$(awk -v crates=" $trainer_crates " 'NR > 1 && index(crates, " " $1 " ") { i += $3; n += $2 }
    END { printf "%d (nameable %d)", i, n }' <<<"$rows")
  kernels=$(awk '$1 == "candle_fused::cuda_kernels" { printf "%d (nameable %d)", $3, $2; f = 1 }
    END { if (!f) printf "?" }' <<<"$rows")
fi

printf '| measure | now | target |\n|---|---|---|\n'
printf '| duplicate pairs (runs of 6+ lines), whole tree / of 10+ lines | %s | <= 90 / <= 10 |\n' "$dups"
printf '| lines of the trainer'"'"'s crates (%s) | %s | |\n' "$trainer_crates" "$lines"
printf '| public items of the trainer'"'"'s crates (rustdoc JSON) | %s | <= 450 |\n' "$public"
printf '| public items of `cuda_kernels` | %s | <= 10 |\n' "$kernels"
printf '| library functions of 100+ lines | %s | <= 5 |\n' "$long_fns"
printf '| circles of files importing each other | %s | 0 |\n' "$circles"
printf '| library source files over 600 lines | %s | 0 |\n' "$long_files"
printf '| files importing `TrainConfig` | %s | <= 5 |\n' "$config"
