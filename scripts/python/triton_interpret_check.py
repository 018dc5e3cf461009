#!/usr/bin/env python3
"""Run the Triton kernels under the CPU interpreter (TRITON_INTERPRET=1) on the test vectors
written by the Rust CPU kernels, compare, and record the result.

    .venv-triton/bin/python scripts/python/triton_interpret_check.py [FAMILY ...]

For each family `candle-fused/triton/<family>.py` (default: all; files starting with `_` are
helpers) it reads `candle-fused/triton/vectors/<family>.<dtype>.<case>.safetensors` (written
by `WRITE_TRITON_VECTORS=candle-fused/triton/vectors cargo test -p candle-fused --release
--test triton_vectors`), calls the family's `interpret(tensors, out_dtype)` and compares each
output named in the family's `TOL[dtype]` with the file's tensor of the same name, measured as
the family's `ERROR[name]` says:

* `row`: max |triton - rust| / max |rust| of the same row (last dimension);
* `tensor`: max |triton - rust| / max |rust| of the whole tensor;
* `elem`: elementwise relative, |triton - rust| / |rust|;
* `abs`: max |triton - rust|;
* `exact`: the number of elements whose bits differ (tolerance 0 = bit-identical);
* `row:<input>`: max |triton - rust| / max |input| of the same row, for a per-row output
  (`[N]`) of an input `[N, C]` (e.g. a saved mean, whose own magnitude can be near 0).

An output named in `TOL` is compared when the vector file holds it; a file without it (e.g.
no bias, so no `db`) is fine only if `interpret` did not produce it either.

`out_dtype` is the dtype a kernel should store its io outputs in: the vector's dtype, except
f32 for bf16 vectors. Triton 3.9's interpreter converts f32 -> bf16 by truncation (even with
`fp_downcast_rounding="rtne"`), while the compiled kernels round to nearest even
(`cvt.rn.bf16.f32`), so for bf16 the kernels store f32 and this script rounds each output to
the reference's dtype with torch (nearest even), as the GPU does. Any output whose dtype
differs from its reference's is rounded that way.

Writes `candle-fused/triton/records/<family>.json`: the sha256 of the kernel source and of
every vector file, the command, the versions, the tolerances and the max errors, and per
tensor [elements differing, max ulp] against the Rust bits. `cargo test`
(candle-fused/src/cuda_kernels/audit_tests.rs) fails when a source or a vector file no longer matches its record,
so a changed kernel has to be checked here again. Exits non-zero (and writes no record for
the failing family) if any error exceeds its tolerance.
"""
import json
import os
import platform
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import numpy  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from triton_families import ROOT, TRITON_DIR, families, sha256  # noqa: E402

VECTORS = TRITON_DIR / "vectors"
RECORDS = TRITON_DIR / "records"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def rel(path):
    return str(Path(path).relative_to(ROOT))


def error(mode, got, ref, t):
    if mode.startswith("row:"):
        scale = t[mode[4:]].double().abs().amax(dim=-1)
        diff = (got.double() - ref.double()).abs()
        return float((diff / scale.clamp_min(1e-30)).max()) if diff.numel() else 0.0
    if mode == "exact":
        return float(ulps(got, ref)[0])
    got, ref = got.double(), ref.double()
    diff = (got - ref).abs()
    if mode == "abs":
        return float(diff.max()) if diff.numel() else 0.0
    if mode == "row":
        scale = ref.abs().amax(dim=-1, keepdim=True)
    elif mode == "tensor":
        scale = ref.abs().amax()
    elif mode == "elem":
        scale = ref.abs()
    else:
        raise ValueError(f"unknown error mode {mode!r}")
    return float((diff / scale.clamp_min(1e-30)).max()) if diff.numel() else 0.0


def ulps(got, ref):
    """[elements differing, max difference in units in the last place] of two tensors of the
    same 16/32-bit dtype (integers: [elements differing, max |difference|])."""
    if got.numel() == 0:
        return [0, 0]
    if got.dtype.is_floating_point:
        ity = {2: torch.int16, 4: torch.int32}[got.element_size()]
        got, ref = got.contiguous().view(ity), ref.contiguous().view(ity)
    d = (got.long() - ref.long()).abs()
    return [int((d > 0).sum()), int(d.max())]


def check_family(family, path, m):
    files = sorted(VECTORS.glob(f"{family}.*.safetensors"))
    if not files:
        return [f"{family}: no vectors under {rel(VECTORS)}: run the Rust writer first"]
    results, failed = [], []
    for f in files:
        dt = f.name.split(".")[1]
        t = load_file(f)
        out_dtype = torch.float32 if dt == "bf16" else DTYPES[dt]
        out = m.interpret(t, out_dtype)
        errs, bits = {}, {}
        for k, tol in m.TOL[dt].items():
            if k not in t and k not in out:
                continue
            if (k in t) != (k in out):
                where = "the vector file" if k in t else "interpret()"
                failed.append(f"{f.name} {k}: only {where} has it")
                continue
            got, ref = out[k], t[k]
            if got.dtype != ref.dtype:
                got = got.to(ref.dtype)
            assert got.shape == ref.shape, (f.name, k, got.shape, ref.shape)
            e = error(m.ERROR[k], got, ref, t)
            errs[k] = e
            bits[k] = ulps(got, ref)
            if not e <= tol:
                failed.append(f"{f.name} {k}: {e:.3e} > {tol:.3e} ({m.ERROR[k]})")
        results.append({"file": rel(f), "sha256": sha256(f), "dtype": dt,
                        "max_error": errs, "ulp_differences": bits})
        print(f"{f.name}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    if failed:
        return failed
    record = {
        "command": "TRITON_INTERPRET=1 .venv-triton/bin/python "
                   f"scripts/python/triton_interpret_check.py {family}",
        "family": family,
        "kernel_sources": [{"file": rel(path), "sha256": sha256(path)}],
        "vectors": results,
        "error_measure": {k: m.ERROR[k] for k in sorted({k for d in m.TOL.values() for k in d})},
        "tolerances": m.TOL,
        "constexprs": {k: v for k, v in vars(m).items() if k.isupper() and isinstance(v, int)},
        "versions": {"python": platform.python_version(), "triton": triton.__version__,
                     "torch": torch.__version__, "numpy": numpy.__version__,
                     "safetensors": safetensors.__version__},
    }
    RECORDS.mkdir(exist_ok=True)
    (RECORDS / f"{family}.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"{family}: all within tolerance; wrote {rel(RECORDS / (family + '.json'))}")
    return []


def main():
    failed = []
    for family, (path, m) in families(sys.argv[1:]).items():
        failed += check_family(family, path, m)
    if failed:
        sys.exit("triton_interpret_check.py: FAILED\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
