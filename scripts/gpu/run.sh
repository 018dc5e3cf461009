#!/usr/bin/env bash
# The one command for a GPU machine (issues #23 and #30). See scripts/gpu/README.md.
#
#   scripts/gpu/run.sh [--pack DIR|FILE.tar.xz] [--out DIR] [--only smoke,tests,train,bench,counts,profile]
#                      [--dry-run | --rehearse]
#
# Five parts by default, in the order of what they decide, each under its own time cap:
#   smoke  every cubin of candle-fused/kernels loaded and launched once through the driver, no
#          Rust (cubin_smoke.py; --fake in the rehearsal);
#   tests  the CUDA-capable test executables of the pack, CANDLE_FUSED_TRITON=0 and =1 (trials
#          skipped for want of a device are a failure on the GPU machine);
#   train  short trainer runs: CUDA vs CPU losses, remat vs none;
#   bench  ours vs PyTorch on the same GPU (nanoGPT eager; transformers SDPA; PEFT LoRA);
#   counts driver calls per step (launches, allocations, syncs) and per-kernel GPU times,
#          ours and PyTorch's, by the LD_PRELOAD counter scripts/gpu/cucount.c;
# and a sixth only when --only names it:
#   profile every kernel's GPU time under Nsight Compute (ncu), ours and PyTorch's.
# After every part OUT holds at most four files, rewritten: summary.md (header, per-part status and
# time, the table so far), results.jsonl (every result row), logs.tar.xz (every log so far) and
# smoke.jsonl (one line per cubin). Exit status 1 when a correctness check failed.
# --dry-run prints what it would run and checks the pack and the files it needs (no GPU).
# --rehearse runs every part on this CPU machine: smoke with a fake driver, the tests under the
# stub libcuda.so.1 (their CUDA trials come out skipped), train and bench with the pack's trainer on
# --device cpu at tiny shapes (PYTHON: a Python with torch and transformers).
#
# Environment: GPU_PACK (the pack: a directory, or FILE.tar.xz; default .gpu/pack, unpacked from
# .gpu/pack.tar.xz), OUT (/tmp/gpu-run), WORK (logs, runs, data, the unpacked pack: /tmp/gpu-work),
# BUDGET (seconds for all parts, 540), SMOKE_CAP (120), TESTS_CAP (240), TRAIN_CAP (240),
# BENCH_CAP (300), COUNTS_CAP (120), COUNT_STEPS (5), PROFILE_CAP (400), PROFILE_STEPS (2; the
# profile part runs only when --only names it), MIN_PART (30: a part starts only with this
# much budget left), LIMIT (seconds
# per command, 300), STEPS (10), WARMUP (5), TRAIN_STEPS (20), PYTHON (python3), TRAINER
# (PACK/bin/trainer), ALL_TESTS=1 (also the pack's CPU-only test executables), CUDA_STUB_LIBS
# (rehearsal: /tmp/cudaroot/lib/stubs/run:/tmp/cudaroot/lib).
set -uo pipefail
# The kernels not yet launched on a GPU (candle_fused::cuda_kernels::UNPROVEN: the multi-tensor
# AdamW, the embedding backward, attention's head-size builds) are off in a default run; this
# run is the check that proves them, so every part runs with them on (set it to 0 to compare).
export CANDLE_FUSED_TRITON_UNPROVEN=${CANDLE_FUSED_TRITON_UNPROVEN:-1}

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
T0=$SECONDS
PACK=${GPU_PACK:-.gpu/pack}
OUT=${OUT:-/tmp/gpu-run}
ONLY=smoke,tests,train,bench,counts
MODE=run
while (($#)); do
  case $1 in
    --pack) PACK=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --dry-run) MODE=dry; shift ;;
    --rehearse) MODE=rehearse; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | grep '^#'; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for p in ${ONLY//,/ }; do
  [[ $p == @(smoke|tests|train|bench|counts|profile) ]] || { echo "run.sh: unknown part $p (smoke, tests, train, bench, counts, profile)" >&2; exit 2; }
done
OUT=$(realpath -m "$OUT")
# Runs, checkpoints, data and logs stay out of OUT (the device tool brings OUT back: keep it small).
WORK=$(realpath -m "${WORK:-/tmp/gpu-work}")
LOGS=$WORK/logs
BUDGET=${BUDGET:-540}
MIN_PART=${MIN_PART:-30}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-5}
TRAIN_STEPS=${TRAIN_STEPS:-20}
LIMIT=${LIMIT:-300}
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  # The rehearsal needs torch + transformers: scripts/python/setup.sh's .venv-py here, or in the
  # checkout this one was cloned from (a fresh local clone has none).
  if [[ $MODE == rehearse ]]; then
    origin=$(git -C "$ROOT" config --get remote.origin.url 2>/dev/null)
    for v in "$ROOT/.venv-py" ${origin:+"$origin/.venv-py"}; do
      [[ -x $v/bin/python ]] && { PYTHON=$v/bin/python; break; }
    done
  fi
fi
CHECK=("$PYTHON" "$ROOT/scripts/gpu/gpu_check.py")
say() { printf '== %s\n' "$*" >&2; }

# ------------------------------------------------------------------ the pack
# A directory, or a PACK.tar.xz (given, or next to the missing PACK directory) unpacked into WORK.
PACK=$(realpath -m "$PACK")
TARBALL=
if [[ $PACK == *.tar.xz ]]; then
  TARBALL=$PACK
elif [[ ! -d $PACK && -f $PACK.tar.xz ]]; then
  TARBALL=$PACK.tar.xz
fi
if [[ -n $TARBALL ]]; then
  [[ -f $TARBALL ]] || { echo "run.sh: no pack $TARBALL" >&2; exit 1; }
  top=$(tar -tJf "$TARBALL" | head -1); top=${top%%/*}
  if [[ $MODE == dry ]]; then  # the manifest and BUILD-INFO, and empty stand-ins for the executables
    DRY_TMP=$(mktemp -d)
    trap 'rm -rf "$DRY_TMP"' EXIT
    tar -C "$DRY_TMP" -xJf "$TARBALL" --wildcards "$top/manifest.tsv" "$top/BUILD-INFO.txt" 2>/dev/null
    tar -tJf "$TARBALL" | grep -E '^[^/]+/(bin|tests)/[^/]+$' | while read -r f; do
      mkdir -p "$DRY_TMP/$(dirname "$f")" && touch "$DRY_TMP/$f" && chmod +x "$DRY_TMP/$f"; done
    echo "   (dry run: checking the contents of $TARBALL)" >&2
    PACK=$DRY_TMP/$top
  else
    mkdir -p "$WORK" && rm -rf "${WORK:?}/$top"
    tar -C "$WORK" -xJf "$TARBALL" || { echo "run.sh: cannot unpack $TARBALL" >&2; exit 1; }
    PACK=$WORK/$top
  fi
fi
DEV=cuda
TRAINER=${TRAINER:-$PACK/bin/trainer}
if [[ $MODE == rehearse ]]; then
  DEV=cpu
  TRAINER=${TRAINER_REHEARSE:-$TRAINER}
  # The CUDA executables start here against the stub driver (every CUDA call: no device).
  CUDA_STUB_LIBS=${CUDA_STUB_LIBS:-/tmp/cudaroot/lib/stubs/run:/tmp/cudaroot/lib}
  export LD_LIBRARY_PATH=$CUDA_STUB_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# The project tree the test executables run in (cargo runs each in its package directory).
PROJECT=$ROOT
[[ -d $PACK/project ]] && PROJECT=$PACK/project
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}
want() { [[ ,$ONLY, == *,$1,* ]]; }

# ------------------------------------------------------------------ layout
missing=()
need() { [[ -e $1 ]] || missing+=("$1"); }
if want tests || want train || want bench || want counts; then
  need "$PACK/manifest.tsv"
  need "$TRAINER"
fi
want smoke && need "$ROOT/candle-fused/kernels" && need "$ROOT/scripts/gpu/cubin_smoke.py"
need "$ROOT/data/tinyshakespeare.txt"
need "$ROOT/configs/shakespeare_char.toml"
need "$ROOT/scripts/gpu/torch_gpu_step.py"
want counts && need "$ROOT/scripts/gpu/cucount.c" && need "$ROOT/scripts/gpu/cucount_calls.h"
command -v "$PYTHON" > /dev/null || missing+=("$PYTHON (python3; with torch and transformers for bench)")
[[ $MODE == run ]] && ! command -v nvidia-smi > /dev/null && missing+=("nvidia-smi")
if [[ $MODE == rehearse ]]; then
  for d in ${CUDA_STUB_LIBS//:/ }; do need "$d"; done
  if want bench && ! "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
    missing+=("PYTHON=$PYTHON has no torch + transformers (scripts/python/setup.sh makes .venv-py)")
  fi
fi
say "pack $PACK, project $PROJECT, trainer $TRAINER, device $DEV, out $OUT, parts $ONLY, budget ${BUDGET}s"
if ((${#missing[@]})); then
  printf 'run.sh: missing: %s\n' "${missing[@]}" >&2
  exit 1
fi
[[ -f $PACK/BUILD-INFO.txt ]] && sed -n '1,3p' "$PACK/BUILD-INFO.txt" >&2

RESULTS=$OUT/results.jsonl
PARTS=$WORK/parts.tsv
if [[ $MODE != dry ]]; then
  rm -rf "$WORK/runs" "$LOGS"
  mkdir -p "$LOGS" "$OUT"
  rm -f "$OUT/summary.md" "$OUT/results.jsonl" "$OUT/logs.tar.xz" "$OUT/smoke.jsonl"
  : > "$RESULTS"; : > "$PARTS"
  "${CHECK[@]}" selftest > "$LOGS/selftest.log" 2>&1 || { echo "gpu_check.py selftest failed (see $LOGS/selftest.log)" >&2; exit 1; }
  pack_commit=$(sed -n 's/^project commit: \([0-9a-f]*\).*/\1/p' "$PACK/BUILD-INFO.txt" 2>/dev/null | cut -c1-10)
  here_commit=$(git -C "$ROOT" rev-parse --short=10 HEAD 2>/dev/null || echo unknown)
  if [[ $MODE == run ]]; then
    gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader -i 0 2>&1 | head -1)
    cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
    device="$gpu, CUDA $cuda"
  else
    device="this CPU machine (rehearsal: CUDA replaced by the CPU, the stub driver, a fake driver for the smoke)"
  fi
  printf '%s\n' "GPU check ($MODE) on $device" \
    "checkout $here_commit, pack ${pack_commit:-unknown}; $(date -u '+%F %H:%M UTC'); budget ${BUDGET}s" > "$WORK/header.txt"
fi

# ------------------------------------------------------------------ parts, commands, rows
PART=; PART_END=0; PART_CUT=0
# The summary, rewritten in OUT after every part (at most four files there).
publish() {
  [[ $MODE == dry ]] && return 0
  "${CHECK[@]}" summary "$RESULTS" "$PARTS" "$WORK/header.txt" > "$OUT/summary.md.tmp" 2>> "$LOGS/summary.log"
  mv -f "$OUT/summary.md.tmp" "$OUT/summary.md"
  tar -C "$WORK" -cJf "$OUT/logs.tar.xz.tmp" logs parts.tsv header.txt && mv -f "$OUT/logs.tar.xz.tmp" "$OUT/logs.tar.xz"
}
# part_begin NAME CAP: false (and recorded) when the part is not asked for or the budget is spent.
part_begin() {
  local name=$1 cap=$2 left=$((BUDGET - (SECONDS - T0)))
  PART=$name; PART_CUT=0; PART_T0=$SECONDS; PART_CAP=$cap
  if ! want "$name"; then
    [[ $MODE == dry ]] || printf '%s\tnot asked\t0\t%s\t--only %s\n' "$name" "$cap" "$ONLY" >> "$PARTS"
    return 1
  fi
  if [[ $MODE != dry ]] && ((left < MIN_PART)); then
    printf '%s\tskipped\t0\t%s\tbudget: %ss of %ss left, %ss needed to start\n' "$name" "$cap" "$left" "$BUDGET" "$MIN_PART" >> "$PARTS"
    row "{\"kind\": \"skipped\", \"name\": \"part $name\", \"why\": \"budget spent ($left s left of $BUDGET s)\"}"
    say "$name: skipped (budget: ${left}s left)"
    publish
    return 1
  fi
  ((cap > left)) && cap=$left
  PART_END=$((SECONDS + cap))
  say "$name (cap ${cap}s, ${left}s of the budget left)"
  return 0
}
part_end() {
  [[ $MODE == dry ]] && return 0
  local secs=$((SECONDS - PART_T0)) state=ran note=
  ((PART_CUT)) && { state="cut"; note="cap ${PART_CAP}s reached: later commands not run"; }
  printf '%s\t%s\t%s\t%s\t%s\n' "$PART" "$state" "$secs" "$PART_CAP" "$note" >> "$PARTS"
  publish
}
row() { [[ $MODE == dry ]] || echo "{\"part\": \"$PART\", ${1#\{}" >> "$RESULTS"; }
fail_row() { row "{\"kind\": \"error\", \"name\": \"$1\", \"error\": \"$2\"}"; }
skip_row() { row "{\"kind\": \"skipped\", \"name\": \"$1\", \"why\": \"$2\"}"; }
# One command: printed; run unless dry, within LIMIT and the part's cap; output in LOGS/$1.log.
# Status 125: not started (the part's cap is reached; recorded as skipped).
run() {
  local name=$1; shift
  printf '   $ %s\n' "$*" >&2
  [[ $MODE == dry ]] && return 0
  local left=$((PART_END - SECONDS)) lim=$LIMIT
  if ((left < 5)); then
    PART_CUT=1
    skip_row "$name" "the $PART part's cap (${PART_CAP}s) was reached"
    return 125
  fi
  ((lim > left)) && lim=$left
  timeout -k 10 "$lim" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  ((rc == 124 || rc == 137)) && { echo "   (timed out after ${lim}s)" >> "$LOGS/$name.log"; ((lim < LIMIT)) && PART_CUT=1; }
  [[ -f $WORK/runs/$name/metrics.jsonl ]] && cp "$WORK/runs/$name/metrics.jsonl" "$LOGS/$name.metrics.jsonl"
  ((rc == 0)) || { echo "   ($name failed, rc=$rc; last lines of $LOGS/$name.log:)" >&2; tail -n 5 "$LOGS/$name.log" >&2; }
  return $rc
}

# ------------------------------------------------------------------ smoke
if part_begin smoke "${SMOKE_CAP:-120}"; then
  FAKE=(); [[ $MODE == rehearse ]] && FAKE=(--fake)
  # Written straight into OUT line by line: a kill keeps what was launched.
  run cubin-smoke "$PYTHON" "$ROOT/scripts/gpu/cubin_smoke.py" "${FAKE[@]}" --out "$OUT/smoke.jsonl"
  rc=$?
  if [[ $MODE != dry ]] && ((rc != 125)); then
    if r=$("${CHECK[@]}" smoke "$OUT/smoke.jsonl" "$rc" 2>> "$LOGS/cubin-smoke.log"); then
      row "$r"
    else
      fail_row "cubin smoke" "no result (rc=$rc; logs/cubin-smoke.log)"
    fi
  fi
  part_end
fi

# ------------------------------------------------------------------ tests
# A test executable is CUDA-capable when its source opens a CUDA device (the others run on the
# CPU only and check nothing here). Paths baked in at compile time are provided as links (GPU
# machine only): the trainer (cli tests), the data file and the project directory of the build
# (CARGO_MANIFEST_DIR: cuda_triton reads its vectors there).
# shellcheck source=scripts/gpu/lib.sh
source "$ROOT/scripts/gpu/lib.sh"
provide() { # baked-path target
  [[ -z $1 || -e $1 ]] && return 0
  mkdir -p "$(dirname "$1")" 2>/dev/null && ln -s "$2" "$1" 2>/dev/null ||
    echo "   (cannot link $1 -> $2: tests that use it will fail)" >&2
}
if part_begin tests "${TESTS_CAP:-240}"; then
  exes=(); cpu_exes=()
  while IFS=$'\t' read -r exe kind _ tname pdir _; do
    [[ $exe == tests/* ]] || continue
    if [[ ! -x $PACK/$exe ]]; then
      [[ $MODE == dry ]] && cuda_capable "$PROJECT" "$pdir" "$kind" "$tname" && echo "   not in the pack (not carried): $exe" >&2
      continue
    fi
    if cuda_capable "$PROJECT" "$pdir" "$kind" "$tname"; then exes+=("$exe	$pdir"); else cpu_exes+=("$exe	$pdir"); fi
  done < "$PACK/manifest.tsv"
  ((${#exes[@]})) || { echo "   no CUDA-capable test executable in the pack" >&2; fail_row "CUDA tests" "no CUDA-capable test executable in the pack"; }
  if [[ $MODE == run ]]; then
    read -r baked_trainer baked_data < <(sed -n 's/^baked paths: *//p' "$PACK/BUILD-INFO.txt" 2>/dev/null)
    baked_project=$(sed -n 's/^baked project: *//p' "$PACK/BUILD-INFO.txt" 2>/dev/null)
    if [[ -z $baked_project ]] && ((${#exes[@]})) && grep -qa /tmp/cudaproj/ "$PACK/${exes[0]%%	*}"; then
      baked_project=/tmp/cudaproj  # scripts/gpu/build.sh's PROJ
    fi
    provide "${baked_trainer:-}" "$PACK/bin/trainer"
    provide "${baked_data:-}" "$ROOT/data/tinyshakespeare.txt"
    provide "${baked_project:-}" "$PROJECT"
  fi
  settings=(0 1); [[ ${ALL_TESTS:-0} == 1 ]] && settings+=(cpu)
  for triton in "${settings[@]}"; do
    run_list=("${exes[@]}")
    [[ $triton == cpu ]] && run_list=("${cpu_exes[@]}")
    for e in "${run_list[@]}"; do
      exe=${e%%	*}; pdir=${e#*	}; t=$triton; [[ $t == cpu ]] && t=0
      name=$(basename "$exe").triton$triton
      label="$(basename "$exe") (CANDLE_FUSED_TRITON=$t)"; [[ $triton == cpu ]] && label="$(basename "$exe") (CPU-only executable)"
      cd "$PROJECT/$pdir" || { fail_row "$name" "no directory $PROJECT/$pdir"; continue; }
      # --show-output: libtest prints what passing trials wrote too (a "no CUDA device" notice
      # from a trial that returned early would otherwise be captured and lost)
      run "$name" env CANDLE_FUSED_TRITON="$t" CANDLE_FUSED_VECTORS="$PROJECT/candle-fused/triton/vectors" \
        "$PACK/$exe" --show-output
      rc=$?
      cd "$ROOT" || exit 1
      [[ $MODE == dry ]] || ((rc == 125)) && continue
      if r=$("${CHECK[@]}" libtest "$LOGS/$name.log" "$rc" "$MODE" 2>> "$LOGS/gpu_check.log"); then
        row "{\"kind\": \"test-exe\", \"name\": \"$label\", \"exe\": \"$exe\", \"triton\": \"$triton\", ${r#\{}"
      else
        fail_row "$label" "cannot read its output (logs/$name.log)"
      fi
    done
  done
  part_end
fi

# ------------------------------------------------------------------ train
# nanoGPT's CPU baby GPT (configs/shakespeare_char.toml) for TRAIN_STEPS steps, no evaluation
# between. Tolerances: f32 with TF32 off differs from the CPU only by summation order (cuBLAS vs
# the CPU GEMM, device reductions): ~1e-6 relative per op, ~1e-5 on the loss after 20 AdamW
# steps; 1e-3 leaves room and still fails on a wrong kernel, or on different dropout masks
# (another mask moves the loss by ~1e-2 at dropout 0.2). Remat recomputes the same ops on the
# same values: the same bits, losses and gradient norms.
TRAIN_SHAPE=()  # the rehearsal: a tiny model, the same code paths
[[ $MODE == rehearse ]] && TRAIN_SHAPE=(--n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --batch-size 4)
train() { # name device extra-args...
  local name=$1 dev=$2; shift 2
  run "$name" "$TRAINER" train --config "$ROOT/configs/shakespeare_char.toml" "${TRAIN_SHAPE[@]}" --device "$dev" \
    --data-path "$ROOT/data/tinyshakespeare.txt" --cache-dir "$WORK/cache" \
    --out-dir "$WORK/runs/$name" --overwrite --max-iters "$TRAIN_STEPS" \
    --lr-decay-iters "$TRAIN_STEPS" --warmup-iters 5 --eval-interval 100000 --eval-iters 1 \
    --peak-flops 1e12 "$@"
}
compare() { # row-name run-a run-b tolerance
  [[ $MODE == dry ]] && { printf '   compare %s vs %s (tolerance %s)\n' "$2" "$3" "$4" >&2; return; }
  local r
  if [[ ! -f $WORK/runs/$2/metrics.jsonl || ! -f $WORK/runs/$3/metrics.jsonl ]] && ((PART_CUT)); then
    skip_row "$1" "the $PART part's cap was reached before both runs"
  elif r=$("${CHECK[@]}" losses "$WORK/runs/$2" "$WORK/runs/$3" "$4" 2>> "$LOGS/compare.log"); then
    row "{\"kind\": \"losses\", \"name\": \"$1\", \"tol\": $4, ${r#\{}"
  else
    fail_row "$1" "no comparable runs ($2, $3)"
  fi
}
if part_begin train "${TRAIN_CAP:-240}"; then
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
  part_end
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
  local name=ours-$case-$variant mem=$LOGS/mem-ours-$case-$variant.txt r
  poll "$mem"
  run "$name" "$TRAINER" train --device "$DEV" --dtype bf16 --tf32 true --out-dir "$WORK/runs/$name" \
    --overwrite --cache-dir "$WORK/cache" --max-iters $((WARMUP + STEPS)) --eval-interval 100000 \
    --eval-iters 1 --peak-flops 1e15 --warmup-iters 2 --grad-clip 1.0 --weight-decay 0.1 "$@"
  local rc=$?
  unpoll
  [[ $MODE == dry ]] || ((rc == 125)) && return
  if ((rc == 0)) && r=$("${CHECK[@]}" ours "$case" "$WORK/runs/$name" "$mem" "$WARMUP"); then
    row "{\"kind\": \"bench\", \"variant\": \"$variant\", ${r#\{}"
  else
    fail_row "$case: ours ($variant)" "the trainer run failed, rc=$rc (logs/$name.log)"
  fi
}
bench_torch() { # case torch-args...
  local case=$1; shift
  local mem=$LOGS/mem-torch-$case.txt r
  poll "$mem"
  run "torch-$case" "$PYTHON" "$ROOT/scripts/gpu/torch_gpu_step.py" --case "$case" --device "$DEV" \
    --steps "$STEPS" --warmup "$WARMUP" "$@"
  local rc=$?
  unpoll
  [[ $MODE == dry ]] || ((rc == 125)) && return
  if ((rc == 0)) && r=$("${CHECK[@]}" torch "$case" "$LOGS/torch-$case.log" "$mem"); then
    row "{\"kind\": \"bench\", ${r#\{}"
  else
    fail_row "$case: PyTorch" "the PyTorch run failed, rc=$rc (logs/torch-$case.log)"
  fi
}
# Shapes (rehearsal: tiny ones, the same code paths) and each case's trainer arguments.
GPT2=(--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8)
CHAR=(--n-layer 6 --n-head 6 --n-embd 384 --block-size 256 --batch-size 64)
LLAMA_MODEL=(--n-layer 30 --n-head 9 --n-kv-head 3 --n-embd 576 --mlp-hidden 1536)
LLAMA_ROWS=(--block-size 1024 --batch-size 8)
GPT2_VOCAB=50304; LLAMA_VOCAB=49152; TOKENS=2000000; TINY=()
if [[ $MODE == rehearse ]]; then
  GPT2=(--n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --batch-size 4); CHAR=("${GPT2[@]}")
  LLAMA_MODEL=(--n-layer 2 --n-head 4 --n-kv-head 2 --n-embd 64 --mlp-hidden 128)
  LLAMA_ROWS=(--block-size 64 --batch-size 4)
  LLAMA_VOCAB=512; TOKENS=20000; TINY=(--tiny)
fi
LLAMA_ARCH=(--arch llama "${LLAMA_MODEL[@]}" --bias false --tie-embeddings true --rope-theta 100000)
ours_args() { # case: the trainer's arguments for it (nanoGPT's / transformers' recipes)
  case $1 in
    # nanoGPT's train.py: no biases, dropout 0, lr 6e-4, betas (0.9, 0.95).
    gpt2) echo "${GPT2[*]} --data shards --data-path $WORK/data/gpt2 --bias false --dropout 0 --lr 6e-4 --min-lr 6e-5 --beta2 0.95" ;;
    # nanoGPT's config/train_shakespeare_char.py (bias False from train.py's defaults).
    shakespeare-char) echo "${CHAR[*]} --data char --data-path $ROOT/data/tinyshakespeare.txt --bias false --dropout 0.2 --lr 1e-3 --beta2 0.99" ;;
    smollm2-135m) echo "${LLAMA_ARCH[*]} ${LLAMA_ROWS[*]} --data shards --data-path $WORK/data/llama --lr 3e-4 --beta2 0.95" ;;
    # PEFT's LoRA as torch_gpu_step.py's: r 16, alpha 16 (the default), all-linear, bf16 base.
    smollm2-135m-lora) echo "--init-from $WORK/base-llama --lora-r 16 --lora-targets all-linear --base-dtype bf16 ${LLAMA_ROWS[*]} --data shards --data-path $WORK/data/llama --lr 3e-4 --beta2 0.95" ;;
  esac
}
# The data (random tokens) and the LoRA case's base: a random model at the Llama shape made by
# the trainer itself (0 steps, exported in bf16: no download, no Python), once for bench and counts.
SETUP_DONE=0
setup_cases() {
  ((SETUP_DONE)) && return 0
  SETUP_DONE=1
  run data-gpt2 "${CHECK[@]}" make-data "$WORK/data/gpt2" "$GPT2_VOCAB" "$TOKENS"
  run data-llama "${CHECK[@]}" make-data "$WORK/data/llama" "$LLAMA_VOCAB" "$TOKENS"
  run base-llama-train "$TRAINER" train --device "$DEV" "${LLAMA_ARCH[@]}" "${LLAMA_ROWS[@]}" --data shards \
    --data-path "$WORK/data/llama" --max-iters 0 --eval-iters 1 --out-dir "$WORK/runs/base-llama" --overwrite &&
    run base-llama-export "$TRAINER" export "$WORK/runs/base-llama" "$WORK/base-llama" --dtype bf16
}
CASES=(gpt2 shakespeare-char smollm2-135m smollm2-135m-lora)
if part_begin bench "${BENCH_CAP:-300}"; then
  say "bench: ours vs PyTorch (nanoGPT eager; transformers SDPA; PEFT), $WARMUP warm-up + $STEPS timed steps each"
  setup_cases
  for variant in default triton; do
    T=(--triton-kernels false); [[ $variant == triton ]] && T=(--triton-kernels true)
    for c in "${CASES[@]}"; do
      # shellcheck disable=SC2046 # the case's arguments are words without spaces
      bench_ours "$c" "$variant" "${T[@]}" $(ours_args "$c")
    done
  done
  for c in "${CASES[@]}"; do bench_torch "$c" "${TINY[@]}"; done
  part_end
fi

# ------------------------------------------------------------------ counts
# CUDA driver calls per step, by cucount.c (LD_PRELOAD on the real driver, as Nsight Compute
# would replay every kernel): each case runs WARMUP + COUNT_STEPS steps and WARMUP steps under the
# counter; per step = the difference / COUNT_STEPS. The shorter run also times every kernel
# (CUCOUNT_TIME=1: events around each launch) for the table of where the GPU time goes.
COUNT_STEPS=${COUNT_STEPS:-5}
counted() { # name timing command...
  local name=$1 timing=$2; shift 2
  run "$name" env LD_PRELOAD="$CUCOUNT" CUCOUNT_OUT="$LOGS/$name.json" CUCOUNT_TIME="$timing" "$@"
}
count_case() { # impl case
  local impl=$1 c=$2 n r
  for n in $((WARMUP + COUNT_STEPS)) "$WARMUP"; do
    local timing=0; ((n == WARMUP)) && timing=1
    if [[ $impl == ours ]]; then
      # shellcheck disable=SC2046
      counted "count-$impl-$c-$n" "$timing" "$TRAINER" train --device "$DEV" --dtype bf16 --tf32 true \
        --out-dir "$WORK/runs/count-$c-$n" --overwrite --cache-dir "$WORK/cache" --max-iters "$n" \
        --eval-interval 100000 --eval-iters 1 --warmup-iters 2 --grad-clip 1.0 --weight-decay 0.1 \
        --triton-kernels true $(ours_args "$c") || return
    else
      counted "count-$impl-$c-$n" "$timing" "$PYTHON" "$ROOT/scripts/gpu/torch_gpu_step.py" --case "$c" \
        --device "$DEV" --warmup "$n" --steps 0 "${TINY[@]}" || return
    fi
  done
  [[ $MODE == dry ]] && return
  if r=$("${CHECK[@]}" counts "$impl" "$c" "$LOGS/count-$impl-$c-$((WARMUP + COUNT_STEPS)).json" \
      "$LOGS/count-$impl-$c-$WARMUP.json" "$COUNT_STEPS" "$MODE" 2>> "$LOGS/gpu_check.log"); then
    row "$r"
  else
    fail_row "driver calls: $impl $c" "no counts (logs/count-$impl-$c-*.json)"
  fi
}
if part_begin counts "${COUNTS_CAP:-120}"; then
  CUCOUNT=$PACK/bin/libcucount.so
  if [[ ! -f $CUCOUNT && $MODE != dry ]]; then
    CUCOUNT=$WORK/libcucount.so
    cc -O2 -shared -fPIC -o "$CUCOUNT" "$ROOT/scripts/gpu/cucount.c" -ldl -lpthread > "$LOGS/cucount-cc.log" 2>&1 ||
      CUCOUNT=
  fi
  if [[ -z $CUCOUNT ]]; then
    fail_row "driver calls per step" "no libcucount.so in the pack and cc failed (logs/cucount-cc.log)"
  else
    setup_cases
    for c in smollm2-135m-lora gpt2; do
      count_case ours "$c"
      count_case torch "$c"
    done
  fi
  part_end
fi

# ------------------------------------------------------------------ profile (only when asked)
# Where the GPU time goes, kernel by kernel: Nsight Compute's gpu__time_duration of every launch
# of a short run (PROFILE_STEPS, 2), without locking the clocks; each launch is replayed once, so
# the run is slower than the step, the kernel times are not. `gpu_check.py`-free: the CSVs come
# back in logs.tar.xz and are summed per kernel name off the machine.
PROFILE_STEPS=${PROFILE_STEPS:-2}
profiled() { # name command...
  local name=$1; shift
  run "$name" ncu --csv --metrics gpu__time_duration.sum --clock-control none "$@"
}
if part_begin profile "${PROFILE_CAP:-400}"; then
  if ! command -v ncu > /dev/null && [[ $MODE != dry ]]; then
    skip_row "profile" "no ncu on this machine"
  else
    setup_cases
    for c in gpt2 smollm2-135m-lora; do
      # shellcheck disable=SC2046
      profiled "ncu-ours-$c" "$TRAINER" train --device "$DEV" --dtype bf16 --tf32 true \
        --out-dir "$WORK/runs/ncu-$c" --overwrite --cache-dir "$WORK/cache" --max-iters "$PROFILE_STEPS" \
        --eval-interval 100000 --eval-iters 1 --warmup-iters 2 --grad-clip 1.0 --weight-decay 0.1 \
        --triton-kernels true $(ours_args "$c")
      profiled "ncu-torch-$c" "$PYTHON" "$ROOT/scripts/gpu/torch_gpu_step.py" --case "$c" --device "$DEV" \
        --warmup "$PROFILE_STEPS" --steps 0 "${TINY[@]}"
    done
  fi
  part_end
fi

# ------------------------------------------------------------------ summary
[[ $MODE == dry ]] && { say "dry run: the pack and the files above are in place"; exit 0; }
publish
cat "$OUT/summary.md"
say "done in $((SECONDS - T0))s; OUT: $(cd "$OUT" && ls)"
"${CHECK[@]}" table "$RESULTS" > /dev/null
