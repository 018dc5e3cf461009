#!/usr/bin/env python3
"""Compile the Triton kernels ahead of time, on a CPU-only machine, to cubin for sm_80 and
sm_90, with the launch metadata a Rust (cudarc) launcher needs.

    .venv-triton/bin/python scripts/python/triton_compile.py [--check] [FAMILY ...]

A family is a file `candle-fused/triton/<family>.py` (files starting with `_` are helpers);
its `AOT` list names the kernels to compile: `fn`, `params` [(name, type, role)] in `.entry`
order (`{io}` in a type is the variant's dtype), `constexprs`, `num_warps`, `grid` (the rule as
`candle_fused::cuda_kernels::describe_grid` writes it), and optionally `dtypes` (default f32,
bf16, f16) and `num_stages` (default 1). Writes `candle-fused/kernels/<entry>.<dtype>.sm<NN>
.cubin` and `.json` next to it. `--check` compiles into a temporary directory and fails unless
every file is byte-identical to the committed one (regeneration is deterministic: no
autotuning, fixed constexprs, no GPU query).

The specialisation is fixed here, not taken from a live call: every pointer argument is
declared 16-byte aligned (`tt.divisibility = 16`); integer arguments are plain i32 with no
divisibility or `== 1` specialisation, so odd sizes are valid. The `.entry` gets two extra
trailing pointer parameters (global and profile scratch); the kernels here need none
(`global_scratch_size == 0`, `profile_scratch_size == 0`), so the launcher passes null.
FMA contraction is off (`enable_fp_fusion=False`): each operation rounds as in the
interpreter run (the elementwise and normalisation kernels are memory-bound, so nothing is
lost); a kernel may set `fp_fusion=True` in its AOT entry. Line info is off (a kernel may set
`line_info=True` for debugging, never committed): with it the cubin embeds the PTX text and
line tables naming the source file's absolute path, so the bytes would depend on where the
checkout lives.

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
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = ROOT / "candle-fused" / "triton"
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


def families(names=None):
    """{family: module} of candle-fused/triton/*.py (or of `names`)."""
    paths = sorted(p for p in TRITON_DIR.glob("*.py") if not p.name.startswith("_"))
    if names:
        missing = set(names) - {p.stem for p in paths}
        if missing:
            sys.exit(f"no such family: {sorted(missing)}")
        paths = [p for p in paths if p.stem in names]
    sys.path.insert(0, str(TRITON_DIR))
    return {p.stem: (p, load_module(p)) for p in paths}


def compile_all(out_dir, names=None):
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for family, (src_path, m) in families(names).items():
        for spec in m.AOT:
            for dt in spec.get("dtypes", list(DTYPES)):
                written += compile_one(out_dir, family, src_path, spec, dt)
    return written


def compile_one(out_dir, family, src_path, spec, dt):
    fn = spec["fn"]
    name = f"{fn.__name__}.{dt}"
    params = [(p, t.format(io=DTYPES[dt]), r) for p, t, r in spec["params"]]
    constexprs = spec["constexprs"]
    signature = {p: t for p, t, _ in params}
    signature.update({k: "constexpr" for k in constexprs})
    ptr_idx = [i for i, (_, t, _) in enumerate(params) if t.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_idx}
    written = []
    for arch in ARCHS:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        with knobs.compilation.scope():
            # no embedded PTX text / line tables: they hold the source's absolute path
            knobs.compilation.disable_line_info = not spec.get("line_info", False)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": spec["num_warps"],
                                        "num_stages": spec.get("num_stages", 1),
                                        "enable_fp_fusion": spec.get("fp_fusion", False)})
        md = k.metadata
        assert md.global_scratch_size == 0 and md.profile_scratch_size == 0, name
        stem = f"{name}.sm{arch}"
        (out_dir / f"{stem}.cubin").write_bytes(k.asm["cubin"])
        ptx_params = ptx_entry_params(k.asm["ptx"], md.name)
        assert len(ptx_params) == len(params) + 2, (name, ptx_params)
        meta = {
            "kernel": name,
            "family": family,
            "entry": md.name,
            "target": f"sm_{arch}",
            "grid": spec["grid"],
            "num_warps": md.num_warps,
            "num_stages": spec.get("num_stages", 1),
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
            "source": str(src_path.relative_to(ROOT)),
            "source_sha256": sha256(src_path),
            "cubin_sha256": hashlib.sha256(k.asm["cubin"]).hexdigest(),
        }
        meta["line_info"] = spec.get("line_info", False)
        (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        written += [f"{stem}.cubin", f"{stem}.json"]
        print(f"{stem}: cubin {len(k.asm['cubin'])} B, shared {md.shared}, warps {md.num_warps}")
    return written


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with the committed files")
    ap.add_argument("family", nargs="*", help="families to compile (default: all)")
    args = ap.parse_args()
    if not args.check:
        compile_all(OUT, args.family)
        return
    with tempfile.TemporaryDirectory() as tmp:
        bad = [f for f in compile_all(Path(tmp), args.family)
               if not (OUT / f).exists() or (OUT / f).read_bytes() != (Path(tmp) / f).read_bytes()]
    if bad:
        sys.exit(f"triton_compile.py --check: differs from the committed files: {bad}")
    print("triton_compile.py --check: all files identical")


if __name__ == "__main__":
    main()
