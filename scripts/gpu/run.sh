#!/usr/bin/env bash
# The one command for a GPU machine (issue #23, point 4). See scripts/gpu/README.md.
#
#   scripts/gpu/run.sh [--pack DIR] [--out DIR] [--only tests,train,bench] [--dry-run | --rehearse]
#
# Runs from the repository root of a checkout (the device machine's copy of the working tree),
# with a build pack of ../shared/cuda/build-cuda.sh unpacked in DIR (default .gpu/pack: at least
# bin/trainer, manifest.tsv and the tests/ executables to run). Three parts, each adding rows to
# one markdown table (OUT/table.md, also printed; exit status 1 if a check failed):
#   tests  every CUDA-capable test executable of the pack (its source opens a CUDA device), with
#          CANDLE_FUSED_TRITON=0 and =1;
#   train  short trainer runs: CUDA vs CPU losses (f32, TF32 off; with dropout 0.2, which stays
#          within the tolerance only if the device draws the CPU's masks; with the Triton
#          kernels), remat vs none on CUDA (same bits);
#   bench  ours vs PyTorch eager on the same GPU, one after the other: GPT-2 small bf16 vs
#          nanoGPT, the shakespeare-char recipe with dropout 0.2 vs nanoGPT, a SmolLM2-135M-shaped
#          Llama vs transformers; median step time after warm-up, peak GPU memory (nvidia-smi).
# --dry-run prints what it would run and checks the pack and the files it needs (no GPU needed).
# --rehearse runs the train and bench parts on the CPU at tiny shapes (CUDA replaced by the CPU;
# TRAINER=target/release/trainer and PYTHON with torch + transformers), to test this script.
#
# Environment: OUT (table.md, results.jsonl, logs/: /tmp/gpu-run), WORK (runs, data: /tmp/gpu-work),
# STEPS (timed steps, 10), WARMUP (5), TRAIN_STEPS (20), PYTHON (python3),
# TRAINER (PACK/bin/trainer), LIMIT (seconds per command, 300), ALL_TESTS=1 (also run the
# pack's CPU-only test executables, once).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PACK=${GPU_PACK:-.gpu/pack}
OUT=${OUT:-/tmp/gpu-run}
ONLY=
MODE=run
while (($#)); do
  case $1 in
    --pack) PACK=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --dry-run) MODE=dry; shift ;;
    --rehearse) MODE=rehearse; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# The rehearsal has no pack: its default parts are train and bench.
[[ -z $ONLY ]] && { [[ $MODE == rehearse ]] && ONLY=train,bench || ONLY=tests,train,bench; }
PACK=$(realpath -m "$PACK")
# A pack carried compressed (PACK.tar.xz, see the README) is unpacked first.
if [[ ! -d $PACK && -f $PACK.tar.xz ]]; then
  if [[ $MODE == dry ]]; then  # unpack a listing-only copy to check the layout
    DRY_TMP=$(mktemp -d)
    trap 'rm -rf "$DRY_TMP"' EXIT
    top=$(basename "$PACK")
    tar -C "$DRY_TMP" -xJf "$PACK.tar.xz" --anchored --exclude="$top/tests/*" --exclude="$top/bin/*" &&
      tar -tJf "$PACK.tar.xz" | grep -E '^[^/]+/(bin|tests)/[^/]+$' | while read -r f; do
        mkdir -p "$DRY_TMP/$(dirname "$f")" && touch "$DRY_TMP/$f" && chmod +x "$DRY_TMP/$f"; done
    echo "   (dry run: checking the contents of $PACK.tar.xz)" >&2
    PACK=$DRY_TMP/$(basename "$PACK")
  else
    tar -C "$(dirname "$PACK")" -xJf "$PACK.tar.xz" || { echo "run.sh: cannot unpack $PACK.tar.xz" >&2; exit 1; }
  fi
fi
OUT=$(realpath -m "$OUT")
# Runs, checkpoints and data stay out of OUT (the device tool brings OUT back: keep it small).
WORK=$(realpath -m "${WORK:-/tmp/gpu-work}")
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-5}
TRAIN_STEPS=${TRAIN_STEPS:-20}
LIMIT=${LIMIT:-300}
PYTHON=${PYTHON:-python3}
CHECK="$PYTHON $ROOT/scripts/gpu/gpu_check.py"
DEV=cuda
TRAINER=${TRAINER:-$PACK/bin/trainer}
if [[ $MODE == rehearse ]]; then
  DEV=cpu
  TRAINER=${TRAINER_REHEARSE:-$ROOT/target/release/trainer}
  [[ -x $TRAINER ]] || TRAINER=${CARGO_TARGET_DIR:-$ROOT/target}/release/trainer
fi
# The project tree the test executables run in (cargo runs each in its package directory).
PROJECT=$ROOT
[[ -d $PACK/project ]] && PROJECT=$PACK/project
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}
RESULTS=$OUT/results.jsonl
LOGS=$OUT/logs
want() { [[ ,$ONLY, == *,$1,* ]]; }
say() { printf '== %s\n' "$*" >&2; }
# One command: printed; run unless dry (with a time limit); its output in LOGS/$1.log.
run() {
  local name=$1; shift
  printf '   $ %s\n' "$*" >&2
  [[ $MODE == dry ]] && return 0
  timeout "$LIMIT" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  [[ -f $WORK/runs/$name/metrics.jsonl ]] && cp "$WORK/runs/$name/metrics.jsonl" "$LOGS/$name.metrics.jsonl"
  ((rc == 0)) || { echo "   ($name failed, rc=$rc; last lines of $LOGS/$name.log:)" >&2; tail -n 5 "$LOGS/$name.log" >&2; }
  return $rc
}
row() { [[ $MODE == dry ]] || echo "$1" >> "$RESULTS"; }
fail_row() { row "{\"kind\": \"error\", \"name\": \"$1\", \"error\": \"$2\"}"; }

# ------------------------------------------------------------------ layout
missing=()
need() { [[ -e $1 ]] || missing+=("$1"); }
if want tests || [[ $MODE != rehearse ]]; then
  need "$PACK/bin/trainer"
  need "$PACK/manifest.tsv"
fi
[[ $TRAINER == "$PACK/bin/trainer" ]] || need "$TRAINER"
need "$ROOT/data/tinyshakespeare.txt"
need "$ROOT/configs/shakespeare_char.toml"
need "$ROOT/scripts/gpu/torch_gpu_step.py"
command -v "$PYTHON" > /dev/null || missing+=("$PYTHON (python3 with torch and transformers)")
[[ $MODE == run ]] && ! command -v nvidia-smi > /dev/null && missing+=("nvidia-smi")
say "pack $PACK, project $PROJECT, trainer $TRAINER, device $DEV, out $OUT, parts $ONLY"
if ((${#missing[@]})); then
  printf 'run.sh: missing: %s\n' "${missing[@]}" >&2
  exit 1
fi
[[ -f $PACK/BUILD-INFO.txt ]] && sed -n '1,3p' "$PACK/BUILD-INFO.txt" >&2
if [[ $MODE != dry ]]; then
  rm -rf "$WORK/runs"
  mkdir -p "$LOGS" "$WORK" && : > "$RESULTS"
  $CHECK selftest > "$LOGS/selftest.log" || { echo "gpu_check.py selftest failed" >&2; exit 1; }
  [[ $MODE == run ]] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2
fi

# ------------------------------------------------------------------ tests
# A test executable is CUDA-capable when its source opens a CUDA device (the others run on the
# CPU only and check nothing here). Paths baked in at compile time are provided as run-tests.sh
# does (cli tests call CARGO_BIN_EXE_trainer).
cuda_capable() { # pdir kind tname
  local src
  for src in "$PROJECT/$1/tests/$3.rs" "$PROJECT/$1/tests/$3/main.rs"; do
    [[ $2 == test && -f $src ]] && grep -qE 'new_cuda|cuda_if_available|Device::Cuda' "$src" && return 0
  done
  return 1
}
if want tests; then
  say "tests: CUDA-capable executables of the pack, CANDLE_FUSED_TRITON=0 and =1"
  baked=$(sed -n 's/^baked paths: \([^ ]*\).*/\1/p' "$PACK/BUILD-INFO.txt" 2>/dev/null)
  if [[ -n $baked && $MODE == run && ! -e $baked ]]; then
    mkdir -p "$(dirname "$baked")" && ln -s "$PACK/bin/trainer" "$baked" 2>/dev/null ||
      echo "   (cannot link $baked: cli tests will not find the trainer)" >&2
  fi
  exes=(); cpu_exes=()
  while IFS=$'\t' read -r exe kind pkg tname pdir orig; do
    [[ $exe == tests/* ]] || continue
    if [[ ! -x $PACK/$exe ]]; then
      echo "   not in the pack (not carried): $exe" >&2
      continue
    fi
    if cuda_capable "$pdir" "$kind" "$tname"; then
      exes+=("$exe	$pdir")
    else
      cpu_exes+=("$exe	$pdir")
    fi
  done < "$PACK/manifest.tsv"
  ((${#exes[@]})) || echo "   no CUDA-capable test executable in the pack" >&2
  # ALL_TESTS=1: the CPU-only executables too, once (as the pack's run-tests.sh).
  settings=(0 1); [[ ${ALL_TESTS:-0} == 1 ]] && settings+=(cpu)
  for triton in "${settings[@]}"; do
    run_list=("${exes[@]}"); label="CUDA tests, CANDLE_FUSED_TRITON=$triton"
    [[ $triton == cpu ]] && { run_list=("${cpu_exes[@]}"); triton=0; label="CPU-only tests of the pack"; }
    passed=0; failed=0; failures=()
    for e in "${run_list[@]}"; do
      exe=${e%%	*}; pdir=${e#*	}; name=$(basename "$exe").triton$triton
      if (cd "$PROJECT/$pdir" && run "$name" env CANDLE_FUSED_TRITON=$triton "$PACK/$exe"); then
        # A test that found no device skipped its checks: on the GPU machine that is a failure.
        if [[ $MODE == run ]] && grep -qi 'no CUDA device' "$LOGS/$name.log"; then
          failed=$((failed + 1)); failures+=("$(basename "$exe")(no-device)")
        else
          passed=$((passed + 1))
        fi
      else
        failed=$((failed + 1)); failures+=("$(basename "$exe")")
      fi
    done
    list=$(printf '"%s",' "${failures[@]}"); list=${list%,}; [[ $list == '""' ]] && list=
    row "{\"kind\": \"tests\", \"name\": \"$label\", \"passed\": $passed, \"failed\": $failed, \"failures\": [$list]}"
  done
fi

# ------------------------------------------------------------------ train
# nanoGPT's CPU baby GPT (configs/shakespeare_char.toml) for TRAIN_STEPS steps, no evaluation
# between. Tolerances: f32 with TF32 off differs from the CPU only by summation order (cuBLAS vs
# the CPU GEMM, device reductions): ~1e-6 relative per op, ~1e-5 on the loss after 20 AdamW
# steps; 1e-3 leaves room and still fails on a wrong kernel, or on different dropout masks
# (another mask moves the loss by ~1e-2 at dropout 0.2). Remat recomputes the same ops on the
# same values: the same bits, losses and gradient norms.
train() { # name device extra-args...
  local name=$1 dev=$2; shift 2
  run "$name" "$TRAINER" train --config "$ROOT/configs/shakespeare_char.toml" --device "$dev" \
    --data-path "$ROOT/data/tinyshakespeare.txt" --cache-dir "$WORK/cache" \
    --out-dir "$WORK/runs/$name" --overwrite --max-iters "$TRAIN_STEPS" \
    --lr-decay-iters "$TRAIN_STEPS" --warmup-iters 5 --eval-interval 100000 --eval-iters 1 \
    --peak-flops 1e12 "$@"
}
compare() { # row-name run-a run-b tolerance
  [[ $MODE == dry ]] && { printf '   compare %s vs %s (tolerance %s)\n' "$2" "$3" "$4" >&2; return; }
  local r
  if r=$($CHECK losses "$WORK/runs/$2" "$WORK/runs/$3" "$4" 2>> "$LOGS/compare.log"); then
    row "{\"kind\": \"losses\", \"name\": \"$1\", \"tol\": $4, ${r#\{}"
  else
    fail_row "$1" "no comparable runs ($2, $3)"
  fi
}
if want train; then
  say "train: CUDA vs CPU, remat vs none, $TRAIN_STEPS steps"
  F32=(--dtype f32 --tf32 false)
  train cpu-f32 cpu "${F32[@]}"
  train dev-f32 "$DEV" "${F32[@]}"
  compare "CUDA vs CPU losses, f32, TF32 off" dev-f32 cpu-f32 1e-3
  train cpu-drop cpu "${F32[@]}" --dropout 0.2
  train dev-drop "$DEV" "${F32[@]}" --dropout 0.2
  compare "dropout 0.2: CUDA vs CPU losses (needs the CPU's masks)" dev-drop cpu-drop 1e-3
  train dev-triton "$DEV" "${F32[@]}" --dropout 0.2 --triton-kernels true
  compare "Triton kernels on: CUDA vs CPU losses, f32, dropout 0.2" dev-triton cpu-drop 1e-3
  for r in none all; do
    train "dev-remat-$r" "$DEV" --dtype bf16 --dropout 0.2 --remat "$r" --triton-kernels true
  done
  compare "remat all vs none on CUDA, bf16, dropout 0.2, Triton on" dev-remat-all dev-remat-none 0
fi

# ------------------------------------------------------------------ bench
# Peak GPU memory: nvidia-smi's memory.used of the device every 50 ms during the run, minus its
# first sample (the same measure for both sides: CUDA context, caching allocator and all);
# PyTorch's torch.cuda.max_memory_allocated is shown beside it.
poll() { # file: start polling (run mode only)
  [[ $MODE == run ]] || return 0
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 50 > "$1" &
  POLL=$!
  sleep 0.5
}
unpoll() {
  if [[ -n ${POLL:-} ]]; then kill "$POLL" 2> /dev/null; wait "$POLL" 2> /dev/null; fi
  POLL=
}
bench_ours() { # case variant trainer-args...
  local case=$1 variant=$2; shift 2
  local name=ours-$case-$variant mem=$LOGS/mem-ours-$case-$variant.txt
  poll "$mem"
  run "$name" "$TRAINER" train --device "$DEV" --dtype bf16 --tf32 true --out-dir "$WORK/runs/$name" \
    --overwrite --cache-dir "$WORK/cache" --max-iters $((WARMUP + STEPS)) --eval-interval 100000 \
    --eval-iters 1 --peak-flops 1e15 --warmup-iters 2 --grad-clip 1.0 --weight-decay 0.1 "$@"
  local rc=$?
  unpoll
  [[ $MODE == dry ]] && return
  if ((rc == 0)) && r=$($CHECK ours "$case" "$WORK/runs/$name" "$mem" "$WARMUP"); then
    row "{\"kind\": \"bench\", \"variant\": \"$variant\", ${r#\{}"
  else
    fail_row "$case: ours ($variant)" "the trainer run failed (logs/$name.log)"
  fi
}
bench_torch() { # case torch-args...
  local case=$1; shift
  local mem=$LOGS/mem-torch-$case.txt
  poll "$mem"
  run "torch-$case" "$PYTHON" "$ROOT/scripts/gpu/torch_gpu_step.py" --case "$case" --device "$DEV" \
    --steps "$STEPS" --warmup "$WARMUP" "$@"
  local rc=$?
  unpoll
  [[ $MODE == dry ]] && return
  if ((rc == 0)) && r=$($CHECK torch "$case" "$LOGS/torch-$case.log" "$mem"); then
    row "{\"kind\": \"bench\", ${r#\{}"
  else
    fail_row "$case: PyTorch" "the PyTorch run failed (logs/torch-$case.log)"
  fi
}
if want bench; then
  say "bench: ours vs PyTorch eager, $WARMUP warm-up + $STEPS timed steps each"
  # Shapes (rehearsal: tiny ones, the same code paths).
  GPT2=(--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8)
  CHAR=(--n-layer 6 --n-head 6 --n-embd 384 --block-size 256 --batch-size 64)
  LLAMA=(--n-layer 30 --n-head 9 --n-kv-head 3 --n-embd 576 --mlp-hidden 1536 --block-size 1024 --batch-size 8)
  GPT2_VOCAB=50304; LLAMA_VOCAB=49152; TOKENS=2000000; TINY=()
  if [[ $MODE == rehearse ]]; then
    GPT2=(--n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --batch-size 4); CHAR=("${GPT2[@]}")
    LLAMA=(--n-layer 2 --n-head 4 --n-kv-head 2 --n-embd 64 --mlp-hidden 128 --block-size 64 --batch-size 4)
    LLAMA_VOCAB=512; TOKENS=20000; TINY=(--tiny)
  fi
  run data-gpt2 $CHECK make-data "$WORK/data/gpt2" "$GPT2_VOCAB" "$TOKENS"
  run data-llama $CHECK make-data "$WORK/data/llama" "$LLAMA_VOCAB" "$TOKENS"
  for variant in default triton; do
    T=(--triton-kernels false); [[ $variant == triton ]] && T=(--triton-kernels true)
    # nanoGPT's train.py: no biases, dropout 0, lr 6e-4, betas (0.9, 0.95).
    bench_ours gpt2 "$variant" "${T[@]}" "${GPT2[@]}" --data shards --data-path "$WORK/data/gpt2" \
      --bias false --dropout 0 --lr 6e-4 --min-lr 6e-5 --beta2 0.95
    # nanoGPT's config/train_shakespeare_char.py (bias False from train.py's defaults).
    bench_ours shakespeare-char "$variant" "${T[@]}" "${CHAR[@]}" --data char \
      --data-path "$ROOT/data/tinyshakespeare.txt" --bias false --dropout 0.2 --lr 1e-3 --beta2 0.99
    bench_ours smollm2-135m "$variant" "${T[@]}" "${LLAMA[@]}" --arch llama --data shards \
      --data-path "$WORK/data/llama" --bias false --tie-embeddings true --rope-theta 100000 \
      --lr 3e-4 --beta2 0.95
  done
  bench_torch gpt2 "${TINY[@]}"
  bench_torch shakespeare-char "${TINY[@]}"
  bench_torch smollm2-135m "${TINY[@]}"
fi

# ------------------------------------------------------------------ table
[[ $MODE == dry ]] && { say "dry run: the pack and the files above are in place"; exit 0; }
DEVICE_NAME="the CPU (rehearsal: CUDA replaced by the CPU, tiny bench shapes)"
[[ $MODE == run ]] && DEVICE_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0)
{
  echo "GPU check on $DEVICE_NAME, $(date -u +%F), $(sed -n 1p "$PACK/BUILD-INFO.txt" 2>/dev/null || git rev-parse --short HEAD)"
  echo
  $CHECK table "$RESULTS"
} > "$OUT/table.md"
status=$?
cat "$OUT/table.md"
exit $status
