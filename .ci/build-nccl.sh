#!/usr/bin/env bash
# build-nccl.sh: build check of candle-comm's NCCL backend (`--features nccl,cuda`) on a machine with
# no GPU and no CUDA toolkit. NOT part of .ci/run (CI stays CPU-only and within its time budget):
# run it by hand, from anywhere in the repository:
#
#   bash .ci/build-nccl.sh              # ~10 min cold on 2 cores (wheels + candle's CUDA kernels)
#   TOOLKIT_ONLY=1 bash .ci/build-nccl.sh   # only assemble the CUDA root, print the env to use
#
# 1. pip-downloads the CUDA 13.0 wheels that scripts/gpu/build.sh pins, plus NCCL
#    (nvidia-nccl-cu13, the version cudarc's `nccl` feature binds: 2.30), into $WHEELS;
# 2. assembles build.sh's CUDA root in $CUDA_ROOT_DIR (its steps: same paths, same layout) with
#    its link-time stub libcuda.so, and adds NCCL's header and libnccl.so to it;
# 3. builds and lints candle-comm with `--features nccl,cuda` (and `nccl,cuda,mpi` when mpicc is
#    there), tests and examples included, in this checkout, with its own target dir.
#
# Why NCCL is needed at link time: candle-core turns on cudarc's `dynamic-linking`, so cudarc emits
# `-lnccl` (cudarc cannot mix it with `dynamic-loading`). At run time libnccl.so.2 must be on the
# loader path of the GPU machine (e.g. PyTorch's nvidia/nccl/lib, or /usr/local/cuda/lib64).
#
# Overridable: CARGO_TARGET_DIR WHEELS CUDA_ROOT_DIR JOBS CUDA_COMPUTE_CAP NCCL_PIN
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/nccl-target}
WHEELS=${WHEELS:-/tmp/cudawheels}
CUDA_ROOT_DIR=${CUDA_ROOT_DIR:-/tmp/cudaroot}
JOBS=${JOBS:-2}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
NCCL_PIN=${NCCL_PIN:-nvidia-nccl-cu13==2.30.7}
export CARGO_TERM_COLOR=never
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
T0=$SECONDS

# ------------------------------------------------------------------ 1-2. wheels, CUDA root, stub
# scripts/gpu/build.sh's steps (its pins, paths and layout: the root is shared with it), with the
# NCCL wheel downloaded alongside; its stub step reads cudarc's bindings from this checkout.
cargo fetch -q
EXTRA_WHEELS=$NCCL_PIN WHEELS=$WHEELS CUDA_ROOT_DIR=$CUDA_ROOT_DIR PROJ=$ROOT \
  bash "$ROOT/scripts/gpu/build.sh" wheels root stub
wheel_of() { local name=${1%%==*} ver=${1##*==}; compgen -G "$WHEELS/${name//-/_}-${ver}-*.whl" | head -1; }

# NCCL: the wheel holds nvidia/nccl/{include,lib}; its soname is libnccl.so.2.
NCCL_MARK=$CUDA_ROOT_DIR/.nccl-${NCCL_PIN##*==}
if [[ ! -f $NCCL_MARK ]]; then
  log "adding NCCL (${NCCL_PIN}) to $CUDA_ROOT_DIR"
  stage=$(mktemp -d)
  unzip -q -o "$(wheel_of "$NCCL_PIN")" 'nvidia/nccl/include/nccl.h' 'nvidia/nccl/lib/*' -d "$stage"
  cp "$stage"/nvidia/nccl/include/nccl.h "$CUDA_ROOT_DIR/include/"
  cp -a "$stage"/nvidia/nccl/lib/libnccl.so* "$CUDA_ROOT_DIR/lib/"
  ln -sfn libnccl.so.2 "$CUDA_ROOT_DIR/lib/libnccl.so"
  rm -rf "$stage"
  rm -f "$CUDA_ROOT_DIR"/.nccl-*
  touch "$NCCL_MARK"
fi

export PATH=$CUDA_ROOT_DIR/bin:$PATH
export CUDA_HOME=$CUDA_ROOT_DIR CUDA_ROOT=$CUDA_ROOT_DIR CUDA_PATH=$CUDA_ROOT_DIR
export NVCC=$CUDA_ROOT_DIR/bin/nvcc
export CUDARC_CUDA_VERSION=13000
[[ $(nvcc --version) == *"release 13.0,"* ]] || { echo "nvcc is not 13.0" >&2; exit 1; }

if [[ ${TOOLKIT_ONLY:-0} == 1 ]]; then
  cat <<EOF
CUDA root ready ($((SECONDS - T0)) s). Environment for cargo:
export PATH=$CUDA_ROOT_DIR/bin:\$PATH CUDA_HOME=$CUDA_ROOT_DIR CUDA_ROOT=$CUDA_ROOT_DIR CUDA_PATH=$CUDA_ROOT_DIR
export NVCC=$CUDA_ROOT_DIR/bin/nvcc CUDARC_CUDA_VERSION=13000 CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP
export RUSTFLAGS="-C link-arg=-Wl,-rpath,/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib"
EOF
  exit 0
fi

# ------------------------------------------------------------------ 3. build and lint
# RUNPATH as scripts/gpu/build.sh, so the GPU machine finds its CUDA libraries without LD_LIBRARY_PATH.
export RUSTFLAGS="${RUSTFLAGS:-} -C link-arg=-Wl,-rpath,/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib"
feature_sets=("nccl,cuda")
if command -v mpicc >/dev/null; then feature_sets+=("nccl,cuda,mpi"); fi
for feats in "${feature_sets[@]}"; do
  log "cargo build -p candle-comm --release --features $feats --tests --examples"
  cargo build -j "$JOBS" -p candle-comm --release --features "$feats" --tests --examples
  log "cargo clippy -p candle-comm --all-targets --release --features $feats -- -D warnings"
  cargo clippy -j "$JOBS" -p candle-comm --all-targets --release --features "$feats" -- -D warnings
done

# The link-time stub stands in for the driver: the unit tests (rendezvous file, abort notice,
# header format) run for real; tests/nccl.rs finds no CUDA device and skips (the real check needs
# a GPU machine; see candle-comm/README.md, "NCCL").
log "running the unit tests and tests/nccl.rs against the stub driver (expect: skipping: no CUDA device)"
out=$(LD_LIBRARY_PATH=$CUDA_ROOT_DIR/lib/stubs/run:$CUDA_ROOT_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  cargo test -j "$JOBS" -p candle-comm --release --features nccl,cuda --lib --test nccl -- --nocapture 2>&1) \
  || { echo "$out"; exit 1; }
echo "$out" | grep -E '^test |skipping|test result'
grep -q 'skipping: no CUDA device' <<<"$out" || { echo "expected the nccl tests to skip" >&2; exit 1; }
log "done in $((SECONDS - T0)) s ($ROOT)"
