#!/usr/bin/env bash
# Per-step counts of the CUDA build's real training steps on a CPU machine, under the recording
# stand-in (README.md): launches by kernel name, cuBLAS calls, allocation calls and pool growth,
# event creations, memsets, host syncs and device-to-host reads by call site. Not CI: it needs
# the CUDA build of the trainer (scripts/gpu/build.sh clone stub cargo; 15-25 minutes).
#
#   scripts/gpu/standin/counts.sh [TRAINER]      # default /tmp/cuda-target/release/trainer
#
# The workloads and their arguments are scripts/gpu/run.sh's counts part (GPT-2 small bf16 with
# the Triton kernels; the SmolLM2-135M-shaped LoRA step), with its method: WARMUP + STEPS steps
# and WARMUP steps, per step = the difference / STEPS. REPEAT=1 (default) runs the long one a
# second time and fails unless the two reports are equal.
# Env: OUT (/tmp/standin-counts), WARMUP (5), STEPS (5), CASES ("gpt2 smollm2-135m-lora"),
# LABEL (the table's label prefix), STANDIN_TRIM_AT_READS, any trainer env.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
TRAINER=$(realpath "${1:-/tmp/cuda-target/release/trainer}")
OUT=${OUT:-/tmp/standin-counts}
WARMUP=${WARMUP:-5}
STEPS=${STEPS:-5}
REPEAT=${REPEAT:-1}
read -r -a CASES <<< "${CASES:-gpt2 smollm2-135m-lora}"
LABEL=${LABEL:-$(basename "$TRAINER")}
mkdir -p "$OUT"
LIB=$OUT/lib
"$HERE/build.sh" "$LIB" "$TRAINER"
standin() { # report-json command...
  local report=$1; shift
  env LD_LIBRARY_PATH="$LIB" STANDIN_OUT="$report" "$@"
}

# run.sh's shapes and recipes (ours_args, setup_cases)
GPT2=(--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8)
LLAMA_ARCH=(--arch llama --n-layer 30 --n-head 9 --n-kv-head 3 --n-embd 576 --mlp-hidden 1536 --bias false
  --tie-embeddings true --rope-theta 100000)
LLAMA_ROWS=(--block-size 1024 --batch-size 8)
case_args() {
  case $1 in
    gpt2) echo "${GPT2[*]} --data shards --data-path $OUT/data/gpt2 --bias false --dropout 0 --lr 6e-4 --min-lr 6e-5 --beta2 0.95" ;;
    smollm2-135m-lora) echo "--init-from $OUT/base-llama --lora-r 16 --lora-targets all-linear --base-dtype bf16 ${LLAMA_ROWS[*]} --data shards --data-path $OUT/data/llama --lr 3e-4 --beta2 0.95" ;;
    *) echo "counts.sh: unknown case $1" >&2; exit 2 ;;
  esac
}
[[ -f $OUT/data/gpt2/train.bin ]] || python3 "$ROOT/scripts/gpu/gpu_check.py" make-data "$OUT/data/gpt2" 50304 2000000
[[ -f $OUT/data/llama/train.bin ]] || python3 "$ROOT/scripts/gpu/gpu_check.py" make-data "$OUT/data/llama" 49152 2000000
if [[ " ${CASES[*]} " == *" smollm2-135m-lora "* && ! -d $OUT/base-llama ]]; then
  # the LoRA case's base, made by the trainer itself as run.sh does (under the stand-in its
  # weights are zeros: the counts do not depend on them)
  standin "$OUT/base.json" "$TRAINER" train --device cuda "${LLAMA_ARCH[@]}" "${LLAMA_ROWS[@]}" --data shards \
    --data-path "$OUT/data/llama" --max-iters 0 --eval-iters 1 --out-dir "$OUT/runs/base-llama" --overwrite > "$OUT/base.log" 2>&1
  standin "$OUT/base-export.json" "$TRAINER" export "$OUT/runs/base-llama" "$OUT/base-llama" --dtype bf16 >> "$OUT/base.log" 2>&1
fi

run_case() { # case steps report
  local c=$1 n=$2 report=$3
  # shellcheck disable=SC2046 # the case's arguments are words without spaces
  standin "$report" "$TRAINER" train --device cuda --dtype bf16 --tf32 true --out-dir "$OUT/runs/$c-$n" --overwrite \
    --cache-dir "$OUT/cache" --max-iters "$n" --eval-interval 100000 --eval-iters 1 --warmup-iters 2 \
    --grad-clip 1.0 --weight-decay 0.1 --triton-kernels true $(case_args "$c") > "${report%.json}.log" 2>&1 ||
    { echo "counts.sh: the $c run of $n steps failed (${report%.json}.log)" >&2; tail -5 "${report%.json}.log" >&2; exit 1; }
}
steps=()
for c in "${CASES[@]}"; do
  long=$((WARMUP + STEPS))
  echo "standin: $c, $long and $WARMUP steps" >&2
  run_case "$c" "$long" "$OUT/$c-$long.json"
  run_case "$c" "$WARMUP" "$OUT/$c-$WARMUP.json"
  if ((REPEAT)); then
    run_case "$c" "$long" "$OUT/$c-$long-again.json"
    python3 "$HERE/report.py" same "$OUT/$c-$long.json" "$OUT/$c-$long-again.json"
  fi
  python3 "$HERE/report.py" step "$OUT/$c-$long.json" "$OUT/$c-$WARMUP.json" "$STEPS" --label "$LABEL $c" > "$OUT/$c-step.json"
  steps+=("$OUT/$c-step.json")
done
python3 "$HERE/report.py" table "${steps[@]}"
echo "standin: per-step JSON (kernels by name, cuBLAS calls, reads by call site) in ${steps[*]}" >&2
