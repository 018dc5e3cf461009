#!/usr/bin/env python3
"""PyTorch anchor for the trainer's LoRA training step: Hugging Face transformers'
LlamaForCausalLM at SmolLM2-135M's shape (or Gemma3ForCausalLM at Gemma 3 270M's, `--case
gemma3-270m`: bench/torch_llama_step.py's case of that name) with a PEFT LoRA adapter, on CPU.

The model: SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, intermediate 1536,
vocab 49152, tied embeddings, RMSNorm eps 1e-5, rope theta 100000), transformers' random init,
the base cast to bf16 (`--dtype f32` keeps it f32) and frozen. The adapter:
`get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
lora_dropout=0.0))`: every q/k/v/o/gate/up/down projection (all-linear leaves out the output
layer); PEFT keeps the LoRA weights in f32 over a bf16 base (autocast_adapter_dtype) and casts the
activations to f32 inside the LoRA branch. The forward runs under
`torch.autocast("cpu", dtype=torch.bfloat16)` (`--no-autocast` for the plain bf16 base row), so
the adapters' products run in bf16 too, as ours do. No gradient checkpointing (TRL's SFTConfig
turns that on by default; here it is off, as in bench/torch_llama_step.py).

The step: forward with labels (transformers' shifted cross-entropy; logits upcast to f32 in the
loss), backward, AdamW (PyTorch's default CPU implementation, lr 1e-4, default betas and weight
decay 0.01) over the adapter parameters only, zero_grad(set_to_none=True). No gradient clipping.
Batches are uniform random tokens (labels = input_ids), batch 4 x block 256. Attention:
`--attn sdpa` (default; PyTorch's fused kernel) or `eager`.

Prints one JSON line (starts with `{`): the median and mean step time after warm-up (also in ms),
tokens/s, parameter counts (base, trainable), the process's peak RSS (getrusage maxrss), the RSS
before the first step and the RSS high-water mark over the warm-up and timed steps alone (VmHWM
after resetting it through /proc/self/clear_refs just before the first step; null where the
kernel does not allow the reset), the peak of the anonymous RSS (`RssAnon` sampled every 2 ms by a
thread, over the whole process and over the steps alone), the bench protocol's fields (bench/bench_protocol.py: other
processes' CPU share and steal per timed step, a step over 2% re-run up to 5 times, the CPU model
and flags), then a one-line table.

    .venv-py/bin/python bench/peft_lora_step.py --threads 2 --steps 3 --warmup 1
    .venv-py/bin/python bench/peft_lora_step.py --case gemma3-270m --threads 2 --steps 2 --warmup 1

Optional: needs scripts/python/setup.sh's venv (torch, transformers, peft); never run in CI.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol  # noqa: E402
from torch_common import AnonPeak, status_mib  # noqa: E402
from torch_llama_step import build_model  # noqa: E402

BLOCK, BATCH = 256, 4
R, ALPHA = 16, 32


def reset_hwm():
    """Reset the RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_step(torch, model, opt, vocab, gen, autocast=True):
    """The training step: a batch of uniform random tokens (labels = input_ids), the forward
    under `torch.autocast` to bf16 (unless `autocast` is false), backward, `opt.step()`,
    zero_grad(set_to_none=True); returns the loss."""

    def step():
        x = torch.randint(vocab, (BATCH, BLOCK), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"], help="base weights' dtype")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--no-autocast", action="store_true", help="no torch.autocast around the forward")
    ap.add_argument(
        "--case", default="smollm2-135m", choices=["smollm2-135m", "gemma3-270m"], help="the model's shape"
    )
    args = ap.parse_args()
    anon = AnonPeak()

    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_base_mib = status_mib("VmRSS")
    model = build_model(args.case, args.attn)
    cfg = model.config
    model = model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    base_params = sum(p.numel() for p in model.parameters())
    model = get_peft_model(
        model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    lora_dtypes = sorted({str(p.dtype) for p in trainable})
    n_lora_modules = sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.vocab_size

    step = make_step(torch, model, opt, vocab, gen, autocast=not args.no_autocast)

    rss_before_steps_mib = status_mib("VmRSS")
    maxrss_before_steps_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    anon_load = anon.read()
    hwm_reset = reset_hwm()
    anon.reset()
    losses = [step() for _ in range(args.warmup)]
    timed = [bench_protocol.timed(lambda: losses.append(step())) for _ in range(args.steps)]
    times = [t for t, _, _ in timed]
    peak_rss_steps_mib = status_mib("VmHWM") if hwm_reset else None
    anon_steps = anon.read()
    anon.close()
    med, mean = statistics.median(times), statistics.mean(times)
    r = {
        "bench": "peft_lora_step",
        "case": args.case,
        "dtype": args.dtype,
        "attn": args.attn,
        "autocast": not args.no_autocast,
        "threads": torch.get_num_threads(),
        "batch": BATCH,
        "block": BLOCK,
        "lora_r": R,
        "lora_alpha": ALPHA,
        "lora_modules": n_lora_modules,
        "lora_dtype": lora_dtypes,
        "params": base_params,
        "trainable_params": n_trainable,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_median_s": med,
        "step_mean_s": mean,
        "step_median_ms": med * 1e3,
        "tokens_per_s": BATCH * BLOCK / med,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_base_mib": rss_base_mib,
        "rss_before_steps_mib": rss_before_steps_mib,
        "maxrss_before_steps_mib": maxrss_before_steps_mib,
        "peak_rss_steps_mib": peak_rss_steps_mib,
        "anon_peak_mib": max(anon_load, anon_steps),
        "anon_peak_steps_mib": anon_steps,
        "loss_first_last": [losses[0], losses[-1]],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        **bench_protocol.summary(timed),
    }
    print(json.dumps(r), flush=True)
    print()
    print(
        f"torch {r['torch']} | transformers {r['transformers']} | peft {r['peft']} | threads {r['threads']} | "
        f"{r['steps']} timed steps after {r['warmup']} warm-up"
    )
    print(f"CPU: {r['cpu']}")
    print()
    print(
        "| case | base dtype | attn | autocast | B x T | LoRA | trainable | step (median) | tokens/s | peak RSS "
        "| RSS peak in steps | other CPU (max per step) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    hw = f"{peak_rss_steps_mib:.0f} MiB" if peak_rss_steps_mib is not None else "n/a"
    print(
        f"| {r['case']} | {r['dtype']} | {r['attn']} | {r['autocast']} | {BATCH} x {BLOCK} | r {R}, alpha {ALPHA}, "
        f"{n_lora_modules} modules | {n_trainable / 1e6:.2f} M of {base_params / 1e6:.1f} M | "
        f"{med * 1e3:.0f} ms | {r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} MiB | {hw} | {bench_protocol.share_cell(r)} |"
    )


if __name__ == "__main__":
    main()
