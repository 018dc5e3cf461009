//! Training the trainer's GPT with activation checkpointing (`candle-remat`) over its blocks.
//!
//! ```text
//! cargo run --release --example remat_gpt -- [none|all|every:K|sqrt|budget:BYTES]
//! ```
//!
//! (default `sqrt`; a budget takes units, e.g. `budget:8MiB`). The model runs fused attention
//! and LayerNorm (`candle-fused`) with dropout 0.1. The only changes to an ordinary training
//! step are running the chain (`Model::links`) through the plan (`run_chain` with a `Tape`) and
//! `tape.backward(&loss)` instead of `loss.backward()`. The first step also checks that the
//! checkpointed gradients are bit-identical to plain Candle's backward of `Gpt::forward`.

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer as _;
use candle_train::remat::{Policy, Tape};
use candle_train::trainer::model::gpt2::{Gpt, GptConfig};
use candle_train::trainer::model::ModelConfig;
use candle_train::trainer::model::{cross_entropy, Ctx, Kernels, Model};
use candle_train::trainer::objective::CrossEntropy;
use candle_train::trainer::optim::{AdamW, AdamWConfig};
use candle_train::trainer::train::run_chain;

const B: usize = 4;
const STEPS: u64 = 20;

fn main() -> Result<()> {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "sqrt".into());
    let policy: Policy = arg.parse().map_err(|e: String| anyhow!(e))?;
    let dev = Device::Cpu;
    let cfg = GptConfig {
        n_layer: 8,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: 64,
        dropout: 0.1,
        ..GptConfig::default()
    };
    let (model, params) = Gpt::new(&cfg, 7, &dev)?;
    // Per-block costs: the trainer's estimate for this batch (candle_remat::measure_chain
    // would measure them instead).
    let plan = policy.plan(&cfg.chain_costs(B, cfg.block_size, DType::F32, Kernels::Fused))?;
    println!("{plan}");

    // A learnable toy task: predict (token + 1) mod vocab.
    let (t, v) = (cfg.block_size, cfg.vocab_size);
    let ids: Vec<u32> = (0..B * t).map(|i| ((i * 7 + i / t) % v) as u32).collect();
    let next: Vec<u32> = ids.iter().map(|&i| (i + 1) % v as u32).collect();
    let x = Tensor::from_vec(ids, (B, t), &dev)?;
    let y = Tensor::from_vec(next, (B, t), &dev)?;
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    opt.set_learning_rate(3e-3);

    for step in 0..STEPS {
        let (links, ctx) = (model.links(), Ctx::train(step)); // dropout seeded by the step
        let tape = Tape::new(step);
        let loss = run_chain(&links, &x, &y, &ctx, Some((&tape, &plan)), &CrossEntropy)?.mean;
        let grads = tape.backward(&loss)?;
        if step == 0 {
            let plain = cross_entropy(&model.forward(&x, &ctx)?, &y, None)?.backward()?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(f32::to_bits)
                    .collect())
            };
            let mut identical = true;
            for (name, var) in params.iter() {
                let (a, b) = (grads.get(var), plain.get(var));
                let (a, b) = a.zip(b).ok_or_else(|| anyhow!("no gradient for {name}"))?;
                identical &= bits(a)? == bits(b)?;
            }
            println!("gradients bit-identical to plain loss.backward(): {identical}");
        }
        opt.apply(&grads)?;
        if step % 5 == 0 || step == STEPS - 1 {
            println!("step {step:2}  loss {:.4}", loss.to_scalar::<f32>()?);
        }
    }
    Ok(())
}
