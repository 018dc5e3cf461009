//! [`Amp`]: master weights + loss scaler + the overflow-checked optimiser step.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::check::{self, GradCheck};
use crate::error::{AmpError, Result};
use crate::master::{MasterWeights, WeightMode};
use crate::outcome::{SkipReason, StepOutcome};
use crate::scaler::{CollapsePolicy, LossScaler, ScaleChange, ScalerConfig};
use crate::state::ScalerState;
use crate::update::ScaledUpdate;

/// Metadata key under which [`Amp::save_state`] records the configuration.
const CONFIG_KEY: &str = "amp.config";

/// Mixed-precision training driver (PyTorch's `GradScaler`, plus the f32 master weights):
/// owns the [`MasterWeights`] and the loss scaler, scales the loss, and runs the
/// overflow-checked optimiser step, returning a [`StepOutcome`] every step.
///
/// With [`ScalerConfig::none`] in f32 it is a no-op scaler (PyTorch's
/// `GradScaler(enabled=False)`) that still clips and still refuses non-finite gradients, so
/// one training step serves every precision.
///
/// ```
/// use candle_amp::{Amp, MasterWeights, Plain, ScalerConfig, WeightMode};
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_nn::Optimizer as _;
/// let w = Var::from_tensor(&Tensor::new(&[1f32, -2.0], &Device::Cpu)?)?;
/// let weights = MasterWeights::new([("w".into(), w.clone())], DType::F16, WeightMode::Cast)?;
/// // The default initial scale 2^16 would overflow this f16 loss's own gradient (1 * scale
/// // > 65504) and skip the first step; start lower.
/// let cfg = ScalerConfig::dynamic().init_scale(1024.0);
/// let mut amp = Amp::new(weights, cfg)?.with_clip_norm(Some(1.0))?;
/// let mut opt = candle_nn::SGD::new(amp.weights().master_vars(), 0.1)?;
/// let loss = w.as_tensor().to_dtype(DType::F16)?.sqr()?.sum_all()?; // forward in f16
/// let grads = amp.backward(&loss)?; // loss upcast to f32, multiplied by the scale
/// let outcome = amp.step(&grads, &mut Plain(&mut opt))?;
/// assert!(outcome.is_applied());
/// # Ok::<(), candle_amp::AmpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Amp {
    weights: MasterWeights,
    /// The master variables, in registration order (what the update steps).
    masters: Vec<Var>,
    scaler: LossScaler,
    clip_norm: Option<f64>,
}

impl Amp {
    /// Creates the driver; fails if the scaler configuration is invalid.
    pub fn new(weights: MasterWeights, config: ScalerConfig) -> Result<Self> {
        Ok(Self {
            masters: weights.master_vars(),
            weights,
            scaler: LossScaler::new(config)?,
            clip_norm: None,
        })
    }

    /// Enables (`Some(max_norm)`) or disables global-norm clipping of the unscaled gradients
    /// (PyTorch's `clip_grad_norm_`: multiply by `min(1, max_norm / (norm + 1e-6))`).
    pub fn with_clip_norm(mut self, max_norm: Option<f64>) -> Result<Self> {
        if let Some(m) = max_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(AmpError::Config(format!("clip norm must be > 0, got {m}")));
            }
        }
        self.clip_norm = max_norm;
        Ok(self)
    }

    /// The registered weights (their f32 masters build the optimiser; in
    /// [`WeightMode::Copies`] their compute copies build the model).
    pub fn weights(&self) -> &MasterWeights {
        &self.weights
    }

    /// The current loss scale.
    pub fn scale(&self) -> f64 {
        self.scaler.scale()
    }

    /// The scaler state (scale, trackers, applied/skipped counters).
    pub fn state(&self) -> &ScalerState {
        self.scaler.state()
    }

    /// Restores a saved scaler state (e.g. one read with [`ScalerState::from_tensors`]).
    pub fn set_state(&mut self, state: ScalerState) -> Result<()> {
        self.scaler.set_state(state)
    }

    /// Saves the scaler state to a safetensors file (see [`ScalerState::save`]), with the
    /// scaler configuration and clipping threshold as informational metadata
    /// (`amp.config`).
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let extra = HashMap::from([(CONFIG_KEY.to_string(), self.config_string())]);
        self.scaler.state().save_with_metadata(path, extra)
    }

    /// Loads the scaler state from a safetensors file (see [`ScalerState::load`]). The state
    /// resumes bit-exactly under the same configuration; if the file records a different
    /// configuration, a `tracing` warning is emitted (the current configuration is kept).
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let state = ScalerState::load(path)?;
        if let Some(saved) = ScalerState::read_file_metadata(path)?.get(CONFIG_KEY) {
            let current = self.config_string();
            if *saved != current {
                tracing::warn!(%saved, %current, "resuming amp state under a different configuration");
            }
        }
        self.scaler.set_state(state)
    }

    fn config_string(&self) -> String {
        format!("{:?}; clip_norm={:?}", self.scaler.config(), self.clip_norm)
    }

    /// The loss upcast to f32 and multiplied by the current scale.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.to_dtype(DType::F32)?.affine(self.scale(), 0.0)?)
    }

    /// `scale_loss(loss)?.backward()`.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        Ok(self.scale_loss(loss)?.backward()?)
    }

    /// The overflow-checked optimiser step: asks `update` for the global norm of the scaled
    /// gradients (one reduction); if it is finite, calls `update.apply(grads, masters, coef)`
    /// once, with `coef` folding unscaling and clipping, so no unscaled or clipped copy of
    /// the gradients is made; otherwise scans the gradients to name the non-finite
    /// parameters, skips the update and backs the scale off. A non-finite norm of finite
    /// gradients (squares past the f32 range) is recomputed exactly and the step applied.
    ///
    /// `grads` must come from the backward of [`scale_loss`](Self::scale_loss) at the
    /// current scale. The update steps the f32 master variables, in registration order; it
    /// receives the gradients keyed by them (in [`WeightMode::Copies`], the compute copies'
    /// gradients upcast to f32). Use [`Plain`](crate::Plain) for any `candle_nn::Optimizer`.
    ///
    /// A caller that wants to retry a skipped step calls `backward` again (at the new scale)
    /// and `step` again: Candle keeps the graph alive while the loss lives.
    ///
    /// Errors: [`AmpError::Update`] if the update fails (the step is then not counted), and
    /// [`AmpError::ScaleCollapse`] if the scale cannot back off any further and the policy is
    /// [`CollapsePolicy::Error`].
    pub fn step<U: ScaledUpdate + ?Sized>(
        &mut self,
        grads: &GradStore,
        update: &mut U,
    ) -> Result<StepOutcome> {
        let step = self.scaler.state().steps;
        let scale = self.scale();
        let rekeyed;
        let master_grads = match self.weights.mode() {
            WeightMode::Cast => grads,
            WeightMode::Copies => {
                rekeyed = self.weights.master_grads(grads)?;
                &rekeyed
            }
        };
        let scaled_norm = update
            .grad_norm(master_grads, &self.masters)
            .map_err(AmpError::update)?;
        let grad_norm = if scaled_norm.is_finite() {
            scaled_norm / scale
        } else {
            let check = check::scan(&self.weights, grads, scale)?;
            if !check.finite {
                return self.skip(step, check);
            }
            // Every gradient is finite, only the f32 sum of squares overflowed: the scan's
            // norm is computed scaled down, so it is finite.
            check.sq_norm.sqrt()
        };
        let clip_coef = self.clip_coefficient(grad_norm);
        update
            .apply(master_grads, &self.masters, clip_coef / scale)
            .map_err(AmpError::update)?;
        self.weights.refresh()?;
        let upd = self.scaler.on_clean();
        self.scaler.finish_step(true);
        tracing::trace!(step, grad_norm, scale, "amp step applied");
        Ok(StepOutcome::Applied {
            step,
            grad_norm,
            clip_coef,
            scale,
            next_scale: upd.after,
            change: upd.change,
        })
    }

    fn clip_coefficient(&self, grad_norm: f64) -> f64 {
        match self.clip_norm {
            Some(max) => (max / (grad_norm + 1e-6)).min(1.0),
            None => 1.0,
        }
    }

    fn skip(&mut self, step: u64, check: GradCheck) -> Result<StepOutcome> {
        let upd = self.scaler.on_overflow();
        self.scaler.finish_step(false);
        let names: Vec<String> = check.nonfinite.iter().map(|n| n.name.clone()).collect();
        let reason = if upd.change == ScaleChange::Collapsed {
            match self.scaler.config().collapse {
                CollapsePolicy::Error => {
                    let st = self.scaler.state();
                    let diagnosis = check::diagnose(
                        &check,
                        self.weights.len(),
                        self.scaler.config().min_scale,
                        st.consecutive_skips,
                    );
                    tracing::error!(step, %diagnosis, "loss scale collapsed");
                    return Err(AmpError::ScaleCollapse {
                        step,
                        scale: upd.before,
                        min_scale: self.scaler.config().min_scale,
                        consecutive_skips: st.consecutive_skips,
                        nonfinite_params: names,
                        diagnosis,
                    });
                }
                CollapsePolicy::Continue => SkipReason::ScaleCollapsed,
            }
        } else {
            SkipReason::NonFiniteGradients
        };
        // Reported in the returned outcome; the caller decides how loudly.
        tracing::debug!(
            step,
            ?reason,
            scale_before = upd.before,
            scale_after = upd.after,
            params = ?names,
            "amp step skipped"
        );
        Ok(StepOutcome::Skipped {
            step,
            reason,
            scale_before: upd.before,
            scale_after: upd.after,
            change: upd.change,
            nonfinite_params: names,
        })
    }
}
