//! The run's metrics: one JSON object per line in `metrics.jsonl`, for steps and evaluations,
//! and the same as TensorBoard scalars in an event file beside it ([`crate::tensorboard`]).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::tensorboard::{self, RunEvents, Scalar};
use crate::{Error, Result};

/// What one optimiser step did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Steps completed after this one (1-based).
    pub step: usize,
    /// Mean training loss over the step's micro-batches.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping (NaN for a step skipped by the loss scaler; JSON
    /// stores it as `null`).
    #[serde(deserialize_with = "null_as_nan")]
    pub grad_norm: f32,
    /// Training tokens processed per second in this step.
    pub tokens_per_sec: f64,
    /// Wall time of the step in milliseconds.
    pub step_ms: f64,
    /// Tokens consumed since the start of the run.
    pub tokens_seen: u64,
    /// Model FLOPs utilisation of this step (see [`crate::mfu`]).
    #[serde(default)]
    pub mfu: f64,
    /// Loss scale used (mixed precision, or f32 with an explicit `loss_scale`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Whether the update was skipped because of an inf/NaN gradient (only a dynamic loss scale
    /// skips; otherwise such a step is an error).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// The objective's own metrics of the step, by name (DPO: TRL's `rewards/chosen`,
    /// `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
    /// `logps/rejected`: means over the step's pairs on this rank); none for cross-entropy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub objective: BTreeMap<String, f64>,
}

/// JSON has no NaN: serde_json writes it as `null`; read `null` back as NaN.
fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

/// What one evaluation measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalStats {
    /// Steps completed when evaluated.
    pub step: usize,
    /// Mean loss over `eval_iters` training batches.
    pub train_loss: f32,
    /// Mean loss over `eval_iters` validation batches.
    pub val_loss: f32,
    /// Task score (e.g. exact-match accuracy in [0, 1]) when the data has a task.
    pub score: Option<f32>,
    /// Name of the score.
    pub score_name: Option<String>,
    /// An objective other than cross-entropy, on `eval_iters` validation batches: its mean
    /// loss (`<objective>_loss`, e.g. `dpo_loss`) and its own metrics over their rows (DPO:
    /// TRL's `rewards/accuracies`, `rewards/margins`, ... of the held-out pairs). The losses
    /// above stay the cross-entropy over the counted targets (a preference pair's completions).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub objective: BTreeMap<String, f64>,
}

/// One line of `metrics.jsonl`, tagged by `"kind"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// A training step.
    Step(StepStats),
    /// An evaluation.
    Eval(EvalStats),
}

impl Record {
    /// The step the record belongs to.
    pub fn step(&self) -> usize {
        match self {
            Record::Step(s) => s.step,
            Record::Eval(e) => e.step,
        }
    }
}

/// The scalars a run logs for `record` at `wall_time`: a step as `train/loss`,
/// `train/learning_rate`, `train/grad_norm` (NaN for a step the loss scaler skipped),
/// `train/tokens_per_s`, `train/mfu`, with a loss scale `train/loss_scale`, and the
/// objective's own metrics as `train/<name>` (DPO: `train/rewards/chosen`, ...); an
/// evaluation as `eval/loss` (the validation loss), `eval/train_loss` and, with a task,
/// `eval/<score name>` with what TensorFlow refuses in a tag as `_` (e.g.
/// `eval/addition_accuracy`), and the objective's held-out values as `eval/<name>` (DPO:
/// `eval/dpo_loss`, `eval/rewards/accuracies`, ...). The step is the optimizer step.
pub fn scalars_of(record: &Record, wall_time: f64) -> Vec<Scalar> {
    let at = |tag: &str, value: f32| Scalar {
        tag: tag.to_string(),
        step: record.step() as i64,
        value,
        wall_time,
    };
    match record {
        Record::Step(s) => {
            let mut out = vec![
                at("train/loss", s.loss),
                at("train/learning_rate", s.lr as f32),
                at("train/grad_norm", s.grad_norm),
                at("train/tokens_per_s", s.tokens_per_sec as f32),
                at("train/mfu", s.mfu as f32),
            ];
            out.extend(s.loss_scale.map(|v| at("train/loss_scale", v as f32)));
            out.extend(
                s.objective
                    .iter()
                    .map(|(name, v)| at(&format!("train/{name}"), *v as f32)),
            );
            out
        }
        Record::Eval(e) => {
            let mut out = vec![
                at("eval/loss", e.val_loss),
                at("eval/train_loss", e.train_loss),
            ];
            if let (Some(score), Some(name)) = (e.score, &e.score_name) {
                // TensorFlow's tag rule: `[-/\w.]` kept, anything else `_`.
                let name: String = name
                    .chars()
                    .map(|c| match c.is_alphanumeric() || "-/_.".contains(c) {
                        true => c,
                        false => '_',
                    })
                    .collect();
                out.push(at(&format!("eval/{name}"), score));
            }
            out.extend(
                e.objective
                    .iter()
                    .map(|(name, v)| at(&format!("eval/{name}"), *v as f32)),
            );
            out
        }
    }
}

/// Appends records to `metrics.jsonl` (and as TensorBoard scalars to an event file beside it)
/// and keeps them for the loss curve.
pub(crate) struct MetricsLog {
    path: PathBuf,
    /// `None` for a log kept in memory only (data-parallel ranks other than 0).
    file: Option<File>,
    /// The TensorBoard event file beside `metrics.jsonl` (`None` in memory).
    events: Option<RunEvents>,
    /// Every record of the run so far (including those read back on resume).
    pub records: Vec<Record>,
}

impl MetricsLog {
    /// Opens `path` for a run that has completed `resume_step` steps: records after that step
    /// (written by a run killed after its last checkpoint) are dropped, so the file describes
    /// exactly the run that continues. The run's TensorBoard event file in the same directory
    /// is rewritten likewise ([`crate::tensorboard`]).
    pub fn open(path: &Path, resume_step: usize) -> Result<Self> {
        let mut records = Vec::new();
        if resume_step > 0 && path.exists() {
            let f = File::open(path).map_err(|e| Error::io(path, e))?;
            for line in BufReader::new(f).lines() {
                let line = line.map_err(|e| Error::io(path, e))?;
                match serde_json::from_str::<Record>(&line) {
                    Ok(r) if r.step() <= resume_step => records.push(r),
                    Ok(_) => {}
                    Err(e) => tracing::warn!("{}: skipping unreadable line: {e}", path.display()),
                }
            }
        }
        let mut text = String::new();
        for r in &records {
            text.push_str(&serde_json::to_string(r).unwrap_or_default());
            text.push('\n');
        }
        crate::checkpoint::io::write_atomic(path, text.as_bytes())?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let events = RunEvents::open(dir, resume_step)?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            file: Some(file),
            events: Some(events),
            records,
        })
    }

    /// A log that keeps records in memory and writes nothing (for ranks that do not own the
    /// run directory).
    pub fn in_memory() -> Self {
        MetricsLog {
            path: PathBuf::new(),
            file: None,
            events: None,
            records: Vec::new(),
        }
    }

    /// Appends a record (one line, flushed; and its TensorBoard scalars).
    pub fn push(&mut self, record: Record) -> Result<()> {
        if let Some(file) = &mut self.file {
            let line = serde_json::to_string(&record).unwrap_or_default();
            writeln!(file, "{line}").map_err(|e| Error::io(&self.path, e))?;
            file.flush().map_err(|e| Error::io(&self.path, e))?;
        }
        if let Some(events) = &mut self.events {
            events.push(&scalars_of(&record, tensorboard::now()))?;
        }
        self.records.push(record);
        Ok(())
    }
}

/// Reads every record of a metrics file.
pub fn read(path: &Path) -> Result<Vec<Record>> {
    let text = fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_steps_survive_a_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, 0).unwrap();
        for step in 1..=3 {
            log.push(Record::Step(StepStats {
                step,
                loss: 1.0,
                lr: 1e-3,
                grad_norm: if step == 2 { f32::NAN } else { 0.5 },
                tokens_per_sec: 1.0,
                step_ms: 1.0,
                tokens_seen: step as u64,
                mfu: 0.1,
                loss_scale: Some(65536.0),
                skipped: step == 2,
                objective: BTreeMap::new(),
            }))
            .unwrap();
        }
        drop(log);
        let log = MetricsLog::open(&path, 3).unwrap();
        assert_eq!(log.records.len(), 3);
        match &log.records[1] {
            Record::Step(s) => assert!(s.skipped && s.grad_norm.is_nan()),
            other => panic!("{other:?}"),
        }
        assert_eq!(read(&path).unwrap().len(), 3);
    }
}
