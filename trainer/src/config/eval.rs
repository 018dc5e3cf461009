//! The run config of an evaluation (`trainer eval`): the run's own, or a bare model's
//! defaults, with the request's flags applied.

use std::path::PathBuf;

use super::TrainConfig;
use crate::checkpoint::TrainerState;
use crate::data::DataKind;
use crate::model::ModelConfig;
use crate::pretrained::{EvalRequest, ModelDir, TOKENIZER_FILE};
use crate::{Error, Result};

/// Context length of a bare model's evaluation batches, unless the model has fewer positions.
const BARE_BLOCK_SIZE: usize = 256;
/// Sequences per batch when evaluating a bare model.
const BARE_BATCH_SIZE: usize = 8;
/// Batches averaged per loss when evaluating a bare model.
const BARE_EVAL_ITERS: usize = 10;

impl EvalRequest {
    /// The evaluation settings for `model` (whose config is `model_config`), as a run config:
    /// the run's (or a bare model's defaults) with the given flags applied.
    pub fn config(&self, model: &ModelDir, model_config: &dyn ModelConfig) -> Result<TrainConfig> {
        let n_positions = model_config.max_positions();
        let mut cfg = match TrainerState::of(model)?.map(|s| s.config) {
            Some(run) => run,
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
}
