#!/usr/bin/env python3
"""Compile the Triton kernels ahead of time, on a CPU-only machine, to cubin for sm_80 and
sm_90, with the launch metadata a Rust (cudarc) launcher needs.

    .venv-triton/bin/python scripts/python/triton_compile.py [--check] [FAMILY ...]

A family is a file `candle-fused/triton/<family>.py` (files starting with `_` are helpers);
its `AOT` list names the kernels to compile: `fn`, `params` [(name, type, role)] in `.entry`
order (`{io}` in a type is the variant's dtype), `constexprs`, `num_warps`, `grid` (the rule as
`candle_fused::cuda_kernels::describe_grid` writes it), and optionally `dtypes` (default f32,
bf16, f16), `num_stages` (default 1), `entry` (the `.entry` name and file stem when one
function is compiled in several variants, e.g. `attn_fwd_d64`; default the function's name)
and `divisible` (i32 parameters declared multiples of 16, e.g. a head size: the launch table
must then carry a `Rule::MultipleOf` for them). Writes `candle-fused/kernels/<entry>.<dtype>.sm<NN>
.cubin` and `.json` next to it. `--check` compiles into a temporary directory and fails unless
every file is byte-identical to the committed one (regeneration is deterministic: no
autotuning, fixed constexprs, no GPU query).

The specialisation is fixed here, not taken from a live call: every pointer argument is
declared 16-byte aligned (`tt.divisibility = 16`); integer arguments are plain i32 with no
divisibility or `== 1` specialisation, so odd sizes are valid, except those an entry names in
`divisible` (`tt.divisibility = 16` too). The `.entry` gets two extra
trailing pointer parameters (global and profile scratch); the kernels here need none
(`global_scratch_size == 0`, `profile_scratch_size == 0`), so the launcher passes null.
FMA contraction is off (`enable_fp_fusion=False`): each operation rounds as in the
interpreter run (the elementwise and normalisation kernels are memory-bound, so nothing is
lost); a kernel may set `fp_fusion=True` in its AOT entry. Line info is off (a kernel may set
`line_info=True` for debugging, never committed): with it the cubin embeds the PTX text and
line tables naming the source file's absolute path, so the bytes would depend on where the
checkout lives.

Static shared memory: besides the dynamic `shared_bytes` (Triton's `metadata.shared`), a cubin
may declare static shared memory, the size of its `.nv.shared.<entry>` section (1 KiB on sm_90
for the kernels with a reduction or a dot), recorded as `static_shared_bytes`: a block needs
both, and the launcher opts in above 48 KiB in all.

ptxas: pinned to CUDA 13.0's (release `PTXAS_RELEASE`, from the `nvidia-cuda-nvcc==13.0.88`
wheel): the GPU machines' driver is CUDA 13.0 (580), and a cubin from a newer ptxas is not
what they were checked with. Point Triton at it with `TRITON_PTXAS_PATH` (Triton 3.9 takes
`TRITON_PTXAS_BLACKWELL_PATH` for sm_90 and newer; this script sets it to the same file); the
script refuses to compile with any other ptxas, Triton's bundled one (13.4) included, and records
the toolkit strings of the cubin's `.note.nv.tkinfo` note as `ptxas` in each json. The recipe:

    scripts/gpu/cubins.sh [--check] [FAMILY ...]     # sets up the ptxas, then runs this script

Environment: scripts/python/triton_setup.sh (pinned triton).
"""
import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402
from triton_families import ROOT, families, sha256  # noqa: E402

OUT = ROOT / "candle-fused" / "kernels"
ARCHS = [80, 90]
# The ptxas every cubin is built with (`release 13.0` in `ptxas --version` and in the cubin's
# tkinfo note); candle-fused's launch audit (src/cuda_kernels/audit_tests) checks the cubins against the same pin.
PTXAS_RELEASE = "13.0"
PTXAS_RECIPE = ("scripts/gpu/cubins.sh (it sets TRITON_PTXAS_PATH to the ptxas of the "
                "nvidia-cuda-nvcc==13.0.88 wheel)")
DTYPES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}


def pinned_ptxas():
    """Point Triton at `TRITON_PTXAS_PATH` for every arch and refuse unless it is the pinned
    release: Triton 3.9 reads `TRITON_PTXAS_BLACKWELL_PATH` for sm_90 and newer, and silently
    falls back to its bundled ptxas when a path does not run."""
    path = os.environ.get("TRITON_PTXAS_PATH")
    if not path:
        sys.exit(f"triton_compile.py: set TRITON_PTXAS_PATH to CUDA {PTXAS_RELEASE}'s ptxas "
                 f"(Triton's bundled one is newer); recipe: {PTXAS_RECIPE}")
    other = os.environ.setdefault("TRITON_PTXAS_BLACKWELL_PATH", path)
    if os.path.realpath(other) != os.path.realpath(path):
        sys.exit(f"triton_compile.py: TRITON_PTXAS_BLACKWELL_PATH={other} differs from "
                 f"TRITON_PTXAS_PATH={path}: unset it (this script sets it); recipe: {PTXAS_RECIPE}")
    from triton.backends.nvidia.compiler import get_ptxas
    for arch in ARCHS:
        tool = get_ptxas(arch)
        if os.path.realpath(tool.path) != os.path.realpath(path) or tool.version != PTXAS_RELEASE:
            sys.exit(f"triton_compile.py: for sm_{arch} Triton would run {tool.path} (release "
                     f"{tool.version}), not TRITON_PTXAS_PATH={path} at release {PTXAS_RELEASE}; "
                     f"recipe: {PTXAS_RECIPE}")


def elf_sections(data):
    """{name: (sh_type, offset, size)} of the sections of a 64-bit little-endian ELF (a cubin)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit LE ELF"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = hdrs[shstrndx][4]

    def name(off):
        start = strtab + off
        return data[start:data.index(b"\0", start)].decode()
    return {name(h[0]): (h[1], h[4], h[5]) for h in hdrs}


def static_shared_bytes(cubin, entry):
    """The size of the cubin's `.nv.shared.<entry>` section (0 if it has none)."""
    return elf_sections(cubin).get(f".nv.shared.{entry}", (0, 0, 0))[2]


def tkinfo(cubin):
    """The toolkit strings of the cubin's `.note.nv.tkinfo` note: {tool, version, build}, e.g.
    `ptxas`, `Cuda compilation tools, release 13.0, V13.0.88`, `Build cuda_13.0.r13.0/...`."""
    _, off, size = elf_sections(cubin)[".note.nv.tkinfo"]
    note = cubin[off:off + size]
    namesz, descsz, _ = struct.unpack_from("<III", note, 0)
    desc = note[12 + (namesz + 3) // 4 * 4:][:descsz]
    # desc: u32 version, u32 reserved, then the offsets of the tool name, version, build and
    # options strings in the string table that follows the 24-byte header
    offsets = struct.unpack_from("<IIII", desc, 8)
    table = desc[24:]

    def at(o):
        return table[o:table.index(b"\0", o)].decode()
    return dict(zip(["tool", "version", "build"], map(at, offsets[:3])))


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


class NamedSource(ASTSource):
    """An `ASTSource` whose cache key includes the kernel's name: Triton 3.9 keys its compile
    cache on the source, signature, attributes and constants only, so the same function
    compiled under another `.entry` name (`repr`) would otherwise come back from the cache
    under the first name."""

    def hash(self):
        return hashlib.sha256(f"{super().hash()}-{self.fn.repr(None)}".encode()).hexdigest()


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
    entry = spec.get("entry", fn.__name__)
    if entry != fn.__name__:
        # the same source under another `.entry` name (Triton names the kernel by `repr`)
        fn = triton.jit(fn.fn, repr=lambda _, e=entry: e)
    name = f"{entry}.{dt}"
    params = [(p, t.format(io=DTYPES[dt]), r) for p, t, r in spec["params"]]
    constexprs = spec["constexprs"]
    signature = {p: t for p, t, _ in params}
    signature.update({k: "constexpr" for k in constexprs})
    ptr_idx = [i for i, (_, t, _) in enumerate(params) if t.startswith("*")]
    divisible = spec.get("divisible", ())
    unknown = set(divisible) - {p for p, t, _ in params if t == "i32"}
    assert not unknown, (name, "divisible names no i32 parameter", unknown)
    div_idx = [i for i, (p, _, _) in enumerate(params) if p in divisible]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_idx + div_idx}
    written = []
    for arch in ARCHS:
        src = NamedSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        with knobs.compilation.scope():
            # no embedded PTX text / line tables: they hold the source's absolute path
            knobs.compilation.disable_line_info = not spec.get("line_info", False)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": spec["num_warps"],
                                        "num_stages": spec.get("num_stages", 1),
                                        "enable_fp_fusion": spec.get("fp_fusion", False)})
        md = k.metadata
        assert md.name == entry, (name, md.name)
        assert md.global_scratch_size == 0 and md.profile_scratch_size == 0, name
        stem = f"{name}.sm{arch}"
        tk = tkinfo(k.asm["cubin"])
        assert f"release {PTXAS_RELEASE}," in tk["version"], (stem, tk)
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
            "static_shared_bytes": static_shared_bytes(k.asm["cubin"], md.name),
            "constexprs": constexprs,
            "params": [{"name": p, "type": t, "role": r} for p, t, r in params]
            + [{"name": "global_scratch", "type": "*i8", "role": "null (size 0)"},
               {"name": "profile_scratch", "type": "*i8", "role": "null (size 0)"}],
            "specialisation": "every pointer 16-byte aligned (tt.divisibility=16); "
                              + (f"{', '.join(divisible)} multiple of 16 (tt.divisibility=16); "
                                 "other " if divisible else "")
                              + "i32 arguments unspecialised; tensors contiguous",
            "divisible_by_16": list(divisible),
            "pointer_alignment_bytes": 16,
            "global_scratch_size": md.global_scratch_size,
            "profile_scratch_size": md.profile_scratch_size,
            "triton_version": triton.__version__,
            "ptxas": tk,
            "ptx_entry_params": ptx_params,
            "source": str(src_path.relative_to(ROOT)),
            "source_sha256": sha256(src_path),
            "cubin_sha256": hashlib.sha256(k.asm["cubin"]).hexdigest(),
        }
        meta["line_info"] = spec.get("line_info", False)
        (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        written += [f"{stem}.cubin", f"{stem}.json"]
        print(f"{stem}: cubin {len(k.asm['cubin'])} B, shared {md.shared} + static "
              f"{meta['static_shared_bytes']}, warps {md.num_warps}")
    return written


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with the committed files")
    ap.add_argument("family", nargs="*", help="families to compile (default: all)")
    args = ap.parse_args()
    pinned_ptxas()
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
