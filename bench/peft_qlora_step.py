#!/usr/bin/env python3
"""PyTorch anchor for the trainer's QLoRA training step: transformers' LlamaForCausalLM loaded in
4 bits by bitsandbytes 0.50.2 on the CPU, with a PEFT LoRA adapter.

The model: the base directory `trainer/benches/lora_step.rs` writes (`--base`: config.json and a
bf16 model.safetensors, random weights at SmolLM2-135M's or Llama-3.2-1B's shape), loaded with
`from_pretrained(base, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
bnb_4bit_use_double_quant=--double-quant), dtype=torch.bfloat16, device_map="cpu")`: every
projection quantized as it is read, lm_head (tied to the embeddings) kept in bf16, as
transformers does by default. The adapter: `LoraConfig(r=16, lora_alpha=32,
target_modules="all-linear", lora_dropout=0.0)`, f32 adapters (PEFT's autocast_adapter_dtype).
`prepare_model_for_kbit_training` is not called: it would turn gradient checkpointing on and
cast the bf16 norms and embeddings to f32, and ours does neither (the LoRA bench's PEFT row
does not either). The forward runs under `torch.autocast("cpu", dtype=torch.bfloat16)`.

The step, the batch (uniform random tokens, 4 x 256), the optimiser (AdamW lr 1e-4 over the
adapters) and the bench protocol are `bench/peft_lora_step.py`'s. Measured besides: the load's
time (from_pretrained and get_peft_model), the peak of the anonymous RSS (`RssAnon` of
/proc/self/status, sampled every 2 ms by a thread, over the whole process and over the warm-up
and timed steps alone; `VmHWM` also counts the file pages of the mapped safetensors file) and
the base's weight bytes as loaded (every parameter and buffer, the 4-bit projections as their
packed codes plus their quant state's absmax and nested tensors).

    .venv-bnb/bin/python bench/peft_qlora_step.py --base DIR --threads 2 --steps 3 --warmup 1

Prints one JSON line (starts with `{`), then a one-line table. Optional, never run in CI.
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol  # noqa: E402
from peft_lora_step import ALPHA, BATCH, BLOCK, R, make_step, reset_hwm, status_mib  # noqa: E402
from torch_common import AnonPeak  # noqa: E402



def weight_bytes(model):
    """(4-bit projections' bytes, every other parameter's and buffer's bytes) of a model
    transformers loaded with bitsandbytes: a Params4bit counts its packed codes and its quant
    state's tensors (absmax, the 16-value code, and nested absmax and map with double
    quantization); a tied tensor counts once."""
    import bitsandbytes as bnb

    quant, rest, seen = 0, 0, set()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if id(p) in seen:  # tied: the embedding is also lm_head's weight
                continue
            seen.add(id(p))
            if isinstance(module, bnb.nn.Linear4bit) and name == "weight":
                qs = p.quant_state
                quant += p.numel() * p.element_size()
                for t in (qs.absmax, qs.code, getattr(qs.state2, "absmax", None), getattr(qs.state2, "code", None)):
                    if t is not None:
                        quant += t.numel() * t.element_size()
            else:
                rest += p.numel() * p.element_size()
    return quant, rest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the base model directory (config.json, model.safetensors)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--double-quant", action="store_true", help="bnb_4bit_use_double_quant")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    anon = AnonPeak()

    import bitsandbytes as bnb
    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_base_mib = status_mib("VmRSS")
    load = time.perf_counter()
    qcfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=args.double_quant,
    )
    model = LlamaForCausalLM.from_pretrained(
        args.base, quantization_config=qcfg, dtype=torch.bfloat16, device_map="cpu", attn_implementation=args.attn
    )
    n4 = sum(1 for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    quant_bytes, rest_bytes = weight_bytes(model)
    model = get_peft_model(
        model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    model.train()
    load_s = time.perf_counter() - load
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    step = make_step(torch, model, opt, vocab, gen)

    rss_before_steps_mib = status_mib("VmRSS")
    anon_load = anon.read()
    hwm_before_steps = status_mib("VmHWM")
    hwm_reset = reset_hwm()
    anon.reset()
    losses = [step() for _ in range(args.warmup)]
    timed = [bench_protocol.timed(lambda: losses.append(step())) for _ in range(args.steps)]
    anon_steps = anon.read()
    anon.close()
    times = [t for t, _, _ in timed]
    # --steps 0: the load and the warm-up steps' memory only (no times: null, as the Rust side).
    med = statistics.median(times) if times else None
    r = {
        "bench": "peft_qlora_step",
        "case": model.config.num_hidden_layers,
        "quant": "nf4",
        "double_quant": args.double_quant,
        "linear4bit_modules": n4,
        "attn": args.attn,
        "threads": torch.get_num_threads(),
        "batch": BATCH,
        "block": BLOCK,
        "trainable_params": n_trainable,
        "steps": args.steps,
        "warmup": args.warmup,
        "load_s": load_s,
        "step_median_s": med,
        "step_mean_s": statistics.mean(times) if times else None,
        "tokens_per_s": BATCH * BLOCK / med if times else None,
        "proj_nf4_bytes": quant_bytes,
        "whole_qlora_bytes": quant_bytes + rest_bytes,
        "peak_rss_mib": max(status_mib("VmHWM"), hwm_before_steps),
        "rss_base_mib": rss_base_mib,
        "rss_before_steps_mib": rss_before_steps_mib,
        "peak_rss_steps_mib": status_mib("VmHWM") if hwm_reset else None,
        "anon_peak_mib": max(anon_load, anon_steps),
        "anon_peak_steps_mib": anon_steps,
        "loss_first_last": [losses[0], losses[-1]] if losses else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bnb.__version__,
        **bench_protocol.summary(timed),
    }
    r["case"] = f"{r['case']} layers"
    print(json.dumps(r), flush=True)
    print()
    print(
        f"torch {r['torch']} | transformers {r['transformers']} | peft {r['peft']} | bitsandbytes "
        f"{r['bitsandbytes']} | threads {r['threads']} | CPU: {r['cpu']}"
    )
    print(
        f"| PEFT + bitsandbytes QLoRA | {n4} Linear4bit | {n_trainable / 1e6:.2f} M trainable | load {load_s:.1f} s "
        f"| {med * 1e3 if times else float('nan'):.0f} ms | anon peak {r['anon_peak_mib']:.0f} MiB ({anon_steps:.0f} MiB in the steps) "
        f"| {bench_protocol.share_cell(r)} |"
    )


if __name__ == "__main__":
    main()
