//! Evaluating a model directory: the losses (and task score) a training run's evaluation
//! reports, on the run's data or on data given by flags.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{ModelDir, TOKENIZER_FILE};
use crate::config::DeviceSpec;
use crate::config::TrainConfig;
use crate::data::{DataKind, DataSource, Split, Task};
use crate::load::{Checks, DataCheck, FingerprintCheck};
use crate::metrics::EvalStats;
use crate::model::{Ctx, Model, ModelConfig};
use crate::sample::greedy_batch;
use crate::{Error, Result};

/// Context length of a bare model's evaluation batches, unless the model has fewer positions.
pub const BARE_BLOCK_SIZE: usize = 256;
/// Sequences per batch when evaluating a bare model.
pub const BARE_BATCH_SIZE: usize = 8;
/// Batches averaged per loss when evaluating a bare model.
pub const BARE_EVAL_ITERS: usize = 10;

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
    fn has_data(&self) -> bool {
        self.data.is_some() || self.data_path.is_some() || self.tokenizer_path.is_some()
    }

    /// The evaluation settings for `model` (whose config is `model_config`), as a run config:
    /// the run's (or a bare model's defaults) with the given flags applied.
    pub fn config(&self, model: &ModelDir, model_config: &dyn ModelConfig) -> Result<TrainConfig> {
        let n_positions = model_config.max_positions();
        let mut cfg = match model.run_config() {
            Some(run) => run.clone(),
            None => {
                if !self.has_data() {
                    return Err(Error::Config(format!(
                        "{} is a bare model (no trainer_state.json), so there is no run config \
                         to take the evaluation data from: give a text file with --data-path \
                         FILE (tokenised with the model's tokenizer.json; see --data and \
                         --tokenizer-path)",
                        model.dir.display()
                    )));
                }
                TrainConfig {
                    data: DataKind::Tokenizer,
                    block_size: n_positions.min(BARE_BLOCK_SIZE),
                    batch_size: BARE_BATCH_SIZE,
                    eval_iters: BARE_EVAL_ITERS,
                    ..TrainConfig::default()
                }
            }
        };
        let set = |field: &mut Option<PathBuf>, value: &Option<PathBuf>| {
            if value.is_some() {
                field.clone_from(value);
            }
        };
        if let Some(d) = &self.data {
            cfg.data = *d;
        }
        set(&mut cfg.data_path, &self.data_path);
        set(&mut cfg.tokenizer_path, &self.tokenizer_path);
        set(&mut cfg.cache_dir, &self.cache_dir);
        cfg.val_fraction = self.val_fraction.unwrap_or(cfg.val_fraction);
        cfg.block_size = self.block_size.unwrap_or(cfg.block_size);
        cfg.batch_size = self.batch_size.unwrap_or(cfg.batch_size);
        cfg.eval_iters = self.eval_iters.unwrap_or(cfg.eval_iters);
        cfg.eval_problems = self.eval_problems.unwrap_or(cfg.eval_problems);
        if let Some(d) = &self.device {
            cfg.device = *d;
        }
        if cfg.data.uses_tokenizer() && cfg.tokenizer_path.is_none() {
            let own = model.dir.join(TOKENIZER_FILE);
            if !own.is_file() {
                return Err(Error::Config(format!(
                    "`{}` data needs --tokenizer-path: there is no {}",
                    cfg.data,
                    own.display()
                )));
            }
            cfg.tokenizer_path = Some(own);
        }
        if cfg.data.uses_path() && cfg.data_path.is_none() {
            return Err(Error::Config(format!(
                "`{}` data needs --data-path FILE",
                cfg.data
            )));
        }
        if cfg.block_size > n_positions {
            return Err(Error::Config(format!(
                "block_size {} exceeds the {n_positions} positions of the model in {}",
                cfg.block_size,
                model.dir.display()
            )));
        }
        cfg.validate()?;
        Ok(cfg)
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
        evaluate(loaded.as_ref(), data.as_ref(), &cfg, step, &device)
    }
}

/// Mean loss of `model` over `config.eval_iters` batches of `split` (`config.batch_size` rows
/// of `config.block_size` tokens) drawn from `rng`, without dropout.
pub fn mean_loss(
    model: &dyn Model,
    data: &dyn DataSource,
    split: Split,
    config: &TrainConfig,
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
    config: &TrainConfig,
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
pub fn evaluate(
    model: &dyn Model,
    data: &dyn DataSource,
    config: &TrainConfig,
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
    })
}

/// Exact-match score of greedy decoding on `n` held-out problems of `task`, in [0, 1].
pub fn task_score(
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
