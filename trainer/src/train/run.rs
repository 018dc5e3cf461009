//! The run loop: train until `max_iters` or a stop request, evaluating, logging and
//! checkpointing on the way, with progress reported to an [`Observer`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::{eval, Trainer};
use crate::checkpoint;
use crate::metrics::{EvalStats, MetricsLog, Record, StepStats};
use crate::Result;

/// Something that happened during [`Trainer::run`], for progress display.
#[derive(Debug)]
pub enum Event<'a> {
    /// An optimiser step finished.
    Step(&'a StepStats),
    /// An evaluation finished.
    Eval(&'a EvalStats),
    /// A text sample was generated at an evaluation.
    Sample(&'a str),
    /// A checkpoint was written.
    Checkpoint(&'a Path),
}

/// Receives [`Event`]s (the CLI draws a progress bar; tests ignore them).
pub trait Observer {
    /// Called for every event.
    fn on_event(&mut self, event: Event<'_>);
}

impl Observer for () {
    fn on_event(&mut self, _: Event<'_>) {}
}

/// A closure observes a run: `t.run(&mut |e: Event<'_>| { ... }, &stop)`.
impl<F: FnMut(Event<'_>)> Observer for F {
    fn on_event(&mut self, event: Event<'_>) {
        self(event)
    }
}

/// How [`Trainer::run`] ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Steps completed.
    pub step: usize,
    /// Whether the run stopped early on request (Ctrl-C).
    pub interrupted: bool,
    /// The last evaluation.
    pub last_eval: Option<EvalStats>,
    /// The best validation loss seen.
    pub best_val_loss: Option<f32>,
    /// Training seconds (across resumes).
    pub elapsed_secs: f64,
    /// Tokens consumed.
    pub tokens_seen: u64,
    /// The newest checkpoint.
    pub checkpoint: Option<PathBuf>,
}

impl Trainer {
    /// Trains until `max_iters` steps or until `stop` is set (Ctrl-C), evaluating and
    /// checkpointing every `eval_interval` steps and at the end. An interrupted run saves a
    /// checkpoint before returning.
    ///
    /// The run directory is claimed (see [`Trainer::claim_run_dir`]) for the duration of the
    /// call and released when it returns. A run without one writes nothing (no `run.toml`,
    /// metrics, loss curve or checkpoints: the [`Summary`] and the observer's events are its
    /// record), and a run whose data has no held-out batches does not evaluate.
    pub fn run(&mut self, observer: &mut dyn Observer, stop: &AtomicBool) -> Result<Summary> {
        self.check_world(self.dp.world_size())?;
        if self.writes {
            self.claim_run_dir()?;
        }
        let result = self.run_claimed(observer, stop);
        self.run_dir = None;
        result
    }

    fn run_claimed(&mut self, observer: &mut dyn Observer, stop: &AtomicBool) -> Result<Summary> {
        let out = self.config.out_dir.clone();
        let mut metrics = if self.dp.is_main() && self.writes {
            checkpoint::io::write_atomic(&out.join("run.toml"), self.config.to_toml().as_bytes())?;
            MetricsLog::open(&out.join("metrics.jsonl"), self.step)?
        } else {
            MetricsLog::in_memory()
        };
        let mut last_eval = None;
        let mut interrupted = false;
        if self.step == 0 {
            last_eval = self.eval_and_log(&mut metrics, observer, stop)?;
        }
        while self.step < self.config.max_iters {
            // Data-parallel ranks see a signal at different moments: they stop together.
            if self.dp.any(stop.load(Ordering::SeqCst))? {
                interrupted = true;
                break;
            }
            // A signal during a long step abandons it (its state put back): saved below.
            let Some(stats) = self.train_step_until(stop)? else {
                interrupted = true;
                break;
            };
            observer.on_event(Event::Step(&stats));
            metrics.push(Record::Step(stats))?;
            let at_end = self.step == self.config.max_iters;
            if self.step.is_multiple_of(self.config.eval_interval) || at_end {
                // A signal during the evaluation cuts it short (not logged); the checkpoint
                // is saved all the same.
                if let Some(eval) = self.eval_and_log(&mut metrics, observer, stop)? {
                    self.record_eval(&eval);
                    last_eval = Some(eval);
                }
                if self.writes {
                    let dir = self.save_checkpoint()?;
                    observer.on_event(Event::Checkpoint(&dir));
                }
                // Replicas must hold the same weights; a drift is a bug, reported, not ignored.
                self.dp.ensure_in_sync(&self.vars)?;
            }
        }
        let already_saved = self
            .last_checkpoint
            .as_ref()
            .is_some_and(|d| d.ends_with(format!("step-{:07}", self.step)));
        if !already_saved && self.writes {
            let dir = self.save_checkpoint()?;
            observer.on_event(Event::Checkpoint(&dir));
        }
        Ok(Summary {
            step: self.step,
            interrupted,
            last_eval,
            best_val_loss: self.best_val_loss,
            elapsed_secs: self.elapsed_secs,
            tokens_seen: self.tokens_seen,
            checkpoint: self.last_checkpoint.clone(),
        })
    }

    fn eval_and_log(
        &mut self,
        metrics: &mut MetricsLog,
        observer: &mut dyn Observer,
        stop: &AtomicBool,
    ) -> Result<Option<EvalStats>> {
        if !self.evaluates {
            return Ok(None);
        }
        // DPO's reference values computed before training serve the first evaluation too.
        self.prepare_reference()?;
        let Some(eval) = self.evaluate_until(stop)? else {
            return Ok(None);
        };
        observer.on_event(Event::Eval(&eval));
        metrics.push(Record::Eval(eval.clone()))?;
        if !self.dp.is_main() {
            return Ok(Some(eval));
        }
        if self.writes {
            self.plot(&metrics.records);
        }
        if self.config.sample_tokens > 0 {
            if let Some(text) = eval::sample_text(self, stop)? {
                observer.on_event(Event::Sample(&text));
            }
        }
        Ok(Some(eval))
    }

    /// Draws the loss curve (`loss.svg`) of the run's records so far.
    fn plot(&self, records: &[Record]) {
        let run_name = self
            .config
            .out_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let describe = self.data.describe();
        let source = describe.split(':').next().unwrap_or_default();
        let title = format!("{run_name}: {source}");
        if let Err(e) =
            crate::plot::loss_curve(&self.config.out_dir.join("loss.svg"), &title, records)
        {
            tracing::warn!("could not draw the loss curve: {e}");
        }
    }
}
