#!/usr/bin/env python3
"""Record what the SASS of every committed cubin does, for `cargo test` and the benchmarks.

    .venv-triton/bin/python scripts/python/cubin_record.py [--check]

(the environment: scripts/python/triton_setup.sh; `--check` writes nothing and exits 1 when the
committed record differs from a fresh one.)

For every `candle-fused/kernels/<entry>.<dtype>.sm<NN>.cubin` it writes, into
`candle-fused/triton/records/sass.json`: the cubin's sha256 (so `cargo test`, which cannot run
cuobjdump, fails when a cubin changed after its record: `src/cuda_kernels/audit_tests/cubin_info_tests.rs`),
then from `cuobjdump -res-usage` the registers, stack frame, local and static shared bytes,
and from `cuobjdump -sass` the instruction counts that say how the kernel moves data:

* `local_loads` / `local_stores`: `LDL` / `STL` (register spills and their refills);
* `global_loads` / `global_stores`: `LDG` / `STG` by width in bits (8, 16, 32, 64, 128; `LDG.E`
  without a width suffix moves 32 bits);
* `async_copies`: `LDGSTS` (global to shared without registers, `cp.async`), by width;
* `hmma` / `hgmma`: tensor-core matrix multiply-accumulates (`HMMA`: sm_80's `mma.sync`;
  `HGMMA`: sm_90's warpgroup `wgmma`).

cuobjdump is the one Triton's wheel carries (`triton/backends/nvidia/bin`; CUOBJDUMP overrides
it); it reads a cubin on any x86_64 machine, no GPU or CUDA toolkit needed.
"""
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "candle-fused", "kernels")
RECORD = os.path.join(ROOT, "candle-fused", "triton", "records", "sass.json")
COMMAND = ".venv-triton/bin/python scripts/python/cubin_record.py"

WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
WIDTHS = ["8", "16", "32", "64", "128"]
# an opcode with its dot-separated modifiers, after the optional predicate (`@P0`, `@!PT`)
OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)",
                    re.M)
RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def cuobjdump():
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    import triton  # noqa: the wheel's own binaries

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def run(tool, *args):
    out = subprocess.run([tool, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{tool} {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def width(mods):
    """The access width in bits of a load/store's modifiers (32 without a width suffix)."""
    for m in mods:
        if m in WIDTH:
            return WIDTH[m]
    return 32


def by_width(counts):
    return {w: counts.get(int(w), 0) for w in WIDTHS}


def record(tool, path):
    data = open(path, "rb").read()
    res = RES.search(run(tool, "-res-usage", path))
    if res is None:
        sys.exit(f"{path}: no resource usage in cuobjdump -res-usage")
    regs, stack, shared, local = map(int, res.groups())
    loads, stores, copies = Counter(), Counter(), Counter()
    ops = Counter()
    for op in OPCODE.findall(run(tool, "-sass", path)):
        name, *mods = op.split(".")
        ops[name] += 1
        if name == "LDG":
            loads[width(mods)] += 1
        elif name == "STG":
            stores[width(mods)] += 1
        elif name == "LDGSTS":
            copies[width(mods)] += 1
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "registers": regs,
        "stack_bytes": stack,
        "local_bytes": local,
        "static_shared_bytes": shared,
        "local_loads": ops["LDL"],
        "local_stores": ops["STL"],
        "global_loads": by_width(loads),
        "global_stores": by_width(stores),
        "async_copies": by_width(copies),
        "hmma": ops["HMMA"],
        "hgmma": ops["HGMMA"],
    }


def main():
    tool = cuobjdump()
    version = run(tool, "--version").strip().splitlines()
    cubins = sorted(f[: -len(".cubin")] for f in os.listdir(KERNELS) if f.endswith(".cubin"))
    out = {
        "command": COMMAND,
        "cuobjdump": next((v for v in version if "release" in v), version[-1]),
        "cubins": {stem: record(tool, os.path.join(KERNELS, stem + ".cubin")) for stem in cubins},
    }
    text = json.dumps(out, indent=1, sort_keys=True) + "\n"
    if "--check" in sys.argv[1:]:
        old = open(RECORD).read() if os.path.exists(RECORD) else ""
        if old != text:
            sys.exit(f"{RECORD} is stale: run {COMMAND}")
        print(f"{RECORD}: up to date ({len(cubins)} cubins)")
        return
    with open(RECORD, "w") as f:
        f.write(text)
    print(f"wrote {RECORD} ({len(cubins)} cubins)")


if __name__ == "__main__":
    main()
