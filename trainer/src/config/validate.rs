//! Checks of a run config's values that need neither the data nor a checkpoint.

use super::{Arch, TrainConfig, MAX_GRAD_ACCUM, MAX_SAMPLE_TOKENS};
use crate::{Error, Result};

impl TrainConfig {
    /// Checks every value that can be checked without the data or a checkpoint.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        self.check_sizes()?;
        self.check_model()?;
        // The data settings, as `data` checks them.
        self.data_spec().validate()?;
        self.check_training()?;
        if self.eval_interval == 0 || self.eval_iters == 0 {
            return bad("eval_interval and eval_iters must be at least 1".into());
        }
        self.check_parallelism()?;
        Ok(())
    }

    /// Sizes that something is built or run per unit of (layers, sampled tokens), bounded
    /// before anything is.
    fn check_sizes(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.n_layer > crate::model::MAX_LAYERS {
            return bad(format!(
                "n_layer is {}: more than the {} layers this trainer builds",
                self.n_layer,
                crate::model::MAX_LAYERS
            ));
        }
        if self.sample_tokens > MAX_SAMPLE_TOKENS {
            return bad(format!(
                "sample_tokens is {}: at most {MAX_SAMPLE_TOKENS} tokens are sampled at an \
                 evaluation",
                self.sample_tokens
            ));
        }
        Ok(())
    }

    /// The fresh model's shape, the objective and its options, and the head's tying.
    fn check_model(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.model_json.is_none() {
            self.model_config(1)?.validate()?;
        }
        crate::objective::build(self)?;
        if self.arch == Arch::Gpt2 && !self.tie_embeddings {
            return bad(
                "tie_embeddings = false needs a Llama-family arch (GPT-2's head always reads \
                 the token embedding)"
                    .into(),
            );
        }
        Ok(())
    }

    /// How the run trains: finite floats, batches and accumulation within their bounds, an
    /// output directory, the learning rates, the optimiser and its options, clipping and the
    /// peak FLOP/s.
    fn check_training(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        let floats = [
            ("lr", self.lr),
            ("min_lr", self.min_lr),
            ("grad_clip", f64::from(self.grad_clip)),
            ("dropout", f64::from(self.dropout)),
            ("peak_flops", self.peak_flops),
        ];
        if let Some((name, v)) = floats.iter().find(|(_, v)| !v.is_finite()) {
            return bad(format!("{name} must be a finite number, got {v}"));
        }
        if self.batch_size == 0 || self.grad_accum == 0 {
            return bad("batch_size and grad_accum must be at least 1".into());
        }
        if self.grad_accum > MAX_GRAD_ACCUM {
            return bad(format!(
                "grad_accum is {}: at most {MAX_GRAD_ACCUM} micro-batches make one step",
                self.grad_accum
            ));
        }
        if self.out_dir.as_os_str().is_empty() {
            return bad("out_dir must name a directory (it is empty)".into());
        }
        crate::io::check_dir_path(&self.out_dir)
            .map_err(|e| Error::Config(format!("out_dir: {e}")))?;
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("lr must be positive, got {}", self.lr));
        }
        if !(self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad(format!(
                "min_lr ({}) must be in [0, lr = {}] (the cosine schedule decays lr to min_lr; \
                 with a small --lr give --min-lr too, e.g. lr / 10)",
                self.min_lr, self.lr
            ));
        }
        if self.grad_clip < 0.0 {
            return bad("grad_clip must be >= 0".into());
        }
        // The optimiser checks its own options (over no parameters).
        crate::optim::build(self, &crate::model::Params::default())?;
        if !(self.peak_flops >= 0.0 && self.peak_flops.is_finite()) {
            return bad(format!(
                "peak_flops must be a finite number >= 0, got {}",
                self.peak_flops
            ));
        }
        Ok(())
    }

    /// ZeRO and the pipeline: stages, microbatches, their devices and schedule.
    fn check_parallelism(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.zero > 1 {
            return bad(format!("zero must be 0 or 1 (ZeRO-1), got {}", self.zero));
        }
        if self.pipeline_stages == 0 || self.microbatches == 0 {
            return bad("pipeline_stages and microbatches must be at least 1".into());
        }
        if self.pipeline_stages > 1 {
            self.schedule
                .build(self.pipeline_stages, self.microbatches)?;
            let devices = self.pipeline_devices.0.len();
            if devices != 0 && devices != self.pipeline_stages {
                return bad(format!(
                    "pipeline_devices names {devices} device(s) for {} pipeline stages",
                    self.pipeline_stages
                ));
            }
            if self.batch_size < self.microbatches {
                return bad(format!(
                    "batch_size ({}) must be at least microbatches ({})",
                    self.batch_size, self.microbatches
                ));
            }
        }
        Ok(())
    }
}
