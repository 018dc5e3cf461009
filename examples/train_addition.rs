//! Train the trainer's GPT on the embedded addition task from code, with activation
//! checkpointing and bf16 mixed precision composed by config fields, then resume it.
//!
//! ```text
//! cargo run --release --example train_addition
//! ```

use std::sync::atomic::AtomicBool;

use candle_train::remat::Policy;
use candle_train::trainer::config::{Precision, TrainConfig};
use candle_train::trainer::train::{Event, Observer, Trainer};

struct Print;

impl Observer for Print {
    fn on_event(&mut self, event: Event<'_>) {
        match event {
            Event::Step(s) if s.step % 20 == 0 => {
                println!(
                    "step {:>4} loss {:.4} ({:.0} tok/s)",
                    s.step, s.loss, s.tokens_per_sec
                )
            }
            Event::Eval(e) => println!(
                "eval {:>4} val {:.4} accuracy {:.1}%",
                e.step,
                e.val_loss,
                100.0 * e.score.unwrap_or(0.0)
            ),
            _ => {}
        }
    }
}

fn main() -> anyhow::Result<()> {
    let out_dir = std::env::temp_dir().join("candle-train-example-addition");
    let _ = std::fs::remove_dir_all(&out_dir);
    let config = TrainConfig {
        out_dir: out_dir.clone(),
        n_layer: 2,
        max_iters: 60,
        lr_decay_iters: Some(100), // the schedule of the whole 100-step run
        eval_interval: 30,
        eval_problems: 100,
        remat: Policy::EveryK(1), // recompute every block in backward
        dtype: Precision::Bf16,   // bf16 compute, f32 master weights
        ..TrainConfig::default()
    };
    let stop = AtomicBool::new(false);
    let mut run = Trainer::new(config)?;
    run.run(&mut Print, &stop)?;
    // Continue the same run for 40 more steps, bit-exactly.
    let mut more = Trainer::resume(&out_dir, |c| c.max_iters = 100)?;
    let summary = more.run(&mut Print, &stop)?;
    println!("done at step {}: {:?}", summary.step, summary.checkpoint);
    Ok(())
}
