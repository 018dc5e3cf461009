# What the venv setup scripts (setup.sh, setup_bnb.sh, triton_setup.sh) share; sourced by
# them, not run: the repository's folders and the steps each script takes the same way.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# The sourcing script's name, for its messages.
SCRIPT="$(basename "${BASH_SOURCE[1]:-$0}")"

# purelib PYTHON: the site-packages folder of PYTHON's environment.
purelib() {
    "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

# pip_pinned VENV ARG...: install exactly the pins named (packages or `-r FILE`) into VENV:
# --no-deps takes the pinned set as it is, --only-binary never builds from source.
pip_pinned() {
    local venv="$1"
    shift
    "$venv/bin/python" -m pip --disable-pip-version-check install --no-deps --only-binary=:all: "$@"
}

# torch_or_stubs VENV: PyPI's Linux torch wheel links the CUDA libraries, so when `import
# torch` fails without the CUDA wheels, build cuda_stubs.py's do-nothing stand-ins (needs `cc`
# and `readelf`), enough for CPU-only use.
torch_or_stubs() {
    if ! "$1/bin/python" -c 'import torch' 2>/dev/null; then
        echo "$SCRIPT: torch does not import without the CUDA wheels: building CPU-only stubs"
        "$1/bin/python" "$HERE/cuda_stubs.py" "$(purelib "$1/bin/python")/torch"
    fi
}
