#!/usr/bin/env python3
"""Per-step figures from the stand-in's reports (README.md).

    report.py step LONG SHORT STEPS [--label L]   per step = (LONG - SHORT) / STEPS, as JSON
    report.py same A B                            exit 1 unless two reports' counts are equal
    report.py table STEP_JSON...                  a markdown table of per-step figures

LONG ran WARMUP + STEPS training steps, SHORT WARMUP: what both did (start-up, the first steps,
the end of the run) cancels, as in scripts/gpu/run.sh's counts part on the real driver. Each
device-to-host read is named by its call site: the return addresses the stand-in recorded,
symbolised here with addr2line, and the first frame that is neither the stand-in, cudarc, the
standard library nor Candle's CUDA plumbing taken as the caller.
"""
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

# Frames skipped to find who asked for a read (plumbing between the caller and the driver).
PLUMBING = re.compile(
    r"^(cudarc::|core::|alloc::|std::|<?candle_core::cuda_backend|<candle_core::cuda_backend|"
    r"candle_core::(storage|tensor::Tensor::to_(vec|scalar)|tensor::Tensor::to_device|device::)|"
    r"<candle_core::cuda_backend|<alloc::|<core::|__libc|_start|\?)"
)
HASH = re.compile(r"::h[0-9a-f]{16}$")


def symbolise(frames_by_module):
    """{module path: set of offsets} -> {(path, offset): function name}"""
    names = {}
    for path, offsets in frames_by_module.items():
        offsets = sorted(offsets)
        if not Path(path).is_file() or "standin" in Path(path).name or "libcuda" in path:
            for o in offsets:
                names[(path, o)] = "?"
            continue
        out = subprocess.run(
            ["addr2line", "-f", "-C", "-e", path] + [hex(o) for o in offsets],
            capture_output=True, text=True, check=False,
        ).stdout.splitlines()
        for i, o in enumerate(offsets):
            fn = out[2 * i] if 2 * i < len(out) else "?"
            names[(path, o)] = HASH.sub("", fn)
    return names


def read_sites(report):
    """[(caller, chain, n, bytes, computed)] for a report's reads."""
    frames_by_module = defaultdict(set)
    parsed = []
    for r in report.get("reads", []):
        frames = []
        for f in r["frames"]:
            path, _, off = f.rpartition("+")
            try:
                o = int(off, 16)
            except ValueError:
                continue
            frames.append((path, o))
            frames_by_module[path].add(o)
        parsed.append((frames, r))
    names = symbolise(frames_by_module)
    out = []
    for frames, r in parsed:
        chain = [names[f] for f in frames if "libcuda" not in f[0] and names[f] != "?"]
        callers = [n for n in chain if not PLUMBING.match(n)]
        caller = callers[0] if callers else (chain[0] if chain else "?")
        out.append((caller, callers[:4], r["n"], r["bytes"], r["computed"]))
    return out


def by_caller(report):
    sites = defaultdict(lambda: {"n": 0, "bytes": 0, "computed": 0, "chain": None})
    for caller, chain, n, b, c in read_sites(report):
        s = sites[caller]
        s["n"] += n
        s["bytes"] += b
        s["computed"] += c
        s["chain"] = s["chain"] or chain
    return sites


def diff_map(a, b, steps):
    keys = set(a) | set(b)
    return {k: (a.get(k, 0) - b.get(k, 0)) / steps for k in sorted(keys) if a.get(k, 0) != b.get(k, 0)}


def step(long_path, short_path, steps, label):
    long, short = (json.loads(Path(p).read_text()) for p in (long_path, short_path))
    s = int(steps)
    per = lambda k: (long[k] - short[k]) / s
    reads_long, reads_short = by_caller(long), by_caller(short)
    reads = []
    for caller in sorted(set(reads_long) | set(reads_short)):
        a, b = reads_long.get(caller, {}), reads_short.get(caller, {})
        n = (a.get("n", 0) - b.get("n", 0)) / s
        if n:
            reads.append({"caller": caller, "per_step": n,
                          "computed_per_step": (a.get("computed", 0) - b.get("computed", 0)) / s,
                          "bytes_per_step": (a.get("bytes", 0) - b.get("bytes", 0)) / s,
                          "chain": (a or b).get("chain")})
    return {
        "label": label,
        "steps": s,
        "launches": per("kernel_launches") + per("gemm_calls"),
        "kernel_launches": per("kernel_launches"),
        "gemm_calls": per("gemm_calls"),
        "counts": diff_map(long["counts"], short["counts"], s),
        "calls": diff_map(long["calls"], short["calls"], s),
        "event_creations": (long["calls"].get("cuEventCreate", 0) - short["calls"].get("cuEventCreate", 0)) / s,
        "host_syncs": per("host_syncs"),
        "blocking_reads": per("blocking_reads"),
        "pool_growth_bytes": (long["pool"]["grow_bytes"] - short["pool"]["grow_bytes"]) / s,
        "pool_grow_calls": (long["pool"]["grow_calls"] - short["pool"]["grow_calls"]) / s,
        "pool_reserved_high": long["pool"]["reserved_high"],
        "release_threshold": long["pool"]["release_threshold"],
        "kernels": diff_map(long["kernels"], short["kernels"], s),
        "cublas": diff_map(long["cublas"], short["cublas"], s),
        "runtime_launches": per("runtime_launches"),
        "reads": reads,
        "unimplemented": long["unimplemented"],
        "bad_ranges": long["bad_ranges"],
    }


COMPARED = ("counts", "calls", "kernels", "cublas", "curand", "cudart", "pool", "kernel_launches",
            "gemm_calls", "host_syncs", "blocking_reads", "unimplemented", "bad_ranges")


def same(a_path, b_path):
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    diffs = [k for k in COMPARED if a.get(k) != b.get(k)]
    ra = [(r["n"], r["bytes"], r["computed"]) for r in a["reads"]]
    rb = [(r["n"], r["bytes"], r["computed"]) for r in b["reads"]]
    if sorted(ra) != sorted(rb):
        diffs.append("reads")
    if diffs:
        sys.exit(f"report.py same: {a_path} and {b_path} differ in {', '.join(diffs)}")
    print(f"same figures: {a_path} {b_path}")


def fmt(x):
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def table(paths):
    rows = [json.loads(Path(p).read_text()) for p in paths]
    print("| step | launches (kernels + GEMMs) | allocation calls | pool growth | event creations | memsets | "
          "host syncs (blocking reads) | DtoH reads of computed data |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["counts"]
        print(f"| {r['label']} | {fmt(r['launches'])} ({fmt(r['kernel_launches'])} + {fmt(r['gemm_calls'])}) | "
              f"{fmt(c.get('alloc', 0))} | {fmt(r['pool_growth_bytes'] / 2**20)} MiB | {fmt(r['event_creations'])} | "
              f"{fmt(c.get('memset', 0))} | {fmt(r['host_syncs'])} ({fmt(r['blocking_reads'])}) | "
              f"{fmt(sum(x['computed_per_step'] for x in r['reads']))} |")


def main(argv):
    cmd, a = argv[1], argv[2:]
    if cmd == "step":
        label = a[a.index("--label") + 1] if "--label" in a else Path(a[0]).stem
        print(json.dumps(step(a[0], a[1], a[2], label), indent=1))
    elif cmd == "same":
        same(a[0], a[1])
    elif cmd == "table":
        table(a)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
