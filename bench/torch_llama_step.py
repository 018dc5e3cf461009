#!/usr/bin/env python3
"""PyTorch anchor for the trainer's Llama training step: Hugging Face transformers'
LlamaForCausalLM on CPU.

The step: forward with labels (transformers' shifted cross-entropy; the logits are upcast to f32
in the loss), backward, clip_grad_norm_(1.0), AdamW (PyTorch's default CPU implementation,
betas (0.9, 0.95), weight decay 0.1 on 2-D weights only, none on RMSNorm weights, as
bench/torch_step.py), zero_grad(set_to_none=True). Batches are uniform random tokens
(labels = input_ids; transformers shifts them), so the loss stays near ln(vocab): only the speed
is of interest. Attention: transformers' default SDPA (`--attn eager` for the eager row); bf16 is
`torch.autocast` over f32 weights.

Prints, per case, the median and mean step time after warm-up, tokens/s (batch x block per
step), MFU (nanoGPT-style FLOP count, 6 x matmul parameters + 12 x layers x heads x head_dim x
block per token, over an f32 1024^3 matmul ceiling measured here, as bench/torch_step.py), the
process's peak RSS (getrusage maxrss: each case runs in its own process), the peak of live
tensors during a step (PyTorch's profiler memory timeline, as bench/torch_step.py;
`--no-peak-tensors` skips it) and the share of the step's self CPU time spent in matmuls
(torch.profiler over one step: aten::mm, addmm, bmm, baddbmm, matmul self time over all ops'
self time; with `--attn sdpa`, the fused attention kernel is reported separately).
Timed steps follow the bench protocol (bench/bench_protocol.py: other processes' CPU share and
steal per step, a step over 2% re-run up to 5 times; the CPU model and flags printed).
One JSON line per case (starts with `{`) and a table.

    .venv-py/bin/python bench/torch_llama_step.py --only llama-small --threads 2 --steps 5
    .venv-py/bin/python bench/torch_llama_step.py --dtype bf16      # CPU autocast to bfloat16

Cases: `smollm2-135m` (SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads / 3 KV heads,
intermediate 1536, vocab 49152, tied, RMSNorm eps 1e-5, rope theta 100000; block 256, batch 4)
and `llama-small` (8 layers, hidden 256, 8 heads / 2 KV heads, intermediate 704, vocab 8192,
untied; block 256, batch 8), and `gemma3-270m` (Gemma3ForCausalLM at Gemma 3 270M's shape: the
committed trainer/tests/fixtures/gemma3/shape_270m/config.json, 18 layers, hidden 640, 4 heads / 1
KV head of 256, intermediate 2048, vocab 262144, tied, 5 sliding layers (window 512) to 1 full;
block 256, batch 4). Weights are transformers' random init, f32. Memory also as the peak of the
anonymous RSS (`RssAnon` sampled every 2 ms by a thread, torch_common.AnonPeak).

Optional: needs scripts/python/setup.sh's venv (torch, transformers); never run in CI.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol  # noqa: E402
from torch_common import AnonPeak, adamw, matmul_ceiling, peak_step_bytes  # noqa: E402


def llama_case(rope_theta, block, batch, **cfg):
    """A case: the LlamaConfig arguments `cfg` plus what both models share (RMSNorm eps 1e-5,
    default RoPE of base `rope_theta`, 2048 positions), and the step's block and batch."""
    shared = dict(
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=rope_theta),
        max_position_embeddings=2048,
    )
    return dict(cfg={**cfg, **shared}, block=block, batch=batch)


CASES = {
    "smollm2-135m": llama_case(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        rope_theta=100000.0, block=256, batch=4,
    ),
    "llama-small": llama_case(
        vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=10000.0, block=256, batch=8,
    ),
    # Gemma 3 270M's shape: the config.json of scripts/python/make_gemma3_fixtures.py's
    # `shape_270m` (Gemma3ForCausalLM, 268,098,176 parameters), which the Rust side reads too.
    "gemma3-270m": dict(
        config_dir=os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            "trainer", "tests", "fixtures", "gemma3", "shape_270m",
        ),
        block=256,
        batch=4,
    ),
}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::addbmm"}
WARMUP = 3


def build_model(name, attn):
    """Case `name`'s model in f32, transformers' random init (torch's seed is the caller's),
    with attention `attn` (`sdpa` or `eager`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    case = CASES[name]
    if "config_dir" in case:
        cfg = AutoConfig.from_pretrained(case["config_dir"], use_cache=False)
        cfg._attn_implementation = attn
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    cfg = LlamaConfig(**case["cfg"], use_cache=False)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).to(torch.float32)


def current_rss_mib():
    """The process's resident set now (after imports, before the model exists)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def op_shares(step):
    """(matmul share, fused-attention share, top ops) of the self CPU time of one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    sdpa = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
    return mm / total, sdpa / total, [(e.key, round(e.self_cpu_time_total / total, 4)) for e in top]


def run_case(name, args):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peak_flops = matmul_ceiling(torch)
    anon = AnonPeak()
    rss_base_mib = current_rss_mib()
    case = CASES[name]
    model = build_model(name, args.attn)
    cfg = model.config
    model.train()
    block, batch = case["block"], case["batch"]
    opt = adamw(torch, model, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.vocab_size

    def step():
        x = torch.randint(vocab, (batch, block), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step() for _ in range(args.warmup)]
    timed = [bench_protocol.timed(lambda: losses.append(step())) for _ in range(args.steps)]
    times = [t for t, _, _ in timed]
    # the peak over the warm-up and timed steps, before the profiler runs any more steps
    peak_rss_steps_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    anon_peak_mib = anon.read()
    anon.close()
    med, mean = statistics.median(times), statistics.mean(times)
    tokens = batch * block
    # matmul parameters: every Linear weight, lm_head included (tied or not); not the embedding lookup
    n_mm = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    fpt = 6 * n_mm + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * block
    mm_share, sdpa_share, top = op_shares(step)
    peak_tensors = None
    if not args.no_peak_tensors:
        try:
            peak_tensors = peak_step_bytes(step)
        except Exception as e:  # noqa: BLE001 - profiler API differences across versions
            peak_tensors = f"n/a ({e})"
    return {
        "bench": "torch_llama_step",
        "case": name,
        "dtype": args.dtype,
        "attn": args.attn,
        "threads": torch.get_num_threads(),
        "batch": batch,
        "block": block,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": args.steps,
        "warmup": args.warmup,
        "step_median_s": med,
        "step_mean_s": mean,
        "tokens_per_s": tokens / med,
        "mfu": fpt * tokens / med / peak_flops,
        "matmul_ceiling_gflops": peak_flops / 1e9,
        "matmul_share": mm_share,
        "sdpa_share": sdpa_share,
        "top_ops_self_cpu": top,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_base_mib": rss_base_mib,
        "peak_rss_steps_mib": peak_rss_steps_mib,
        "anon_peak_mib": anon_peak_mib,
        "peak_tensors_mib": peak_tensors / 2**20 if isinstance(peak_tensors, int) else peak_tensors,
        "loss_first_last": [losses[0], losses[-1]],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **bench_protocol.summary(timed),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="warm-up steps")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--no-peak-tensors", action="store_true", help="skip the profiler memory timeline")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(run_case(args.child, args)), flush=True)
        return

    rows = []
    for name in CASES:
        if args.only and args.only not in name:
            continue
        # each case in its own process, so that maxrss is that case's
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + [
            a for a in sys.argv[1:] if not a.startswith("--only") and a != args.only
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.stderr.write(out.stderr)
            sys.exit(f"torch_llama_step.py: case {name} failed")
        line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
        print(line, flush=True)
        rows.append(json.loads(line))
    if not rows:
        sys.exit("torch_llama_step.py: no case matches --only")
    r0 = rows[0]
    print()
    print(f"CPU: {r0['cpu']}")
    print(
        f"torch {r0['torch']} | transformers {r0['transformers']} | threads {r0['threads']} | "
        f"matmul ceiling {r0['matmul_ceiling_gflops']:.1f} GFLOP/s (f32 1024^3) | "
        f"{r0['steps']} timed steps after {r0['warmup']} warm-up"
    )
    print()
    print(
        "| case | dtype | attn | B x T | step (median) | step (mean) | tokens/s | MFU | matmul share "
        "| peak RSS | peak tensors | other CPU (max per step) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pt = r["peak_tensors_mib"]
        pt = f"{pt:.1f} MiB" if isinstance(pt, float) else ("skipped" if pt is None else pt)
        share = f"{100 * r['matmul_share']:.1f}%"
        if r["attn"] == "sdpa":
            share += f" (+{100 * r['sdpa_share']:.1f}% sdpa)"
        print(
            f"| {r['case']} | {r['dtype']} | {r['attn']} | {r['batch']} x {r['block']} | "
            f"{r['step_median_s'] * 1e3:.1f} ms | {r['step_mean_s'] * 1e3:.1f} ms | "
            f"{r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | {share} | "
            f"{r['peak_rss_mib']:.0f} MiB | {pt} | {bench_protocol.share_cell(r)} |"
        )


if __name__ == "__main__":
    main()
