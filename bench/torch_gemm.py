#!/usr/bin/env python3
"""PyTorch side of `cargo bench -p trainer --bench gemm`: `torch.matmul` over the products the
bench names, on the same operand layouts (a transposed operand is a `.t()` view of a contiguous
tensor, as ours reads it), under the bench protocol (bench/bench_protocol.py).

Reads the shapes as JSON from --shapes (a list of {"name", "m", "k", "n", "a_t", "b_t"}), and
prints one JSON line: per shape the timed steps (each `reps` products, `reps` chosen so that a
step lasts at least --min-step-ms), their median, GFLOP/s (2 m k n per product) and the
protocol's shares.

    .venv-py/bin/python bench/torch_gemm.py --dtype bf16 --threads 2 \\
        --shapes '[{"name": "q fwd", "m": 1024, "k": 576, "n": 576, "a_t": false, "b_t": true}]'

Optional: needs torch; never run in CI.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol  # noqa: E402


def operands(torch, s, dtype):
    """`a [m, k]` and `b [k, n]`, each a `.t()` view of a contiguous tensor where marked."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn((s["k"], s["m"]) if s["a_t"] else (s["m"], s["k"]), generator=g).to(dtype)
    b = torch.randn((s["n"], s["k"]) if s["b_t"] else (s["k"], s["n"]), generator=g).to(dtype)
    return (a.t() if s["a_t"] else a), (b.t() if s["b_t"] else b)


def run_shape(torch, s, dtype, steps, min_step):
    a, b = operands(torch, s, dtype)
    torch.matmul(a, b)  # warm-up (and oneDNN's primitive cache)
    t = time.perf_counter()
    torch.matmul(a, b)
    one = max(time.perf_counter() - t, 1e-7)
    reps = max(1, math.ceil(min_step / one))

    def step():
        for _ in range(reps):
            torch.matmul(a, b)

    timed = [bench_protocol.timed(step) for _ in range(steps)]
    med = statistics.median([t for t, _, _ in timed])
    flops = 2 * s["m"] * s["k"] * s["n"] * reps
    return {"name": s["name"], "reps": reps, "step_median_s": med, "gflops": flops / med / 1e9,
            **bench_protocol.summary(timed)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True, help="JSON list of products")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per product")
    ap.add_argument("--min-step-ms", type=float, default=200.0, help="shortest timed step")
    args = ap.parse_args()
    try:
        shapes = json.loads(args.shapes)
    except json.JSONDecodeError as e:
        sys.exit(f"torch_gemm.py: --shapes is not JSON: {e}")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rows = [run_shape(torch, s, dtype, args.steps, args.min_step_ms / 1e3) for s in shapes]
    out = {"bench": "torch_gemm", "dtype": args.dtype, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "cpu": bench_protocol.cpu_line(), "shapes": rows}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
