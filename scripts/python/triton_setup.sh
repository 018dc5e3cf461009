#!/usr/bin/env bash
# Create the pinned Python environment for the Triton kernels (candle-fused/triton/*.py):
# ahead-of-time compilation to cubin (scripts/python/triton_compile.py) and the CPU check
# under TRITON_INTERPRET=1 (scripts/python/triton_interpret_check.py).
#
#     scripts/python/triton_setup.sh [VENV_DIR]     # default: .venv-triton at the repository root
#
# Why torch: Triton's interpreter (TRITON_INTERPRET=1) launches kernels on torch tensors
# (it reads `data_ptr()`/`dtype` and copies them through numpy), so the CPU torch wheel is
# needed; the AOT compile (`triton.compile(ASTSource, target=GPUTarget)`) needs only triton.
# Both are installed with `--no-deps` from the pins below, as in setup.sh: PyPI's Linux torch
# wheel declares several GB of CUDA wheels, never loaded on the CPU, and `import torch` then
# needs the do-nothing CUDA stubs that cuda_stubs.py builds (needs `cc` and `readelf`).
# Triton's wheel carries its own ptxas/cuobjdump/nvdisasm (triton/backends/nvidia/bin), which
# run on an x86_64 CPU without a GPU or CUDA toolkit; the committed cubins are built with CUDA
# 13.0's ptxas instead (scripts/gpu/cubins.sh: TRITON_PTXAS_PATH, the GPU machines' release).
#
# Speed-up: pip's own PIP_FIND_LINKS is honoured, e.g. PIP_FIND_LINKS=/work/pipdl for a
# torch wheel downloaded before.  PYTHON selects the interpreter (pins are for CPython 3.11).
#
# Nothing here is needed by `cargo test`: the cubins, their metadata, the test vectors and
# the interpreter record are committed.
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

VENV="${1:-$ROOT/.venv-triton}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi

# Pins (resolved 2026-11-26, CPython 3.11 manylinux x86_64). torch's pure-Python
# dependencies are those of requirements.txt.
pip_pinned "$VENV" \
    triton==3.9.0 torch==2.15.0 numpy==2.4.6 safetensors==0.8.0 \
    filelock==4.3.1 fsspec==2026.9.0 jinja2==3.1.6 markupsafe==3.0.4 mpmath==1.3.0 \
    networkx==3.6.1 setuptools==84.2.1 sympy==1.14.0 typing-extensions==4.16.0

torch_or_stubs "$VENV"

"$VENV/bin/python" - <<'PY'
import torch, triton, numpy, safetensors
print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__,
      "safetensors", safetensors.__version__)
PY
echo "triton_setup.sh: ok: $VENV"
