//! The sections of the run config that other parts take as their own settings: the
//! optimiser's, the learning-rate schedule's, the objective's and the 4-bit base's.

use super::{BaseQuant, TrainConfig};
use crate::lora::Nf4Settings;
use crate::objective::ObjectiveConfig;
use crate::optim::AdamWConfig;
use crate::schedule::LrSchedule;

impl TrainConfig {
    /// The optimiser's hyper-parameters.
    pub(crate) fn adamw_config(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: 1e-8,
            weight_decay: self.weight_decay,
        }
    }

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

impl From<&TrainConfig> for ObjectiveConfig {
    /// The run's `objective` and its `dpo_*` options.
    fn from(config: &TrainConfig) -> Self {
        ObjectiveConfig {
            name: config.objective.clone(),
            dpo_loss: config.dpo_loss.clone(),
            dpo_beta: config.dpo_beta,
            dpo_label_smoothing: config.dpo_label_smoothing,
        }
    }
}
