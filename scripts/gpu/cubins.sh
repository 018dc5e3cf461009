#!/usr/bin/env bash
# cubins.sh: compile the Triton kernels (candle-fused/kernels/<entry>.<dtype>.sm80|sm90.cubin and
# .json) with CUDA 13.0's ptxas, the pinned one (the GPU machines' driver is CUDA 13.0; Triton's
# bundled ptxas is 12.9 for sm_80 and 13.4 for sm_90).
#
#   scripts/gpu/cubins.sh            # rewrite the committed files
#   scripts/gpu/cubins.sh --check    # recompile into a temporary directory; fail unless identical
#   scripts/gpu/cubins.sh [--check] rms_norm attention    # some families only
#
# The ptxas is the one of the nvidia-cuda-nvcc==13.0.88 wheel in the CUDA root that
# scripts/gpu/build.sh assembles (its `root` step is run here when the root is missing).
# The Python environment is .venv-triton (scripts/python/triton_setup.sh; created when missing).
# Overridable: CUDA_ROOT_DIR (/tmp/cudaroot), PTXAS (its bin/ptxas), VENV (.venv-triton).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CUDA_ROOT_DIR=${CUDA_ROOT_DIR:-/tmp/cudaroot}
PTXAS=${PTXAS:-$CUDA_ROOT_DIR/bin/ptxas}
VENV=${VENV:-$ROOT/.venv-triton}

if [[ ! -x $PTXAS ]]; then
  [[ $PTXAS == "$CUDA_ROOT_DIR/bin/ptxas" ]] || { echo "cubins.sh: no ptxas at $PTXAS" >&2; exit 1; }
  echo "cubins.sh: no CUDA root at $CUDA_ROOT_DIR: assembling it (scripts/gpu/build.sh root)" >&2
  CUDA_ROOT_DIR=$CUDA_ROOT_DIR bash "$ROOT/scripts/gpu/build.sh" root
fi
# triton_compile.py checks the release again, for every arch, on the ptxas Triton will run
# (grep reads all of it: `grep -q` would stop at the match and, under pipefail, ptxas's SIGPIPE would fail the check)
if ! "$PTXAS" --version | grep 'release 13\.0,' >/dev/null; then
  echo "cubins.sh: $PTXAS is not CUDA 13.0's ptxas:" >&2
  "$PTXAS" --version >&2
  exit 1
fi
if [[ ! -x $VENV/bin/python ]]; then
  echo "cubins.sh: no $VENV: running scripts/python/triton_setup.sh" >&2
  bash "$ROOT/scripts/python/triton_setup.sh" "$VENV"
fi

# Triton 3.9 runs TRITON_PTXAS_PATH for sm_80 and TRITON_PTXAS_BLACKWELL_PATH for sm_90 and up.
export TRITON_PTXAS_PATH=$PTXAS TRITON_PTXAS_BLACKWELL_PATH=$PTXAS
cd "$ROOT"
"$VENV/bin/python" scripts/python/triton_compile.py "$@"
# then the SASS record of every cubin (registers, spills, load widths, sha256), which
# `cargo test` (src/cuda_kernels/audit_tests/cubin_info_tests.rs) holds to the cubins
if [[ " $* " == *" --check "* ]]; then
  exec "$VENV/bin/python" scripts/python/cubin_record.py --check
fi
exec "$VENV/bin/python" scripts/python/cubin_record.py
