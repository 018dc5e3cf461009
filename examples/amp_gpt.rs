//! Train the trainer's GPT in f32, bf16 and f16 with `candle-amp` (f32 master weights, loss
//! scaling for f16) on the same data from the same seed, and compare the eval losses.
//!
//! ```text
//! cargo run --release --example amp_gpt -- [steps]
//! ```
//!
//! (default 60 steps) on `data/tinyshakespeare.txt`, char-level (the trainer's data module).
//! The model casts its f32 parameters to the compute dtype at use (`WeightMode::Cast`), so
//! gradients arrive in f32; `Amp::step` checks them for overflow with the trainer's fused AdamW's
//! own norm, and hands that AdamW one coefficient that unscales and clips them. f16 uses a dynamic
//! loss scale; bf16 and f32 need none. The full comparison with timings and peak heap is
//! `cargo bench -p candle-amp --bench amp`.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer as _;
use candle_train::amp::{Amp, MasterWeights, ScalerConfig, StepOutcome, WeightMode};
use candle_train::trainer::data::{DataKind, DataSource, DataSpec, Split, TextSource};
use candle_train::trainer::model::gpt2::{Gpt, GptConfig};
use candle_train::trainer::model::{cross_entropy, Ctx};
use candle_train::trainer::optim::{AdamW, AdamWConfig};

const BATCH: usize = 8;
const EVAL_BATCHES: u64 = 4;

/// Batch `k` of `split`: `BATCH` windows at fixed pseudo-random offsets (the same in every
/// mode), as inputs and next-token targets.
fn batch(tokens: &[u32], t: usize, k: u64, dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut rows = Vec::with_capacity(BATCH * (t + 1));
    for r in 0..BATCH as u64 {
        let h = (k * BATCH as u64 + r + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16;
        let at = (h % (tokens.len() - t) as u64) as usize;
        rows.extend_from_slice(&tokens[at..at + t + 1]);
    }
    let rows = Tensor::from_vec(rows, (BATCH, t + 1), dev)?;
    Ok((rows.narrow(1, 0, t)?, rows.narrow(1, 1, t)?))
}

struct Run {
    eval_loss: f32,
    ms_per_step: f64,
    skipped: usize,
    final_scale: f64,
}

fn train(dtype: DType, cfg: &GptConfig, data: &TextSource, steps: u64) -> Result<Run> {
    let dev = Device::Cpu;
    let (model, params) = Gpt::new(cfg, 7, &dev)?;
    let named = params.iter().map(|(n, v)| (n.clone(), v.clone()));
    let weights = MasterWeights::new(named, dtype, WeightMode::Cast)?;
    let scaler = match dtype {
        DType::F16 => ScalerConfig::dynamic(),
        _ => ScalerConfig::none(),
    };
    let mut amp = Amp::new(weights, scaler)?.with_clip_norm(Some(1.0))?;
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    opt.set_learning_rate(3e-3);
    let train = data.tokens(Split::Train)?;
    let (mut skipped, start) = (0, Instant::now());
    for step in 0..steps {
        let (x, y) = batch(&train, cfg.block_size, step, &dev)?;
        let ctx = Ctx::train(step).with_dtype(dtype);
        let loss = cross_entropy(&model.to_dtype(dtype)?.forward(&x, &ctx)?, &y, None)?;
        let grads = amp.backward(&loss)?; // of the loss times the current scale
        match amp.step(&grads, &mut opt)? {
            StepOutcome::Skipped {
                scale_before,
                scale_after,
                nonfinite_params,
                ..
            } => {
                skipped += 1;
                println!(
                    "  [{}] step {step}: skipped, scale {scale_before} -> {scale_after}, \
                     non-finite: {nonfinite_params:?}",
                    dtype.as_str()
                );
            }
            _ if step % 20 == 0 => {
                println!(
                    "  [{}] step {step}: loss {:.4}",
                    dtype.as_str(),
                    loss.to_scalar::<f32>()?
                )
            }
            _ => {}
        }
    }
    let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64;
    let eval = model.to_dtype(dtype)?;
    let mut total = 0.0;
    for k in 0..EVAL_BATCHES {
        let (x, y) = batch(&data.tokens(Split::Val)?, cfg.block_size, k, &dev)?;
        let logits = eval.forward(&x, &Ctx::eval().with_dtype(dtype))?;
        total += cross_entropy(&logits, &y, None)?.to_scalar::<f32>()?;
    }
    Ok(Run {
        eval_loss: total / EVAL_BATCHES as f32,
        ms_per_step,
        skipped,
        final_scale: amp.scale(),
    })
}

fn main() -> Result<()> {
    let steps = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .with_context(|| format!("steps must be a number, not `{s}`"))?,
        None => 60,
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tinyshakespeare.txt");
    let spec = DataSpec {
        kind: DataKind::Char,
        path: Some(path),
        ..DataSpec::default()
    };
    let data = TextSource::open(&spec)?;
    println!("data: {}", data.describe());
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: data.vocab_size(),
        dropout: 0.0,
        ..GptConfig::default()
    };
    let mut base = None;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let r = train(dtype, &cfg, &data, steps)?;
        let ratio = base.map_or(String::new(), |b| {
            format!(", ratio to f32 {:.4}", r.eval_loss / b)
        });
        println!(
            "{:>5}: eval loss {:.4}, {:.1} ms/step, skipped {}, final scale {}{ratio}",
            dtype.as_str(),
            r.eval_loss,
            r.ms_per_step,
            r.skipped,
            r.final_scale
        );
        base = base.or(Some(r.eval_loss));
    }
    Ok(())
}
