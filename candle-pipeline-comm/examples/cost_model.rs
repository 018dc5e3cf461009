//! Predicted step time of GPT-2 small (124M) on 1, 2, 8 and 64 nodes, data parallel and
//! pipeline × data parallel, over a 100 Gb/s and a 10 Gb/s network. **A model, not a
//! measurement** (`candle_pipeline_comm::cost`): the pipeline's timeline from candle-pipeline's
//! simulator, a ring all-reduce after the backward pass, nothing else.
//!
//! `cargo run --release -p candle-pipeline-comm --example cost_model [-- --tflops 100]`
//!
//! Assumptions (printed with the table):
//! - GPT-2 small: 124,439,808 parameters, 12 layers, width 768, context 1024; gradients in f32
//!   (4 bytes each: 498 MB per all-reduce for the whole model);
//! - compute: `6N + 12·L·C·T` FLOPs per token (as the trainer's MFU counts them; forward one
//!   third, backward two thirds) at `--tflops` sustained per node (default 100 TFLOP/s, e.g. an
//!   A100 at ~32% of its bf16 peak); the same rate at every microbatch size;
//! - a global batch of 512 sequences (524,288 tokens) per step, in microbatches of 4 sequences;
//! - pipeline: the 12 layers split evenly over 4 stages (embedding and head ignored), 1F1B, an
//!   f32 activation of 4 × 1024 × 768 (12.6 MB) per boundary and microbatch;
//! - links: 100 Gb/s with 5 µs latency (InfiniBand-class), 10 Gb/s with 50 µs (Ethernet/TCP),
//!   one per node, full duplex; the data-parallel all-reduce is not overlapped with backward.

use anyhow::{bail, Context};
use candle_pipeline_comm::cost::{Link, ScheduleKind, StepModel};

const PARAMS: f64 = 124_439_808.0;
const LAYERS: f64 = 12.0;
const WIDTH: f64 = 768.0;
const CONTEXT: f64 = 1024.0;
const GLOBAL_SEQS: usize = 512;
const MICROBATCH_SEQS: usize = 4;
const PIPELINE_STAGES: usize = 4;

fn main() -> anyhow::Result<()> {
    let mut tflops: f64 = 100.0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tflops" => {
                let v = args.next().context("--tflops needs a value")?;
                tflops = v.parse().with_context(|| format!("--tflops {v}"))?;
            }
            other => bail!("unknown argument {other} (only --tflops X)"),
        }
    }
    if tflops.is_nan() || tflops <= 0.0 {
        bail!("--tflops must be positive");
    }
    let flops_per_token = 6.0 * PARAMS + 12.0 * LAYERS * WIDTH * CONTEXT;
    let mb_tokens = MICROBATCH_SEQS as f64 * CONTEXT;
    let mb_time = flops_per_token * mb_tokens / (tflops * 1e12);
    let (fwd, bwd) = (mb_time / 3.0, mb_time * 2.0 / 3.0);
    let grad_bytes = 4.0 * PARAMS;
    let activation_bytes = mb_tokens * WIDTH * 4.0;
    let total_mb = GLOBAL_SEQS / MICROBATCH_SEQS;

    println!("MODEL, NOT MEASUREMENT: candle_pipeline_comm::cost (simulated 1F1B pipeline + ring all-reduce, no overlap)");
    println!(
        "GPT-2 small: {:.0}M params, {:.0} MB of f32 gradients; {:.1} GFLOP/token; {tflops} TFLOP/s per node \
         -> {:.1} ms forward+backward per microbatch of {} tokens on one node",
        PARAMS / 1e6,
        grad_bytes / 1e6,
        flops_per_token / 1e9,
        mb_time * 1e3,
        mb_tokens
    );
    println!(
        "global batch {GLOBAL_SEQS} x {CONTEXT} = {} tokens/step in {total_mb} microbatches of \
         {MICROBATCH_SEQS} sequences; pipeline: {PIPELINE_STAGES} even stages, {:.1} MB \
         activation per boundary and microbatch\n",
        GLOBAL_SEQS as f64 * CONTEXT,
        activation_bytes / 1e6
    );
    println!(
        "| network | layout | nodes | stages x replicas | microbatches / replica | step (ms) | \
         compute (ms) | bubble | DP all-reduce (ms) | comm share | tokens/s | vs 1 node |"
    );
    println!("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let networks = [
        ("100 Gb/s, 5 µs", Link::gbit(100.0, 5e-6)),
        ("10 Gb/s, 50 µs", Link::gbit(10.0, 50e-6)),
    ];
    for (name, link) in networks {
        let mut base = None;
        for nodes in [1usize, 2, 8, 64] {
            let layouts = [
                ("data parallel", 1),
                ("pipeline x DP", PIPELINE_STAGES.min(nodes)),
            ];
            for (layout, stages) in layouts {
                if stages == 1 && layout != "data parallel" {
                    continue;
                }
                let replicas = nodes / stages;
                let m = total_mb / replicas;
                let model = StepModel::even(
                    fwd,
                    bwd,
                    grad_bytes,
                    stages,
                    ScheduleKind::OneFOneB,
                    m,
                    replicas,
                    link,
                )
                .with_microbatch(activation_bytes, mb_tokens);
                let p = model.predict()?;
                let base = *base.get_or_insert(p.tokens_per_second);
                println!(
                    "| {name} | {layout} | {nodes} | {stages} x {replicas} | {m} | {:.0} | {:.0} | \
                     {:.1}% | {:.1} | {:.1}% | {:.2}M | {:.1}x |",
                    p.step_time * 1e3,
                    p.compute_time * 1e3,
                    p.bubble * 100.0,
                    p.all_reduce_time * 1e3,
                    p.comm_fraction * 100.0,
                    p.tokens_per_second / 1e6,
                    p.tokens_per_second / base
                );
            }
        }
    }
    println!(
        "\nstep = max over pipeline workers (end of its last backward + ring all-reduce of its \
         stage's gradients over the replicas); ring = 2(R-1)/R x bytes / bandwidth + 2(R-1) x \
         latency; bubble = idle share of the pipeline (simulator); comm share = (step - \
         pipeline) / step"
    );
    Ok(())
}
