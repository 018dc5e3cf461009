#!/usr/bin/env python3
"""PyTorch anchor for the trainer's DPO LoRA step: TRL's DPOTrainer (1.16) at SmolLM2-135M's shape.

The model: the base directory `trainer/benches/dpo_step.rs` writes (`--base-dir`: config.json and a
bf16 model.safetensors, random weights at SmolLM2-135M's shape), loaded in bf16, handed to
`DPOTrainer(model, ref_model=None, peft_config=LoraConfig(r=16, lora_alpha=32,
target_modules="all-linear", lora_dropout=0.0))`: TRL's adapter path, the reference being the
base with the adapters off, f32 adapters over the bf16 base. `DPOConfig(loss_type=["sigmoid"],
beta=0.1, max_length=256, truncation_mode="keep_start", gradient_checkpointing=False)`.

The data: the preference records of `--data` (JSONL `prompt` / `chosen` / `rejected`, the file the
Rust side trains on, every pair cut to 256 tokens by max_length) tokenised by TRL with the
`--tokenizer` directory's tokenizer. A step: `--pairs` records (4) through TRL's collator,
`trainer.compute_loss` (the policy's forward of chosen and rejected concatenated, the
reference's forward with the adapters off, the sigmoid loss and metrics) under
`torch.autocast("cpu", dtype=torch.bfloat16)`, backward, AdamW (lr 1e-4, weight decay 0.01) over
the adapters, zero_grad. Measured as `bench/peft_lora_step.py` measures (the bench protocol,
VmHWM over the steps), with the load's time.

    .venv-py/bin/python bench/trl_dpo_step.py --base-dir DIR --pairs-file pairs.jsonl --tokenizer DIR --threads 2

Prints one JSON line (starts with `{`). Optional, never run in CI.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol  # noqa: E402
from peft_lora_step import ALPHA, BLOCK, R, reset_hwm, status_mib  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", required=True)
    ap.add_argument("--pairs-file", required=True, help="JSONL preference records")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--pairs", type=int, default=4, help="preference pairs per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import datasets
    import peft
    import torch
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_base_mib = status_mib("VmRSS")
    records = [json.loads(l) for l in open(args.pairs_file) if l.strip()]
    load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = LlamaForCausalLM.from_pretrained(args.base_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    out = tempfile.TemporaryDirectory()
    cfg = DPOConfig(
        output_dir=out.name, loss_type=["sigmoid"], beta=0.1, max_length=BLOCK, truncation_mode="keep_start",
        per_device_train_batch_size=args.pairs, report_to="none", use_cpu=True, seed=0, dataset_num_proc=None,
        bf16=False, fp16=False, gradient_checkpointing=False,
    )
    lora = LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = DPOTrainer(
        model=model, ref_model=None, args=cfg, train_dataset=datasets.Dataset.from_list(records),
        processing_class=tok, peft_config=lora,
    )
    m = trainer.model
    m.train()
    load_s = time.perf_counter() - load
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    lengths = sorted({len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows})
    trainable = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01)
    at = [0]

    def step():
        picked = [rows[(at[0] + i) % len(rows)] for i in range(args.pairs)]
        at[0] += args.pairs
        batch = trainer.data_collator(picked)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = trainer.compute_loss(m, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    hwm_before_steps = status_mib("VmHWM")
    hwm_reset = reset_hwm()
    losses = [step() for _ in range(args.warmup)]
    timed = [bench_protocol.timed(lambda: losses.append(step())) for _ in range(args.steps)]
    med = statistics.median([t for t, _, _ in timed])
    r = {
        "bench": "trl_dpo_step",
        "case": "peft",
        "threads": torch.get_num_threads(),
        "pairs": args.pairs,
        "max_length": BLOCK,
        "pair_token_lengths": [lengths[0], lengths[-1]],
        "trainable_params": sum(p.numel() for p in trainable),
        "load_s": load_s,
        "step_median_s": med,
        "step_mean_s": statistics.mean([t for t, _, _ in timed]),
        "peak_rss_mib": max(status_mib("VmHWM"), hwm_before_steps),
        "peak_rss_steps_mib": status_mib("VmHWM") if hwm_reset else None,
        "rss_base_mib": rss_base_mib,
        "loss_first_last": [losses[0], losses[-1]],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "trl": trl.__version__,
        **bench_protocol.summary(timed),
    }
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
