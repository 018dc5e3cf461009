//! What the step benches share on our side: their step settings, the LoRA run they anchor on
//! PEFT's, and one case run in its own process (the trainer loaded, the warm-up and timed
//! steps under the protocol, time and memory).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use serde_json::{json, Value};
use trainer::config::{Precision, TrainConfig};
use trainer::train::Trainer;

use super::memory::AnonPeak;
use super::{protocol, reset_hwm, status_kib};

/// The steps and threads of a side-by-side step bench.
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
    /// Timed steps per case.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Warm-up steps per case (PEFT needs 2 to settle).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Threads for every side (0: the machine's cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Rounds of the sides, one run of each per round (A B A B).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
}

impl StepArgs {
    /// The same, with `threads` 0 resolved to the machine's cores and at least one round.
    pub fn resolved(self) -> Self {
        let threads = match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        StepArgs {
            threads,
            rounds: self.rounds.max(1),
            ..self
        }
    }

    /// `N threads, N timed steps after N warm-up per round, N rounds (sides)`.
    pub fn describe(&self, sides: &str) -> String {
        format!(
            "{} threads, {} timed steps after {} warm-up per round, {} rounds ({sides})",
            self.threads, self.steps, self.warmup, self.rounds
        )
    }

    /// Gives a side's process these settings: `--steps`, `--warmup` (and `--threads` for a
    /// Python side), and `RAYON_NUM_THREADS`.
    pub fn pass_to(&self, cmd: &mut Command, python: bool) {
        cmd.args(["--steps", &self.steps.to_string()])
            .args(["--warmup", &self.warmup.to_string()]);
        if python {
            cmd.args(["--threads", &self.threads.to_string()]);
        }
        if self.threads > 0 {
            cmd.env("RAYON_NUM_THREADS", self.threads.to_string());
        }
    }
}

/// A LoRA run over the model directory `base`, in `tmp`, with PEFT's anchors' settings: LoRA r
/// 16, alpha 32, dropout 0, the base frozen in bf16, bf16 compute; torch's AdamW(lr=1e-4)
/// (constant), betas (0.9, 0.999), weight decay 0.01, no clipping; no evaluation. The data are
/// the caller's.
pub fn lora_config(tmp: &Path, base: &Path) -> TrainConfig {
    TrainConfig {
        out_dir: tmp.join("run"),
        cache_dir: Some(tmp.join("cache")),
        init_from: Some(base.display().to_string()),
        max_iters: 1_000_000,
        eval_interval: 1_000_000,
        eval_problems: 0,
        lr: 1e-4,
        min_lr: 1e-4,
        warmup_iters: 0,
        beta1: 0.9,
        beta2: 0.999,
        weight_decay: 0.01,
        grad_clip: 0.0,
        dtype: Precision::Bf16,
        lora_r: 16,
        lora_alpha: 32.0,
        lora_dropout: 0.0,
        base_dtype: Some(Precision::Bf16),
        peak_flops: 1e12,
        ..TrainConfig::default()
    }
}

/// Builds the trainer of `config` (timed: `load_s`), runs `run.warmup` steps, then
/// `run.steps` timed steps under the protocol; the result line's fields: the median step, the
/// trainable parameters, the RSS before the trainer (`rss_base_mib`) and before the steps, the
/// peak RSS (`VmHWM`) of the whole process and of the steps alone (reset just before them),
/// the peak anonymous RSS likewise ([`AnonPeak`]), the first and last loss, the protocol's
/// fields.
pub fn run_steps(config: TrainConfig, run: &StepArgs) -> anyhow::Result<Value> {
    let anon = AnonPeak::start();
    let rss_base = status_kib("VmRSS:") / 1024.0;
    let load = Instant::now();
    let mut t = Trainer::new(config)?;
    let load_s = load.elapsed().as_secs_f64();
    let rss_before_steps = status_kib("VmRSS:") / 1024.0;
    let hwm_before_steps = status_kib("VmHWM:") / 1024.0;
    let anon_load = anon.peak_mib();
    let hwm_reset = reset_hwm();
    anon.reset();
    let mut losses = Vec::new();
    for _ in 0..run.warmup {
        losses.push(t.train_step()?.loss);
    }
    let timed = (0..run.steps)
        .map(|_| protocol::timed(|| t.train_step().map(|s| losses.push(s.loss))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let hwm_steps = status_kib("VmHWM:") / 1024.0;
    let anon_steps = anon.peak_mib();
    let mut r = json!({
        "step_median_s": protocol::median(&timed.iter().map(|t| t.secs).collect::<Vec<_>>()),
        "trainable_params": t.params.num_elements(),
        "load_s": load_s,
        "rss_base_mib": rss_base,
        "rss_before_steps_mib": rss_before_steps,
        "peak_rss_mib": hwm_steps.max(hwm_before_steps),
        "peak_rss_steps_mib": if hwm_reset { json!(hwm_steps) } else { Value::Null },
        "anon_peak_mib": anon_load.max(anon_steps),
        "anon_peak_steps_mib": anon_steps,
        "loss_first_last": [losses.first(), losses.last()],
    });
    if let (Some(r), Value::Object(p)) = (r.as_object_mut(), protocol::summary(&timed)) {
        r.extend(p);
    }
    Ok(r)
}
