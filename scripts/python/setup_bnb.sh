#!/usr/bin/env bash
# Create the venv for the NF4 / QLoRA reference fixtures (scripts/python/make_nf4_fixtures.py,
# make_qlora_fixtures.py): bitsandbytes 0.50.2 (pinned; its CPU backend quantizes,
# dequantizes and runs a 4-bit model) over the venv made by setup.sh.
#
#     scripts/python/setup_bnb.sh [BASE_VENV] [VENV]     # defaults: .venv-py, .venv-bnb
#
# The new venv sees BASE_VENV's packages (--system-site-packages over its interpreter), so
# torch, transformers and PEFT are the pinned ones of requirements.txt. bitsandbytes is
# installed with --no-deps (its dependencies, torch, numpy, packaging, are already there).
# The `kernels` package is NOT installed: it tries a download at import.
#
# Nothing here is needed by `cargo test`: the fixtures it produces are committed.
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

BASE="${1:-$ROOT/.venv-py}"
VENV="${2:-$ROOT/.venv-bnb}"

if [ ! -x "$BASE/bin/python" ]; then
    echo "setup_bnb.sh: no base venv at $BASE (run scripts/python/setup.sh first)" >&2
    exit 1
fi
# The base venv's interpreter, with its site-packages visible from the new venv.
if [ ! -x "$VENV/bin/python" ]; then
    "$BASE/bin/python" -m venv --system-site-packages "$VENV"
    # A venv over a venv sees the base interpreter's site-packages, not the base venv's:
    # add the base venv's through a .pth file.
    purelib "$BASE/bin/python" > "$(purelib "$VENV/bin/python")/base_venv.pth"
fi
pip_pinned "$VENV" bitsandbytes==0.50.2

"$VENV/bin/python" - <<'PY'
import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch

assert bnb.__version__ == "0.50.2", bnb.__version__
w = torch.randn(4, 64)
q, state = F.quantize_4bit(w, quant_type="nf4", blocksize=64)
back = F.dequantize_4bit(q, state)
print("bitsandbytes", bnb.__version__, "on", w.device, "nf4 round trip max error",
      float((back - w).abs().max()))
PY
echo "setup_bnb.sh: ok: $VENV"
