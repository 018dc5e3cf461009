"""What the Triton scripts (triton_compile.py, triton_interpret_check.py) share: where the
kernel families live and how one is loaded. Imports no Triton, so each script sets its own
environment (`TRITON_INTERPRET`, ...) before Triton is first imported."""

import hashlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = ROOT / "candle-fused" / "triton"


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def families(names=None):
    """{family: (path, module)} of candle-fused/triton/*.py (or of `names`, exiting with the
    unknown ones named), sorted by name."""
    paths = sorted(p for p in TRITON_DIR.glob("*.py") if not p.name.startswith("_"))
    if names:
        missing = set(names) - {p.stem for p in paths}
        if missing:
            sys.exit(f"no such family: {sorted(missing)}")
        paths = [p for p in paths if p.stem in names]
    sys.path.insert(0, str(TRITON_DIR))
    return {p.stem: (p, load_module(p)) for p in paths}
