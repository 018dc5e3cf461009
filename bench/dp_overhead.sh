#!/usr/bin/env bash
# Data-parallel step overhead of the trainer over MPI (needs `--features mpi` and Open MPI).
#
# Each process gets one compute thread, so that the runs compare like with like on a small
# machine: "1 rank" is one process training B rows per step; "2 ranks" is two processes
# training B rows each (the same work per rank, plus the bucketed gradient all-reduce, the loss
# and stop-flag all-reduces, and the ranks waiting for each other). Overhead = 2-rank step time
# / 1-rank step time - 1 (median over the steps after the first 3). Prints a table.
#
#   cargo build --release -p trainer --features mpi && bench/dp_overhead.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
trainer=target/release/trainer
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median_ms() {
  python3 - "$1" <<'PY'
import json, statistics, sys
ms = [r["step_ms"] for r in map(json.loads, open(sys.argv[1])) if "step_ms" in r][3:]
print(f"{statistics.median(ms):.1f}")
PY
}
printf '| model | batch/rank | 1 rank (ms) | 2 ranks (ms) | overhead |\n|---|---|---|---|---|\n'
for shape in "4 4 128 64 12 baby-GPT" "4 4 256 128 8 GPT-4/4/256"; do
  read -r L H C T B name <<<"$shape"
  args=(--data char --data-path data/tinyshakespeare.txt --n-layer "$L" --n-head "$H" --n-embd "$C"
        --block-size "$T" --batch-size "$B" --max-iters "$steps" --eval-interval 100000
        --eval-iters 1 --warmup-iters 2 --peak-flops 1e12 --cache-dir "$work/cache")
  "$trainer" train --out-dir "$work/one-$name" "${args[@]}" >/dev/null 2>&1
  mpirun --oversubscribe -np 2 "$trainer" train --out-dir "$work/two-$name" "${args[@]}" >/dev/null 2>&1
  one=$(median_ms "$work/one-$name/metrics.jsonl")
  two=$(median_ms "$work/two-$name/metrics.jsonl")
  python3 -c "print(f'| $name | $B x $T | $one | $two | {100*($two/$one-1):+.0f}% |')"
done
