#!/usr/bin/env bash
# Create the pinned Python environment for the reference-fixture scripts
# (scripts/python/*.py) and bench/torch_llama_step.py.
#
#     scripts/python/setup.sh [VENV_DIR]        # default: .venv-py at the repository root
#
# Only PyPI is needed.  Every package, torch included, is installed from
# scripts/python/requirements.txt with `--no-deps`: PyPI's Linux torch wheel declares
# several GB of CUDA wheels (nvidia-*, cuda-*, triton), so the full dependency set is
# pinned in requirements.txt instead of resolved.  That wheel's libraries are still
# linked against the CUDA libraries, so `import torch` fails without them:
# cuda_stubs.py then builds do-nothing stand-ins (needs `cc` and `readelf`), enough for
# CPU-only use (torch.cuda.is_available() is False).  To use a GPU instead, install the
# real CUDA wheels into the venv (`pip install torch==<pin>` without --no-deps): they
# take precedence over the stubs.
#
# Speed-up: pip's own PIP_FIND_LINKS is honoured, e.g. with a torch wheel downloaded
# before:  PIP_FIND_LINKS=/path/to/wheels scripts/python/setup.sh
# PYTHON selects the interpreter (default python3; the pins are for CPython 3.11).
#
# Nothing here is needed by `cargo test`: the fixtures it produces are committed.
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

VENV="${1:-$ROOT/.venv-py}"
PYTHON="${PYTHON:-python3}"

echo "setup.sh: interpreter $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'), venv $VENV"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup.sh: warning: requirements.txt was resolved for CPython 3.11;" \
        "binary wheels for other versions may not exist at these pins" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip_pinned "$VENV" -r "$HERE/requirements.txt"

torch_or_stubs "$VENV"

"$VENV/bin/python" - <<'EOF'
import importlib

import torch

print("torch", torch.__version__, "sum of randn(2):", float(torch.randn(2).sum()))
for name in ["transformers", "peft", "trl", "safetensors", "numpy", "accelerate", "datasets"]:
    mod = importlib.import_module(name)
    print(name, mod.__version__)
# the model classes the fixture scripts use
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM  # noqa: F401
EOF
echo "setup.sh: ok: $VENV"
