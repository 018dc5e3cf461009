//! The sections of the run config that other parts take as their own settings: the
//! learning-rate schedule's, the 4-bit base's, the executor's, the memory estimate's and the
//! evaluation's. (The optimiser and the objective read their own options: `optim::build`,
//! `objective::build`.)

use super::{BaseQuant, TrainConfig};
use crate::lora::Nf4Settings;
use crate::pretrained::EvalSettings;
use crate::schedule::LrSchedule;
use crate::train::memory::MemorySettings;
use crate::train::pipeline::ExecutorSettings;

impl TrainConfig {
    /// The learning-rate schedule.
    pub(crate) fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_iters: self.warmup_iters,
            decay_iters: self.lr_decay_iters.unwrap_or(self.max_iters),
        }
    }

    /// The settings of a run's `--base-quant nf4` (`--base-quant-double`,
    /// `--base-quant-skip`), if it asks for a 4-bit base.
    pub fn nf4_settings(&self) -> Option<Nf4Settings> {
        (self.base_quant == BaseQuant::Nf4).then(|| Nf4Settings {
            double: self.base_quant_double,
            skip: self.base_quant_skip.0.clone(),
        })
    }
}

impl From<&TrainConfig> for ExecutorSettings {
    /// The run's precision, remat policy, batch and block sizes, kernels and parallelism.
    fn from(config: &TrainConfig) -> Self {
        ExecutorSettings {
            dtype: config.dtype.dtype(),
            remat: config.remat,
            batch_size: config.batch_size,
            block_size: config.block_size,
            kernels: config.kernels,
            chunked_loss: config.chunked_loss,
            parallelism: config.parallelism(),
            device: config.device,
        }
    }
}

impl From<&TrainConfig> for MemorySettings {
    /// The executor's settings, the run's adapters and its optimiser.
    fn from(config: &TrainConfig) -> Self {
        MemorySettings {
            run: config.into(),
            lora_r: config.lora_r,
            lora_targets: config.lora_targets.clone(),
            optimizer_state_bytes: crate::optim::state_bytes_per_param(config),
            nf4: config.nf4_settings(),
        }
    }
}

impl From<&TrainConfig> for EvalSettings {
    /// The run's evaluation batches (`eval_iters` of `batch_size` x `block_size`, seeded by
    /// `seed`), kernels and task problems.
    fn from(config: &TrainConfig) -> Self {
        EvalSettings {
            eval_iters: config.eval_iters,
            batch_size: config.batch_size,
            block_size: config.block_size,
            kernels: config.kernels,
            seed: config.seed,
            eval_problems: config.eval_problems,
        }
    }
}
