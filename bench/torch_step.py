#!/usr/bin/env python3
"""PyTorch reference for `cargo bench -p trainer --bench step` (which runs it with `--torch`).

The same GPT-2 model as the trainer (nanoGPT's model.py: pre-LayerNorm blocks with biases,
tied head, tanh GELU as Hugging Face's GPT-2, `F.scaled_dot_product_attention(is_causal=True)`
as nanoGPT), the same data (bytes or characters of data/tinyshakespeare.txt), the same step
(forward, cross-entropy, backward, clip_grad_norm_(1.0), AdamW(betas=(0.9, 0.99), weight decay
0.1 on 2-D weights only, PyTorch's default CPU implementation), zero_grad(set_to_none=True)).

Prints, per config, the median step time after warm-up, tokens/s, MFU (nanoGPT's FLOP count
over a matmul ceiling measured here the same way as the Rust bench: f32 1024^3) and the peak
memory of live tensors during a step (PyTorch's profiler memory timeline: weights, gradients,
optimiser state, activations). Timed steps follow the bench protocol (bench/bench_protocol.py:
other processes' CPU share and steal per step, a step over 2% re-run up to 5 times; the CPU
model and flags printed). `--json` prints one JSON line per config instead of the table.

    python3 bench/torch_step.py                  # every config
    python3 bench/torch_step.py --only baby-gpt --steps 20
    python3 bench/torch_step.py --dtype bf16     # CPU autocast to bfloat16

Optional: needs `pip install torch numpy`; never run in CI.
"""
import argparse
import os
import json
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol  # noqa: E402
from torch_common import adamw, matmul_ceiling, peak_step_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.txt")

CASES = {
    # name: (n_layer, n_head, n_embd, block, batch, data)
    "gpt-4-4-256": (4, 4, 256, 128, 8, "byte"),
    "baby-gpt": (4, 4, 128, 64, 12, "char"),
    "addition": (3, 4, 128, 9, 128, "char"),
}


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def flops_per_token(model, n_layer, n_head, n_embd, block):
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6 * n + 12 * n_layer * n_head * (n_embd // n_head) * block


def load(kind):
    text = open(CORPUS, "rb").read()
    if kind == "byte":
        return torch.tensor(list(text), dtype=torch.long), 256
    chars = sorted(set(text.decode("utf-8")))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text.decode("utf-8")], dtype=torch.long), len(chars)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--json", action="store_true", help="one JSON line per config, no table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peak_flops = matmul_ceiling(torch)
    out = print if not args.json else (lambda *a, **k: None)
    out(f"CPU: {bench_protocol.cpu_line()}")
    out(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | matmul ceiling "
        f"{peak_flops / 1e9:.1f} GFLOP/s (f32 1024^3) | {args.steps} timed steps after 3 warm-up"
    )
    out()
    out("| config | dtype | step (median) | step (mean) | tokens/s | MFU | peak tensors | other CPU (max per step) |")
    out("|---|---|---|---|---|---|---|---|")
    for name, (n_layer, n_head, n_embd, block, batch, kind) in CASES.items():
        if args.only and args.only not in name:
            continue
        data, vocab = load(kind)
        model = GPT(n_layer, n_head, n_embd, block, vocab)
        opt = adamw(torch, model, betas=(0.9, 0.99))
        gen = torch.Generator().manual_seed(1)

        def step():
            ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
            x = torch.stack([data[i : i + block] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for _ in range(3):
            step()
        timed = [bench_protocol.timed(step) for _ in range(args.steps)]
        times = [t for t, _, _ in timed]
        med, mean = statistics.median(times), statistics.mean(times)
        tokens = batch * block
        mfu = flops_per_token(model, n_layer, n_head, n_embd, block) * tokens / med / peak_flops
        prot = bench_protocol.summary(timed)
        if args.json:
            r = dict(case=name, dtype=args.dtype, step_median_s=med, step_mean_s=mean, mfu=mfu, **prot)
            print(json.dumps(r), flush=True)
            continue
        try:
            peak_s = f"{peak_step_bytes(step) / 2**20:.1f} MiB"
        except Exception as e:  # profiler API differences across versions
            peak_s = f"n/a ({e})"
        print(
            f"| {name} | {args.dtype} | {med * 1e3:.1f} ms | {mean * 1e3:.1f} ms | "
            f"{tokens / med:.0f} | {100 * mfu:.1f}% | {peak_s} | {bench_protocol.share_cell(prot)} |"
        )


if __name__ == "__main__":
    main()
