"""torch.matmul's side of `benches/onednn.rs`: the calling thread's CPU time of one product
per shape (minimum of 5 calls after one warm-up), one thread, same shapes and layouts.

    python candle-fused/benches/onednn_torch.py [MxKxN{n,t}{n,t} ...] [f32|bf16]
"""

import sys
import time

import torch

DEFAULT = ["1024x576x576nt", "1024x576x1536nt", "1024x1536x576nn", "1536x1024x576tn",
           "288x576x4096nt", "1024x576x16nt", "1536x1024x16tn"]


def operand(r, c, t, dtype):
    x = torch.randn((c, r) if t else (r, c)).to(dtype)
    return x.t() if t else x


def main():
    torch.set_num_threads(1)
    shapes = [a for a in sys.argv[1:] if "x" in a] or DEFAULT
    names = [a for a in sys.argv[1:] if "x" not in a]
    dtypes = {"f32": [torch.float32], "bf16": [torch.bfloat16]}.get(
        names[0] if names else "", [torch.float32, torch.bfloat16])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), min of 5 calls")
    print("| product | dtype | CPU ms | GFLOP/s of CPU time |")
    for s in shapes:
        m, k, n = (int(v) for v in s[:-2].split("x"))
        for dtype in dtypes:
            a, b = operand(m, k, s[-2] == "t", dtype), operand(k, n, s[-1] == "t", dtype)
            torch.matmul(a, b)
            best = float("inf")
            for _ in range(5):
                t0 = time.thread_time()
                torch.matmul(a, b)
                best = min(best, time.thread_time() - t0)
            print(f"| {s} | {str(dtype)[6:]} | {best * 1e3:.2f} | {2 * m * k * n / best / 1e9:.1f} |")


main()
