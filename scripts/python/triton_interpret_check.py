#!/usr/bin/env python3
"""Run the Triton RMSNorm kernels under the CPU interpreter (TRITON_INTERPRET=1) on the test
vectors written by the Rust CPU kernel, compare, and record the result.

    .venv-triton/bin/python scripts/python/triton_interpret_check.py

Reads `candle-fused/triton/vectors/*.safetensors` (written by
`WRITE_TRITON_VECTORS=candle-fused/triton/vectors cargo test -p candle-fused --release --test
triton_vectors`), runs `rms_norm_fwd`, `rms_norm_bwd_dx` and `rms_norm_bwd_dw` with the same
constexprs that triton_compile.py compiles, and writes `candle-fused/triton/interpret_record.json`:
the sha256 of the kernel source and of every vector file, the command, the versions, the
tolerances and the max errors. `cargo test` (tests/triton_record.rs) fails when a source or a
vector file no longer matches the record, so a changed kernel has to be checked here again.
Exits non-zero (and writes no record) if any error exceeds its tolerance.

Errors are measured as |triton - rust| divided by the largest |rust| in the same row (y, dx:
rows have magnitudes 1, 1e3 and 1e-3, and dx scales with 1/magnitude), by the largest |rust|
of the tensor (dw), or elementwise relative (rstd). Tolerances and why:
* f32 outputs, rstd (f32 for every dtype): both sides compute in f32 with different summation
  orders (the Rust kernel's 8-lane sums vs the interpreter's numpy reduction), a few ulp of
  2^-24 times log(C); dx adds the cancellation `g - xhat * mean(g xhat)`. y, rstd: 4e-6;
  dx, dw: 2e-5.
* bf16 / f16 outputs: both sides round (nearly) the same f32 value once; when it straddles a
  rounding boundary they differ by one unit in the last place, 2^-7 (bf16) / 2^-10 (f16)
  relative to the value, so at most that relative to the row's largest value.
  bf16 caveat: Triton 3.9's interpreter converts f32 -> bf16 by truncation (even with
  fp_downcast_rounding="rtne"), while the compiled kernels use cvt.rn.bf16.f32; for bf16 the
  kernels are run with f32 outputs and rounded to nearest even by torch (see main()).
The record also gives, per tensor, [elements differing, max ulp] against the Rust bits.
"""
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402

import numpy  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "candle-fused" / "triton" / "rms_norm.py"
VECTORS = ROOT / "candle-fused" / "triton" / "vectors"
RECORD = ROOT / "candle-fused" / "triton" / "interpret_record.json"

TOL = {
    "f32": {"y": 4e-6, "rstd": 4e-6, "dx": 2e-5, "dw": 2e-5},
    "bf16": {"y": 2.0**-7, "rstd": 4e-6, "dx": 2.0**-7, "dw": 2.0**-7},
    "f16": {"y": 2.0**-10, "rstd": 4e-6, "dx": 2.0**-10, "dw": 2.0**-10},
}


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def rel(path):
    return str(Path(path).relative_to(ROOT))


def load_module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(m, t, out_dtype=None):
    """The three kernels on the vectors `t`; `out_dtype` overrides the dtype of y, dx, dw."""
    x, w, dy = t["x"], t["w"], t["dy"]
    eps = float(t["eps"][0])
    n, c = x.shape
    assert c <= m.FWD_BLOCK_C and c <= m.BWD_BLOCK_C
    out_dtype = out_dtype or x.dtype
    y = torch.empty(x.shape, dtype=out_dtype)
    rstd = torch.empty(n, dtype=torch.float32)
    m.rms_norm_fwd[(n,)](x, w, y, rstd, n, c, eps, BLOCK_C=m.FWD_BLOCK_C)
    p = triton.cdiv(n, m.BWD_ROWS_PER_PROGRAM)
    dx = torch.empty(x.shape, dtype=out_dtype)
    dw_partial = torch.empty((p, c), dtype=torch.float32)
    m.rms_norm_bwd_dx[(p,)](x, w, dy, rstd, dx, dw_partial, n, c,
                            BLOCK_C=m.BWD_BLOCK_C, ROWS_PER_PROGRAM=m.BWD_ROWS_PER_PROGRAM)
    dw = torch.empty(w.shape, dtype=out_dtype)
    m.rms_norm_bwd_dw[(triton.cdiv(c, m.DW_BLOCK_C),)](dw_partial, dw, p, c, BLOCK_C=m.DW_BLOCK_C)
    return {"y": y, "rstd": rstd, "dx": dx, "dw": dw}


def error(name, got, ref):
    got, ref = got.double(), ref.double()
    diff = (got - ref).abs()
    if name in ("y", "dx"):
        scale = ref.abs().amax(dim=-1, keepdim=True)
    elif name == "dw":
        scale = ref.abs().amax()
    else:
        scale = ref.abs()
    return float((diff / scale.clamp_min(1e-30)).max())


def ulps(got, ref):
    """[elements differing, max difference in units in the last place] of a 16/32-bit tensor."""
    ity = {2: torch.int16, 4: torch.int32}[got.element_size()]
    d = (got.view(ity).long() - ref.view(ity).long()).abs()
    return [int((d > 0).sum()), int(d.max())]


def main():
    m = load_module(SRC)
    files = sorted(VECTORS.glob("*.safetensors"))
    if not files:
        sys.exit(f"no vectors under {rel(VECTORS)}: run the Rust writer first (see docstring)")
    results, failed = [], []
    for f in files:
        dt = f.name.split(".")[1]
        t = load_file(f)
        if dt == "bf16":
            # The interpreter converts f32 -> bf16 by truncation; the GPU (cvt.rn.bf16.f32 in
            # the cubins) rounds to nearest even. So the kernels store f32 here, rounded to
            # bf16 by torch (nearest even) as the GPU would; the interpreter's own bf16 stores
            # are reported (bf16_store_truncation) but not held to the tolerance.
            out = {k: v.to(torch.bfloat16) if k != "rstd" else v
                   for k, v in run(m, t, torch.float32).items()}
            trunc = run(m, t)
            note = {k: int((trunc[k].view(torch.int16) != t[k].view(torch.int16)).sum())
                    for k in ("y", "dx", "dw")}
        else:
            out, note = run(m, t), None
        errs = {k: error(k, out[k], t[k]) for k in ("y", "rstd", "dx", "dw")}
        for k, e in errs.items():
            if not e <= TOL[dt][k]:
                failed.append(f"{f.name} {k}: {e:.3e} > {TOL[dt][k]:.3e}")
        results.append({"file": rel(f), "sha256": sha256(f), "dtype": dt,
                        "shape": list(t["x"].shape), "max_error": errs,
                        "ulp_differences": {k: ulps(out[k], t[k]) for k in ("y", "dx", "dw")}})
        if note is not None:
            results[-1]["bf16_store_truncation_elements_differing"] = note
        print(f"{f.name}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    if failed:
        sys.exit("triton_interpret_check.py: FAILED\n  " + "\n  ".join(failed))
    record = {
        "command": "TRITON_INTERPRET=1 .venv-triton/bin/python scripts/python/triton_interpret_check.py",
        "kernel_sources": [{"file": rel(SRC), "sha256": sha256(SRC)}],
        "vectors": results,
        "error_measure": "y, dx: max |triton - rust| / max |rust| of the row; dw: / max |rust|; "
                         "rstd: elementwise relative",
        "tolerances": TOL,
        "constexprs": {k: v for k, v in vars(m).items() if k.isupper() and isinstance(v, int)},
        "versions": {"python": platform.python_version(), "triton": triton.__version__,
                     "torch": torch.__version__, "numpy": numpy.__version__,
                     "safetensors": safetensors.__version__},
    }
    RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"all within tolerance; wrote {rel(RECORD)}")


if __name__ == "__main__":
    main()
