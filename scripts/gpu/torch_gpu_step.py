#!/usr/bin/env python3
"""PyTorch eager references for the GPU bench of scripts/gpu/run.sh: one training step of

* `gpt2`: nanoGPT's train.py defaults on GPT-2 small (12 layers, 12 heads, 768 wide, block 1024,
  vocab 50304, no biases, dropout 0, tied head), batch 8;
* `shakespeare-char`: nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
  block 256, batch 64, dropout 0.2, no biases), characters of data/tinyshakespeare.txt;
* `smollm2-135m`: transformers' LlamaForCausalLM in SmolLM2-135M's shape (30 layers, hidden
  576, 9 heads / 3 KV heads, intermediate 1536, vocab 49152, tied), SDPA attention (transformers'
  default), block 1024, batch 8 (`--block`, `--batch` change it);
* `smollm2-135m-lora`: the same model with its weights in bf16 and frozen, PEFT LoRA r 16, alpha
  16, no dropout, on every linear layer but the head (`target_modules="all-linear"`; PEFT keeps
  the adapters in f32), as the trainer's `--lora-r 16 --lora-targets all-linear --base-dtype bf16`.

The step is nanoGPT's: bf16 autocast over f32 weights (`--dtype f32` for none), TF32 matmuls
allowed, forward, cross-entropy, backward, clip_grad_norm_(1.0), AdamW (nanoGPT's cases:
fused, betas (0.9, 0.95) / (0.9, 0.99), weight decay 0.1 on 2-D weights only; the Llama cases:
PyTorch's default AdamW implementation, as transformers' Trainer, over the trainable parameters),
zero_grad(set_to_none).
GPT-2 and Llama batches are uniform random tokens (only the speed matters); shakespeare-char
draws windows of the text as nanoGPT's get_batch does. Nothing is compiled (eager).

Prints one JSON line: the case, the median and mean step time after the warm-up steps
(torch.cuda.synchronize() around each step; `loss.item()` syncs anyway, as nanoGPT's logging),
torch.cuda.max_memory_allocated / max_memory_reserved (MiB), and the losses.

    python3 scripts/gpu/torch_gpu_step.py --case gpt2 --steps 10
    python3 scripts/gpu/torch_gpu_step.py --case gpt2 --device cpu --tiny   # a CPU rehearsal
"""
import argparse
import json
import math
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.txt")

# name: (n_layer, n_head, n_embd, block, batch, vocab, dropout, beta2)
GPT_CASES = {
    "gpt2": (12, 12, 768, 1024, 8, 50304, 0.0, 0.95),
    "shakespeare-char": (6, 6, 384, 256, 64, None, 0.2, 0.99),
}
LLAMA_CASES = ("smollm2-135m", "smollm2-135m-lora")
# --tiny: the same code on a small shape (the CPU rehearsal of run.sh).
TINY = (2, 2, 64, 64, 4)


def gpt_model(torch, n_layer, n_head, n_embd, block, vocab, dropout):
    """nanoGPT's model.py (bias=False): pre-LayerNorm blocks, causal SDPA with dropout on the
    attention probabilities, residual dropout, tied head, exact GELU."""
    nn, F = torch.nn, torch.nn.functional

    class LayerNorm(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(c))

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = n_embd
            self.ln_1, self.ln_2 = LayerNorm(c), LayerNorm(c)
            self.c_attn = nn.Linear(c, 3 * c, bias=False)
            self.c_proj = nn.Linear(c, c, bias=False)
            self.c_fc = nn.Linear(c, 4 * c, bias=False)
            self.mlp_proj = nn.Linear(4 * c, c, bias=False)
            self.drop = nn.Dropout(dropout)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
            p = dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
            return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, n_embd)
            self.wpe = nn.Embedding(block, n_embd)
            self.drop = nn.Dropout(dropout)
            self.h = nn.ModuleList([Block() for _ in range(n_layer)])
            self.ln_f = LayerNorm(n_embd)
            self.apply(self._init)

        @staticmethod
        def _init(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

        def forward(self, idx, targets):
            t = idx.shape[1]
            pos = torch.arange(t, device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for blk in self.h:
                x = blk(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    return GPT()


def adamw(torch, model, lr, beta2, fused):
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), **extra)


def gpt_case(torch, args, dev):
    n_layer, n_head, n_embd, block, batch, vocab, dropout, beta2 = GPT_CASES[args.case]
    if args.tiny:
        n_layer, n_head, n_embd, block, batch = TINY
    if vocab is None:  # characters, as nanoGPT's shakespeare_char/prepare.py
        text = open(CORPUS, encoding="utf-8").read()
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        vocab = len(chars)
    else:
        data = None
    model = gpt_model(torch, n_layer, n_head, n_embd, block, vocab, dropout).to(dev)
    opt = adamw(torch, model, 6e-4 if args.case == "gpt2" else 1e-3, beta2, dev.type == "cuda")
    gen = torch.Generator().manual_seed(1)

    def batch_xy():
        if data is None:
            x = torch.randint(vocab, (batch, block), generator=gen)
            return x.to(dev), torch.roll(x, -1, 1).to(dev)
        ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
        if dev.type == "cuda":  # nanoGPT: pinned memory, non_blocking copies
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        return x.to(dev), y.to(dev)

    return model, opt, lambda: model(*batch_xy()), (batch, block)


def llama_case(torch, args, dev):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    layers, hidden, heads, kv, inter, vocab = 30, 576, 9, 3, 1536, 49152
    block, batch = args.block, args.batch
    if args.tiny:
        layers, hidden, heads, kv, inter, vocab = 2, 64, 4, 2, 128, 512
        block, batch = 64, 4
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=max(2048, block),
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    if args.case == "smollm2-135m-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model.to(torch.bfloat16),
            LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"),
        )
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    model = model.to(dev)
    opt = adamw(torch, model, 3e-4, 0.95, False)
    gen = torch.Generator().manual_seed(1)

    def loss():
        x = torch.randint(vocab, (batch, block), generator=gen).to(dev)
        return model(input_ids=x, labels=x).loss

    return model, opt, loss, (batch, block)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", required=True, choices=[*GPT_CASES, *LLAMA_CASES])
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up (0: none timed)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block", type=int, default=1024, help="smollm2-135m: tokens per row")
    ap.add_argument("--batch", type=int, default=8, help="smollm2-135m: rows")
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU rehearsal)")
    args = ap.parse_args()

    import torch

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:  # nanoGPT's train.py
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(1337)
    build = llama_case if args.case in LLAMA_CASES else gpt_case
    model, opt, forward, (batch, block) = build(torch, args, dev)
    model.train()
    bf16 = args.dtype == "bf16"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = forward()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        sync()
        s = time.perf_counter()
        losses.append(step())
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - s)
    mib = lambda b: round(b / 2**20, 1)
    out = {
        "case": args.case,
        "impl": "pytorch",
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": batch,
        "block": block,
        "median_ms": round(1e3 * statistics.median(times), 3) if times else None,
        "mean_ms": round(1e3 * statistics.mean(times), 3) if times else None,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "max_allocated_mib": mib(torch.cuda.max_memory_allocated(dev)) if cuda else None,
        "max_reserved_mib": mib(torch.cuda.max_memory_reserved(dev)) if cuda else None,
        "losses": [round(v, 5) for v in losses],
    }
    assert all(math.isfinite(v) for v in losses), out
    print(json.dumps(out))


if __name__ == "__main__":
    main()
