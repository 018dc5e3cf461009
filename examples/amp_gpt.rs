//! Train a small GPT in f32, f16 and bf16 with `candle-amp` master weights and loss scaling,
//! and in pure f16 without it, on the same data from the same seed.
//!
//! `cargo run --release --example amp_gpt -- [steps]` (default 60). Uses
//! `data/tinyshakespeare.txt` if present, else a synthetic token task.
//! The full comparison with timings and peak heap is `cargo bench -p candle-amp --bench amp`.

#[path = "../candle-amp/benches/common/mod.rs"]
mod common;

use candle_amp::StepOutcome;
use candle_core::Device;
use common::{train, Data, GptConfig, Mode, TrainConfig};

fn main() -> anyhow::Result<()> {
    let steps = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tinyshakespeare.txt");
    let data = Data::load(&path);
    println!("data: {}", data.source);
    let dev = Device::Cpu;
    let tc = TrainConfig {
        gpt: GptConfig {
            vocab: data.vocab,
            block: 32,
            n_embd: 64,
            n_head: 4,
            n_layer: 2,
        },
        batch: 8,
        steps,
        lr: 3e-3,
        clip: 1.0,
        seed: 7,
        eval_batches: 4,
        warmup: 1,
    };
    let mut results = Vec::new();
    for mode in Mode::ALL {
        let r = train(mode, &tc, &data, &dev, |i, loss, outcome| {
            match outcome {
                Some(StepOutcome::Skipped { reason, scale_before, scale_after, nonfinite_params, .. }) => println!(
                    "  [{}] step {i}: skipped ({reason:?}), scale {scale_before} -> {scale_after}, non-finite: {nonfinite_params:?}",
                    mode.name()
                ),
                _ if i % 20 == 0 => println!("  [{}] step {i}: loss {loss:.4}", mode.name()),
                _ => {}
            }
        })?;
        println!(
            "{:>10}: eval loss {:.4}, {:.1} ms/step, skipped {}, final scale {}, first non-finite loss: {:?}",
            mode.name(),
            r.eval_loss,
            r.step_time.as_secs_f64() * 1e3,
            r.skipped,
            r.final_scale,
            r.first_nonfinite
        );
        results.push(r);
    }
    let base = results[0].eval_loss;
    for r in &results[1..] {
        println!(
            "{:>10}: ratio to f32 {:.4}",
            r.mode.name(),
            r.eval_loss / base
        );
    }
    Ok(())
}
