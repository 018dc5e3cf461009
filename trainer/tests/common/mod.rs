//! Shared helpers for the trainer's integration tests.
#![allow(dead_code)]

pub mod hf;
pub mod tiny;

use std::path::Path;

use trainer::config::TrainConfig;
use trainer::metrics::StepStats;
use trainer::train::{Event, Observer};

/// A config small enough for a test: 2 layers, 32 wide, 16 tokens, embedded addition data.
pub fn tiny_config(out_dir: &Path) -> TrainConfig {
    TrainConfig {
        out_dir: out_dir.to_path_buf(),
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        batch_size: 4,
        max_iters: 8,
        lr_decay_iters: Some(8),
        warmup_iters: 2,
        eval_interval: 4,
        eval_iters: 2,
        eval_problems: 16,
        digits: 2,
        // Tokenised corpora are cached next to the run, not in the user's cache directory.
        cache_dir: Some(out_dir.join("cache")),
        // A given peak skips the ~0.5 s matmul benchmark in every Trainer::new (MFU only).
        peak_flops: 1e12,
        ..TrainConfig::default()
    }
}

/// Records every step's statistics; optionally raises the stop flag after `stop_after` steps.
#[derive(Default)]
pub struct Recorder {
    pub steps: Vec<StepStats>,
    pub stop_after: Option<(usize, std::sync::Arc<std::sync::atomic::AtomicBool>)>,
}

impl Observer for Recorder {
    fn on_event(&mut self, event: Event<'_>) {
        if let Event::Step(s) = event {
            self.steps.push(s.clone());
            if let Some((n, flag)) = &self.stop_after {
                if s.step >= *n {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
    }
}

/// All parameters as (name, flattened f32 values).
pub fn weights(t: &trainer::train::Trainer) -> Vec<(String, Vec<f32>)> {
    t.params
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect()
}

/// Every file below `dir` with its bytes, sorted by path.
pub fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Runs the `trainer` binary with `args` in `cwd`.
pub fn run_cli(args: &[&str], cwd: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run the trainer binary")
}

/// stdout followed by stderr of a finished command.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
