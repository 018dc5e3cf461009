//! What `trainer train` prints: the banner, the progress bar, the summary; and the signal
//! handler that turns Ctrl-C / SIGTERM / SIGHUP into a checkpointed stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use trainer::config::{Parallelism, Precision};
use trainer::train::{Event, Observer, Summary, Trainer};

/// How a LoRA run holds its frozen base's weights (quantized on load as `nf4` says, the rest
/// in `dtype`), for the banner.
fn base_weights(
    base: &trainer::lora::BaseIdentity,
    nf4: Option<trainer::lora::Nf4Settings>,
    dtype: Precision,
) -> String {
    match (&base.quantization, nf4) {
        (Some(saved), _) => format!("{saved}, as saved"),
        (None, Some(q)) => format!(
            "nf4{} (lm_head {dtype})",
            if q.double { ", double-quantized" } else { "" },
        ),
        (None, None) => dtype.to_string(),
    }
}

pub(super) fn print_banner(trainer: &Trainer) {
    let cfg = &trainer.config;
    let dp = trainer.data_parallel();
    let trainable = trainer.params.num_elements() as f64 / 1e6;
    let parameters = match trainer.tuning() {
        trainer::lora::Tuning::Full => format!("{trainable:.2}M parameters"),
        trainer::lora::Tuning::Lora { .. } => format!(
            "{:.2}M parameters, {trainable:.2}M trainable",
            trainer.model.config().num_params() as f64 / 1e6
        ),
    };
    errln!(
        "data: {}\nmodel: {}, block {} | {parameters} | device {}\n\
         run: {} steps of {} x {} x {} tokens -> {}",
        trainer.data.describe(),
        trainer.model.config().describe(),
        cfg.block_size,
        cfg.device,
        cfg.max_iters,
        cfg.grad_accum,
        cfg.batch_size,
        cfg.block_size,
        cfg.out_dir.display(),
    );
    if let trainer::lora::Tuning::Lora { config, base, .. } = trainer.tuning() {
        let total = trainer.model.config().num_params() as f64;
        errln!(
            "LoRA: r {}, alpha {}, scaling {:.4}{}, dropout {}, targets {}{} over the frozen {} \
             ({} base weights) | trainable {:.2}M ({:.2}% of {:.2}M)",
            config.r,
            config.lora_alpha,
            config.scaling(),
            if config.use_rslora { " (rsLoRA)" } else { "" },
            config.lora_dropout,
            config.target_modules,
            match config.modules_to_save.is_empty() {
                true => String::new(),
                false => format!(", saving {}", config.modules_to_save.join(",")),
            },
            base.model,
            base_weights(
                base,
                cfg.nf4_settings(),
                cfg.base_dtype.unwrap_or(cfg.dtype)
            ),
            trainer.params.num_elements() as f64 / 1e6,
            100.0 * trainer.params.num_elements() as f64 / total,
            total / 1e6,
        );
    }
    if let Some(plan) = trainer.remat_plan() {
        errln!("activation checkpointing ({}):\n{plan}", cfg.remat);
    }
    if cfg.dtype != trainer::config::Precision::F32 {
        errln!(
            "mixed precision: {} compute, f32 master weights, loss scale {}",
            cfg.dtype,
            cfg.loss_scale
        );
    }
    if let Some(cuda) = cfg.cuda_summary() {
        errln!("{cuda}");
    }
    if let Parallelism::Pipeline {
        stages,
        microbatches,
        schedule,
        devices,
        ..
    } = cfg.parallelism()
    {
        let devices = if devices.0.is_empty() {
            cfg.device.to_string()
        } else {
            devices.to_string()
        };
        let remat = if cfg.remat == candle_remat::Policy::None {
            String::new()
        } else {
            format!(", remat {} inside each stage", cfg.remat)
        };
        errln!(
            "pipeline: {stages} stages on {devices}, {microbatches} microbatches, schedule \
             {schedule}{remat}"
        );
    }
    if dp.world_size() > 1 {
        errln!(
            "data parallel: {} ranks ({}), {} rows per rank, global batch {} rows",
            dp.world_size(),
            dp.comm().backend(),
            cfg.batch_size,
            dp.world_size() * cfg.batch_size
        );
    }
}

pub(super) fn install_signal_handler(stop: Arc<AtomicBool>) -> Result<()> {
    {
        // SIGINT, SIGTERM and SIGHUP (the crate's `termination` feature): finish the step,
        // checkpoint, exit. A second signal exits at once; the last checkpoint stays intact
        // because checkpoints are written atomically. This runs on ctrlc's signal thread: a
        // panic there would end it and every later signal would go unhandled, so its messages
        // go through errln!, which drops a write to a closed stderr instead of panicking.
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::SeqCst) {
                errln!("\nsecond signal: exiting without a checkpoint");
                std::process::exit(130);
            }
            errln!(
                "\nstop requested (signal): finishing this step and saving a checkpoint \
                 (send it again to exit at once)"
            );
        })
        .context("cannot install the signal handler")?;
    }
    Ok(())
}

pub(super) struct Progress {
    bar: ProgressBar,
    /// Off a terminal (the bar hidden): plain progress lines with an ETA.
    plain: PlainLines,
}

/// When the bar is hidden (stderr is a file or a pipe), a plain line every
/// [`PlainLines::EVERY`] steps or [`PlainLines::PERIOD`], whichever comes first, with the ETA.
struct PlainLines {
    total: usize,
    start_step: usize,
    start: Instant,
    last: Instant,
}

impl PlainLines {
    const EVERY: usize = 50;
    const PERIOD: Duration = Duration::from_secs(30);

    /// The line to print after `step`, if one is due.
    fn due(&mut self, step: usize, stats: &str) -> Option<String> {
        let now = Instant::now();
        let first = step == self.start_step + 1;
        if !(first || step.is_multiple_of(Self::EVERY) || step == self.total)
            && now.duration_since(self.last) < Self::PERIOD
        {
            return None;
        }
        self.last = now;
        let done = (step - self.start_step).max(1) as f64;
        let per_step = now.duration_since(self.start).as_secs_f64() / done;
        let eta = Duration::from_secs_f64(per_step * self.total.saturating_sub(step) as f64);
        Some(format!(
            "step {step:>6}/{} | {stats} | ETA {}",
            self.total,
            indicatif::HumanDuration(eta)
        ))
    }
}

impl Progress {
    /// Removes the bar (before the summary is printed).
    pub(super) fn finish(&self) {
        self.bar.finish_and_clear();
    }

    pub(super) fn new(total: usize, start: usize) -> Self {
        let bar = ProgressBar::new(total as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos:>5}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_position(start as u64);
        bar.reset_eta();
        bar.enable_steady_tick(Duration::from_millis(500));
        let now = Instant::now();
        let plain = PlainLines {
            total,
            start_step: start,
            start: now,
            last: now,
        };
        Progress { bar, plain }
    }

    fn line(&self, text: &str) {
        if self.bar.is_hidden() {
            errln!("{text}");
        } else {
            self.bar.println(text);
        }
    }
}

impl Observer for Progress {
    fn on_event(&mut self, event: Event<'_>) {
        match event {
            Event::Step(s) => {
                let line = format!(
                    "loss {:.4} | lr {:.2e} | gnorm {:.3} | {:.0} tok/s | {:.1} ms | MFU {:.1}%",
                    s.loss,
                    s.lr,
                    s.grad_norm,
                    s.tokens_per_sec,
                    s.step_ms,
                    100.0 * s.mfu
                );
                if self.bar.is_hidden() {
                    if let Some(plain) = self.plain.due(s.step, &line) {
                        errln!("{plain}");
                    }
                }
                self.bar.set_position(s.step as u64);
                self.bar.set_message(line);
            }
            Event::Eval(e) => {
                let score = match (&e.score, &e.score_name) {
                    (Some(s), Some(n)) => format!(" | {n} {:.1}%", 100.0 * s),
                    _ => String::new(),
                };
                let get = |k: &str| e.objective.get(k).copied();
                let mut held_out: String = e
                    .objective
                    .iter()
                    .filter(|(k, _)| k.ends_with("_loss"))
                    .map(|(k, v)| format!(" | val {} {v:.4}", k.trim_end_matches("_loss")))
                    .collect();
                if let (Some(acc), Some(margin)) =
                    (get("rewards/accuracies"), get("rewards/margins"))
                {
                    held_out += &format!(" | accuracy {:.1}% margin {margin:.4}", 100.0 * acc);
                }
                self.line(&format!(
                    "eval step {:>6} | train {:.4} | val {:.4}{held_out}{score}",
                    e.step, e.train_loss, e.val_loss
                ));
            }
            Event::Sample(text) => self.line(&format!("--- sample ---\n{text}\n--------------")),
            Event::Checkpoint(dir) => self.line(&format!("checkpoint {}", dir.display())),
        }
    }
}

pub(super) fn print_summary(trainer: &Trainer, s: &Summary) {
    let out = &trainer.config.out_dir;
    outln!(
        "{}",
        if s.interrupted {
            "== interrupted =="
        } else {
            "== done =="
        }
    );
    outln!("steps          {}", s.step);
    outln!(
        "time           {:.1} s ({:.0} tokens/s)",
        s.elapsed_secs,
        s.tokens_seen as f64 / s.elapsed_secs.max(1e-9)
    );
    let cfg = &trainer.config;
    // A resumed run's average includes the steps before the resume, whose rate this
    // process's ceiling has not seen: it rises to that average too.
    let mut ceiling = trainer.ceiling();
    let mfu = ceiling
        .utilisation(trainer.flops_per_token() * s.tokens_seen as f64 / s.elapsed_secs.max(1e-9));
    outln!(
        "MFU            {:.1}% of {:.1} GFLOP/s ({}{}, kernels {})",
        100.0 * mfu,
        ceiling.flops / 1e9,
        if ceiling.given {
            "--peak-flops"
        } else {
            "measured matmul ceiling"
        },
        if ceiling.raised {
            ", raised to the best step's rate"
        } else {
            ""
        },
        cfg.kernels
    );
    if let Some(e) = &s.last_eval {
        // An interrupted run's last evaluation may be older than its last step and checkpoint.
        let at = match e.step == s.step {
            true => String::new(),
            false => format!(" (evaluated at step {})", e.step),
        };
        outln!("train loss     {:.4}{at}", e.train_loss);
        outln!("val loss       {:.4}{at}", e.val_loss);
        if let (Some(score), Some(name)) = (e.score, &e.score_name) {
            outln!("{name:<14} {:.1}%", 100.0 * score);
        }
    }
    if let Some(b) = s.best_val_loss {
        outln!("best val loss  {b:.4}");
    }
    if let Some(c) = &s.checkpoint {
        outln!("checkpoint     {}", c.display());
    }
    outln!("metrics        {}", out.join("metrics.jsonl").display());
    outln!("loss curve     {}", out.join("loss.svg").display());
}
