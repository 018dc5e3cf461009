//! Evaluating a model directory: the losses (and task score) a training run's evaluation
//! reports, on the run's data or on data given by flags.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::ModelDir;
use crate::config::DeviceSpec;
use crate::data::{DataKind, DataSource, Split, Task};
use crate::load::{Checks, DataCheck, FingerprintCheck};
use crate::metrics::EvalStats;
use crate::model::{Ctx, Kernels, Model};
use crate::sample::greedy_batch;
use crate::Result;

#[cfg(feature = "cli")]
const HEADING: &str =
    "Evaluation data and batches (default: the run's; a bare model needs --data-path)";

/// What to evaluate a model on: the `trainer eval` flags.
///
/// A trainer checkpoint is evaluated as its run evaluates itself (its data, block size, batch
/// size, seed); each given flag replaces the run's value. A bare Hugging Face model has no run
/// config: the data must be given (`--data-path`), tokenised by the model's own
/// `tokenizer.json` unless `--data` / `--tokenizer-path` say otherwise.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct EvalRequest {
    /// Data kind: tokenizer, char, byte, addition, sft, chat-task or shards [default: the
    /// run's, else tokenizer].
    #[cfg_attr(feature = "cli", arg(long, value_name = "KIND", help_heading = HEADING))]
    pub data: Option<DataKind>,
    /// Text file to measure the loss on (its first 1 - val_fraction is the train split, the
    /// rest the val split); the JSONL records for `sft`; the directory of token shards
    /// (`trainer prepare`) for `shards`. Required for a bare model (unless --data addition or
    /// chat-task).
    #[cfg_attr(feature = "cli", arg(long, value_name = "FILE", help_heading = HEADING))]
    pub data_path: Option<PathBuf>,
    /// tokenizer.json for `tokenizer` data [default: the run's, else the model directory's
    /// own tokenizer.json].
    #[cfg_attr(feature = "cli", arg(long, value_name = "FILE", help_heading = HEADING))]
    pub tokenizer_path: Option<PathBuf>,
    /// Fraction of the text held out as the val split [default: the run's, else 0.1].
    #[cfg_attr(feature = "cli", arg(long, value_name = "F", help_heading = HEADING))]
    pub val_fraction: Option<f32>,
    /// Where tokenised corpora are cached [default: the run's, else ~/.cache/candle-train].
    #[cfg_attr(feature = "cli", arg(long, value_name = "DIR", help_heading = HEADING))]
    pub cache_dir: Option<PathBuf>,
    /// Context length of the evaluation batches, at most the model's positions [default:
    /// the run's block_size, else min(n_positions, 256)].
    #[cfg_attr(feature = "cli", arg(long, value_name = "N", help_heading = HEADING))]
    pub block_size: Option<usize>,
    /// Sequences per batch [default: the run's batch_size, else 8].
    #[cfg_attr(feature = "cli", arg(long, value_name = "N", help_heading = HEADING))]
    pub batch_size: Option<usize>,
    /// Batches averaged per loss [default: the run's eval_iters, else 10].
    #[cfg_attr(feature = "cli", arg(long, value_name = "N", help_heading = HEADING))]
    pub eval_iters: Option<usize>,
    /// Held-out problems scored, for tasks with a score [default: the run's, else 500].
    #[cfg_attr(feature = "cli", arg(long, value_name = "N", help_heading = HEADING))]
    pub eval_problems: Option<usize>,
    /// Device (cpu, cuda, cuda:N, metal) [default: the run's, else cpu].
    #[cfg_attr(feature = "cli", arg(long))]
    pub device: Option<DeviceSpec>,
}

impl EvalRequest {
    /// Whether any data flag was given.
    pub(crate) fn has_data(&self) -> bool {
        self.data.is_some() || self.data_path.is_some() || self.tokenizer_path.is_some()
    }

    /// Loads `model`, opens the evaluation data and measures the losses (and the task score).
    ///
    /// The loader ([`crate::load`]) makes resume's checks of a trainer checkpoint: config.json
    /// against the run's state; the ids must mean what they meant in training (a rebuilt
    /// character vocabulary would shift them); and the run's own corpus must be the one it
    /// trained on, unless other data was asked for (evaluating on other text).
    pub fn evaluate(&self, model: &ModelDir) -> Result<EvalStats> {
        let cfg = self.config(model, model.config()?.as_ref())?;
        let device = cfg.device.open()?;
        let data = cfg.open_data()?;
        let fingerprint = match self.has_data() {
            true => FingerprintCheck::Vocabulary,
            false => FingerprintCheck::Corpus,
        };
        let checks = Checks {
            data: Some(DataCheck {
                source: data.as_ref(),
                fingerprint,
            }),
            ..Checks::default()
        };
        let loaded = model.load_with(&checks, &device)?.build()?;
        let step = model.run.as_ref().map_or(0, |s| s.step);
        evaluate(
            loaded.as_ref(),
            data.as_ref(),
            &(&cfg).into(),
            step,
            &device,
        )
    }
}

/// What an evaluation reads of the run config (`From<&TrainConfig>`): its batches
/// (`eval_iters` of `batch_size` x `block_size`, drawn by a generator seeded from `seed`),
/// its kernels and its task problems.
#[derive(Clone, Debug)]
pub(crate) struct EvalSettings {
    /// Batches averaged per loss.
    pub(crate) eval_iters: usize,
    /// Rows of a batch.
    pub(crate) batch_size: usize,
    /// Tokens of a row.
    pub(crate) block_size: usize,
    /// Fused or reference kernels.
    pub(crate) kernels: Kernels,
    /// Seeds the batches' generator (xor a constant).
    pub(crate) seed: u64,
    /// Held-out task problems scored; 0 for none.
    pub(crate) eval_problems: usize,
}

/// Mean loss of `model` over `config.eval_iters` batches of `split` (`config.batch_size` rows
/// of `config.block_size` tokens) drawn from `rng`, without dropout.
pub(crate) fn mean_loss(
    model: &dyn Model,
    data: &dyn DataSource,
    split: Split,
    config: &EvalSettings,
    rng: &mut ChaCha8Rng,
    device: &Device,
) -> Result<f32> {
    let never = AtomicBool::new(false);
    let loss = mean_loss_until(model, data, split, config, rng, device, &never)?;
    Ok(loss.unwrap_or(f32::NAN))
}

/// [`mean_loss`], given up between batches once `stop` is set (a signal): `None`.
pub(crate) fn mean_loss_until(
    model: &dyn Model,
    data: &dyn DataSource,
    split: Split,
    config: &EvalSettings,
    rng: &mut ChaCha8Rng,
    device: &Device,
    stop: &AtomicBool,
) -> Result<Option<f32>> {
    let mut total = 0f64;
    for _ in 0..config.eval_iters {
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let batch = data.batch(split, config.batch_size, config.block_size, rng, device)?;
        let ctx = Ctx::eval()
            .with_kernels(config.kernels)
            .with_rows(batch.rows.clone());
        let loss = model.loss(&batch.x, &batch.targets()?, &ctx)?;
        total += loss.mean.to_scalar::<f32>()? as f64;
    }
    Ok(Some((total / config.eval_iters.max(1) as f64) as f32))
}

/// Train and val loss (and the task score, if the data has a task) of `model`, from the same
/// batches a run with `config` evaluates on (a generator seeded by the run seed), reported as
/// step `step`.
pub(crate) fn evaluate(
    model: &dyn Model,
    data: &dyn DataSource,
    config: &EvalSettings,
    step: usize,
    device: &Device,
) -> Result<EvalStats> {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0xE7A1);
    let train_loss = mean_loss(model, data, Split::Train, config, &mut rng, device)?;
    let val_loss = mean_loss(model, data, Split::Val, config, &mut rng, device)?;
    let (score, score_name) = match data.task() {
        Some(task) if config.eval_problems > 0 => (
            Some(task_score(model, task, config.eval_problems, device)?),
            Some(task.name().to_string()),
        ),
        _ => (None, None),
    };
    Ok(EvalStats {
        step,
        train_loss,
        val_loss,
        score,
        score_name,
        objective: Default::default(),
    })
}

/// Exact-match score of greedy decoding on `n` held-out problems of `task`, in [0, 1].
pub(crate) fn task_score(
    model: &dyn Model,
    task: &dyn Task,
    n: usize,
    device: &candle_core::Device,
) -> Result<f32> {
    let never = AtomicBool::new(false);
    Ok(task_score_until(model, task, n, device, &never)?.unwrap_or(f32::NAN))
}

/// [`task_score`], given up between batches of problems once `stop` is set (a signal): `None`.
pub(crate) fn task_score_until(
    model: &dyn Model,
    task: &dyn Task,
    n: usize,
    device: &candle_core::Device,
    stop: &AtomicBool,
) -> Result<Option<f32>> {
    let problems = task.eval_problems(n);
    if problems.is_empty() {
        return Ok(Some(0.0));
    }
    let mut correct = 0usize;
    for chunk in problems.chunks(256) {
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let prompts: Vec<Vec<u32>> = chunk.iter().map(|(p, _)| p.clone()).collect();
        let answer_len = chunk[0].1.len();
        let out = greedy_batch(model, &prompts, answer_len, device)?;
        correct += out
            .iter()
            .zip(chunk)
            .filter(|(got, (_, want))| got == &want)
            .count();
    }
    Ok(Some(correct as f32 / problems.len() as f32))
}
