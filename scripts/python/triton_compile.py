#!/usr/bin/env python3
"""Compile the Triton kernels ahead of time, on a CPU-only machine, to cubin for sm_80 and
sm_90, with the launch metadata a Rust (cudarc) launcher needs.

    .venv-triton/bin/python scripts/python/triton_compile.py [--check]

Writes `candle-fused/kernels/<name>.<dtype>.sm<NN>.cubin` and `.json` next to it. `--check`
compiles into a temporary directory and fails unless every file is byte-identical to the
committed one (regeneration is deterministic: no autotuning, fixed constexprs, no GPU query).

The specialisation is fixed here, not taken from a live call: every pointer argument is
declared 16-byte aligned (`tt.divisibility = 16`); integer arguments (`N`, `C`, `P`) are
plain i32 with no divisibility or `== 1` specialisation, so odd sizes are valid; block sizes
and warps are the constexprs in candle-fused/triton/rms_norm.py. The `.entry` gets two extra
trailing pointer parameters (global and profile scratch); both kernels here need none
(`global_scratch_size == 0`, `profile_scratch_size == 0`), so the launcher passes null.
FMA contraction is off (`enable_fp_fusion=False`, ptxas `--fmad=false`): each operation
rounds as in the interpreter run (these kernels are memory-bound, so nothing is lost).

Environment: scripts/python/triton_setup.sh (pinned triton; ptxas is Triton's bundled one).
"""
import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "candle-fused" / "triton" / "rms_norm.py"
OUT = ROOT / "candle-fused" / "kernels"
ARCHS = [80, 90]
DTYPES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}


def load_module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def ptxas_version(arch):
    """The last line of `ptxas --version` for the ptxas Triton uses for `arch`."""
    from triton.backends.nvidia.compiler import get_ptxas
    exe = get_ptxas(arch).path
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def ptx_entry_params(ptx, name):
    """The `.param` declarations of `.entry name(...)` in the PTX, e.g. `.u64 .ptr .global
    .align 1 rms_norm_fwd_param_0` (the cubin's parameter list, two scratch pointers last)."""
    lines = ptx.splitlines()
    start = next(i for i, ln in enumerate(lines) if f".entry {name}(" in ln)
    out = []
    for ln in lines[start + 1:]:
        ln = ln.strip()
        if ln.startswith(")"):
            break
        out.append(ln.removeprefix(".param").strip().rstrip(","))
    return out


def kernels(m):
    """(name, fn, params [(name, triton type, role)], constexprs, num_warps, grid rule)."""
    out = []
    for dt, tt in DTYPES.items():
        out.append((f"rms_norm_fwd.{dt}", m.rms_norm_fwd, [
            ("X", f"*{tt}", "in [N, C]"), ("W", f"*{tt}", "in [C]"),
            ("Y", f"*{tt}", "out [N, C]"), ("RSTD", "*fp32", "out [N] f32"),
            ("N", "i32", "rows"), ("C", "i32", "columns"), ("eps", "fp32", "epsilon"),
        ], {"BLOCK_C": m.FWD_BLOCK_C}, m.FWD_NUM_WARPS, "(N, 1, 1)"))
        out.append((f"rms_norm_bwd_dx.{dt}", m.rms_norm_bwd_dx, [
            ("X", f"*{tt}", "in [N, C]"), ("W", f"*{tt}", "in [C]"),
            ("DY", f"*{tt}", "in [N, C]"), ("RSTD", "*fp32", "in [N] f32"),
            ("DX", f"*{tt}", "out [N, C]"), ("DW_PARTIAL", "*fp32", "out [P, C] f32"),
            ("N", "i32", "rows"), ("C", "i32", "columns"),
        ], {"BLOCK_C": m.BWD_BLOCK_C, "ROWS_PER_PROGRAM": m.BWD_ROWS_PER_PROGRAM},
            m.BWD_NUM_WARPS, f"(cdiv(N, {m.BWD_ROWS_PER_PROGRAM}), 1, 1)"))
        out.append((f"rms_norm_bwd_dw.{dt}", m.rms_norm_bwd_dw, [
            ("DW_PARTIAL", "*fp32", "in [P, C] f32"), ("DW", f"*{tt}", "out [C]"),
            ("P", "i32", "partial rows"), ("C", "i32", "columns"),
        ], {"BLOCK_C": m.DW_BLOCK_C}, m.DW_NUM_WARPS, f"(cdiv(C, {m.DW_BLOCK_C}), 1, 1)"))
    return out


def compile_all(out_dir):
    m = load_module(SRC)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn, params, constexprs, num_warps, grid in kernels(m):
        signature = {p: t for p, t, _ in params}
        signature.update({k: "constexpr" for k in constexprs})
        ptr_idx = [i for i, (_, t, _) in enumerate(params) if t.startswith("*")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_idx}
        for arch in ARCHS:
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": num_warps, "num_stages": 1,
                                        "enable_fp_fusion": False})
            md = k.metadata
            assert md.global_scratch_size == 0 and md.profile_scratch_size == 0, name
            stem = f"{name}.sm{arch}"
            (out_dir / f"{stem}.cubin").write_bytes(k.asm["cubin"])
            ptx_params = ptx_entry_params(k.asm["ptx"], md.name)
            assert len(ptx_params) == len(params) + 2, (name, ptx_params)
            meta = {
                "kernel": name,
                "entry": md.name,
                "target": f"sm_{arch}",
                "grid": grid,
                "num_warps": md.num_warps,
                "block": [32 * md.num_warps, 1, 1],
                "shared_bytes": md.shared,
                "constexprs": constexprs,
                "params": [{"name": p, "type": t, "role": r} for p, t, r in params]
                + [{"name": "global_scratch", "type": "*i8", "role": "null (size 0)"},
                   {"name": "profile_scratch", "type": "*i8", "role": "null (size 0)"}],
                "specialisation": "every pointer 16-byte aligned (tt.divisibility=16); "
                                  "i32 arguments unspecialised; tensors contiguous",
                "pointer_alignment_bytes": 16,
                "global_scratch_size": md.global_scratch_size,
                "profile_scratch_size": md.profile_scratch_size,
                "triton_version": triton.__version__,
                "ptxas_version": ptxas_version(arch),
                "ptx_entry_params": ptx_params,
                "source": "candle-fused/triton/rms_norm.py",
                "source_sha256": sha256(SRC),
                "cubin_sha256": hashlib.sha256(k.asm["cubin"]).hexdigest(),
            }
            (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            written += [f"{stem}.cubin", f"{stem}.json"]
            print(f"{stem}: cubin {len(k.asm['cubin'])} B, shared {md.shared}, warps {md.num_warps}")
    return written


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with the committed files")
    args = ap.parse_args()
    if not args.check:
        compile_all(OUT)
        return
    with tempfile.TemporaryDirectory() as tmp:
        bad = [f for f in compile_all(Path(tmp))
               if not (OUT / f).exists() or (OUT / f).read_bytes() != (Path(tmp) / f).read_bytes()]
    if bad:
        sys.exit(f"triton_compile.py --check: differs from the committed files: {bad}")
    print("triton_compile.py --check: all files identical")


if __name__ == "__main__":
    main()
