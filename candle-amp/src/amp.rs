//! [`Amp`]: master weights + loss scaler + the overflow-checked optimiser step.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;

use crate::check::{self, GradCheck};
use crate::error::{AmpError, Result};
use crate::master::MasterWeights;
use crate::outcome::{SkipReason, StepOutcome};
use crate::scaler::{CollapsePolicy, LossScaler, ScaleChange, ScaleUpdate, ScalerConfig};
use crate::state::ScalerState;

/// Metadata key under which [`Amp::save_state`] records the configuration.
const CONFIG_KEY: &str = "amp.config";

/// Mixed-precision training driver: owns the [`MasterWeights`] and a [`LossScaler`], scales
/// the loss, checks and unscales gradients, optionally clips them, and steps any optimiser
/// over the f32 masters, returning a [`StepOutcome`] every step.
///
/// ```
/// use candle_amp::{Amp, MasterWeights, ScalerConfig, WeightMode};
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_nn::Optimizer;
/// let dev = Device::Cpu;
/// let w = Var::from_tensor(&Tensor::new(&[1f32, -2.0], &dev)?)?;
/// let weights = MasterWeights::new([("w".into(), w.clone())], DType::F16, WeightMode::Cast)?;
/// // The default initial scale 2^16 would overflow this f16 loss's own gradient (1 * scale
/// // > 65504) and skip the first step; start lower.
/// let cfg = ScalerConfig::dynamic().init_scale(1024.0);
/// let mut amp = Amp::new(weights, cfg)?.with_clip_norm(Some(1.0))?;
/// let mut opt = candle_nn::SGD::new(amp.master_vars(), 0.1)?;
/// let loss = w.as_tensor().to_dtype(DType::F16)?.sqr()?.sum_all()?; // forward in f16
/// let grads = amp.backward(&loss)?; // loss upcast to f32, multiplied by the scale
/// let outcome = amp.step(&mut opt, &grads)?;
/// assert!(outcome.is_applied());
/// # Ok::<(), candle_amp::AmpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Amp {
    weights: MasterWeights,
    scaler: LossScaler,
    clip_norm: Option<f64>,
    last_check: Duration,
}

impl Amp {
    /// Creates the driver; fails if the scaler configuration is invalid.
    pub fn new(weights: MasterWeights, config: ScalerConfig) -> Result<Self> {
        Ok(Self {
            weights,
            scaler: LossScaler::new(config)?,
            clip_norm: None,
            last_check: Duration::ZERO,
        })
    }

    /// Enables (`Some(max_norm)`) or disables global-norm clipping of the unscaled gradients
    /// (PyTorch's `clip_grad_norm_`: multiply by `min(1, max_norm / (norm + 1e-6))`).
    pub fn with_clip_norm(mut self, max_norm: Option<f64>) -> Result<Self> {
        self.set_clip_norm(max_norm)?;
        Ok(self)
    }

    /// Changes the clipping threshold (`None` disables clipping).
    pub fn set_clip_norm(&mut self, max_norm: Option<f64>) -> Result<()> {
        if let Some(m) = max_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(AmpError::Config(format!("clip norm must be > 0, got {m}")));
            }
        }
        self.clip_norm = max_norm;
        Ok(())
    }

    /// The clipping threshold, if clipping is enabled.
    pub fn clip_norm(&self) -> Option<f64> {
        self.clip_norm
    }

    /// The registered weights.
    pub fn weights(&self) -> &MasterWeights {
        &self.weights
    }

    /// Clones of the f32 master variables, to build the optimiser with.
    pub fn master_vars(&self) -> Vec<Var> {
        self.weights.master_vars()
    }

    /// The loss scaler.
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The current loss scale.
    pub fn scale(&self) -> f64 {
        self.scaler.scale()
    }

    /// The scaler state (scale, trackers, applied/skipped counters).
    pub fn state(&self) -> &ScalerState {
        self.scaler.state()
    }

    /// Restores a saved scaler state.
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

    /// Wall time of the last step's overflow check (gradient upcast, one fused reduction,
    /// one host sync; plus the per-parameter scan on the failure path).
    pub fn last_check_time(&self) -> Duration {
        self.last_check
    }

    /// The loss upcast to f32 and multiplied by the current scale.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.to_dtype(DType::F32)?.affine(self.scale(), 0.0)?)
    }

    /// `scale_loss(loss)?.backward()`.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        Ok(self.scale_loss(loss)?.backward()?)
    }

    /// Checks gradients (computed at the current scale) without touching any state: one
    /// reduction and one host sync; on failure, names the non-finite parameters.
    pub fn check_grads(&self, grads: &GradStore) -> Result<GradCheck> {
        check::check(&self.weights, grads, self.scale())
    }

    /// Checks the gradients, then either unscales (and clips) them and calls
    /// `opt.step` on the f32 masters, or skips the update and backs off.
    ///
    /// `grads` must come from the backward of [`scale_loss`](Self::scale_loss) at the
    /// current scale; `opt` must have been built over the master variables
    /// ([`master_vars`](Self::master_vars), or the same `Var`s from the `VarMap`). Returns
    /// [`AmpError::ScaleCollapse`] if the scale cannot back off any further and the policy is
    /// [`CollapsePolicy::Error`].
    pub fn step<O: Optimizer>(&mut self, opt: &mut O, grads: &GradStore) -> Result<StepOutcome> {
        self.step_with(grads, |g| opt.step(g))
    }

    /// Like [`step`](Self::step) with any update closure: it receives a `GradStore` holding
    /// the unscaled, clipped f32 gradients keyed by the master variables.
    pub fn step_with<F>(&mut self, grads: &GradStore, apply: F) -> Result<StepOutcome>
    where
        F: FnOnce(&GradStore) -> candle_core::Result<()>,
    {
        let step = self.scaler.state().steps;
        let scale = self.scale();
        let t0 = Instant::now();
        let check = check::check(&self.weights, grads, scale)?;
        self.last_check = t0.elapsed();
        if check.finite {
            return self.apply(step, scale, &check, 0, apply);
        }
        let upd = self.scaler.on_overflow(false);
        self.skip(step, upd, check, 0, SkipReason::NonFiniteGradients)
    }

    /// The overflow-checked step for an update that applies a gradient coefficient itself
    /// (e.g. a fused AdamW that multiplies each gradient as it reads it), so that no
    /// unscaled or clipped copy of the gradients is made.
    ///
    /// `scaled_norm` is the global L2 norm of `grads` as they are (at the current scale),
    /// computed by the caller (one fused reduction). When it is finite, `apply(coef)` must
    /// update the masters with `coef * grad` (`coef` folds unscaling and clipping); otherwise
    /// the gradients are scanned to name the non-finite parameters, the update is skipped and
    /// the scale backs off, as in [`step`](Self::step).
    ///
    /// With [`ScalerConfig::none`] in f32 this is a plain clipped step: the scaler is a no-op
    /// (PyTorch's `GradScaler(enabled=False)`) and `coef` is the clip coefficient.
    ///
    /// ```
    /// use candle_amp::{Amp, MasterWeights, ScalerConfig, WeightMode};
    /// use candle_core::{DType, Device, Tensor, Var};
    /// let dev = Device::Cpu;
    /// let w = Var::from_tensor(&Tensor::new(&[3f32, 4.0], &dev)?)?;
    /// let weights = MasterWeights::new([("w".into(), w.clone())], DType::F32, WeightMode::Cast)?;
    /// let mut amp = Amp::new(weights, ScalerConfig::none())?.with_clip_norm(Some(1.0))?;
    /// let grads = w.as_tensor().sqr()?.sum_all()?.affine(0.5, 0.0)?.backward()?; // grad = w
    /// let norm = 5.0; // |(3, 4)|
    /// let mut used = 0.0;
    /// let outcome = amp.step_fused(&grads, norm, |coef| {
    ///     used = coef;
    ///     Ok(())
    /// })?;
    /// assert!(outcome.is_applied());
    /// assert!((used - 1.0 / (5.0 + 1e-6)).abs() < 1e-12); // clipped to norm 1
    /// # Ok::<(), candle_amp::AmpError>(())
    /// ```
    pub fn step_fused<F>(
        &mut self,
        grads: &GradStore,
        scaled_norm: f32,
        apply: F,
    ) -> Result<StepOutcome>
    where
        F: FnOnce(f64) -> candle_core::Result<()>,
    {
        let step = self.scaler.state().steps;
        let scale = self.scale();
        if scaled_norm.is_finite() {
            let grad_norm = f64::from(scaled_norm) / scale;
            let clip_coef = self.clip_coefficient(grad_norm);
            apply(clip_coef / scale)?;
            return self.finish_applied(step, scale, grad_norm, clip_coef, 0);
        }
        let t0 = Instant::now();
        let check = check::check(&self.weights, grads, scale)?;
        self.last_check = t0.elapsed();
        if check.finite {
            // Every gradient is finite, only the caller's norm overflowed (squares past the
            // f32 range): the check's norm is computed scaled down, so it is finite.
            let grad_norm = check.sq_norm.sqrt();
            let clip_coef = self.clip_coefficient(grad_norm);
            apply(clip_coef / scale)?;
            return self.finish_applied(step, scale, grad_norm, clip_coef, 0);
        }
        let upd = self.scaler.on_overflow(false);
        self.skip(step, upd, check, 0, SkipReason::NonFiniteGradients)
    }

    fn clip_coefficient(&self, grad_norm: f64) -> f64 {
        match self.clip_norm {
            Some(max) => (max / (grad_norm + 1e-6)).min(1.0),
            None => 1.0,
        }
    }

    fn finish_applied(
        &mut self,
        step: u64,
        scale: f64,
        grad_norm: f64,
        clip_coef: f64,
        retries: u32,
    ) -> Result<StepOutcome> {
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
            retries,
        })
    }

    /// Recompute-until-finite (TF's `LossScaleGradientTape`): `backward(scale)` must return
    /// the gradients of the same batch's loss multiplied by `scale`; on overflow the scale
    /// backs off (hysteresis is bypassed: the same scale would overflow again) and the
    /// backward is re-run, at most `max_retries` times. Counts as one step.
    ///
    /// Candle keeps the graph alive while the loss lives, so the closure can be
    /// `|s| Ok((loss.to_dtype(DType::F32)? * s)?.backward()?)` without a new forward.
    pub fn step_recompute<O, G>(
        &mut self,
        opt: &mut O,
        max_retries: u32,
        backward: G,
    ) -> Result<StepOutcome>
    where
        O: Optimizer,
        G: FnMut(f64) -> candle_core::Result<GradStore>,
    {
        self.step_recompute_with(max_retries, backward, |g| opt.step(g))
    }

    /// [`step_recompute`](Self::step_recompute) for an already computed loss: re-runs
    /// `(loss_f32 * scale).backward()` on the same graph (no new forward).
    pub fn step_recompute_loss<O: Optimizer>(
        &mut self,
        opt: &mut O,
        loss: &Tensor,
        max_retries: u32,
    ) -> Result<StepOutcome> {
        let loss = loss.to_dtype(DType::F32)?;
        self.step_recompute(opt, max_retries, |s| loss.affine(s, 0.0)?.backward())
    }

    /// [`step_recompute`](Self::step_recompute) with an update closure.
    pub fn step_recompute_with<F, G>(
        &mut self,
        max_retries: u32,
        mut backward: G,
        apply: F,
    ) -> Result<StepOutcome>
    where
        F: FnOnce(&GradStore) -> candle_core::Result<()>,
        G: FnMut(f64) -> candle_core::Result<GradStore>,
    {
        let step = self.scaler.state().steps;
        let mut retries = 0;
        loop {
            let scale = self.scale();
            let grads = backward(scale)?;
            let t0 = Instant::now();
            let check = check::check(&self.weights, &grads, scale)?;
            self.last_check = t0.elapsed();
            if check.finite {
                return self.apply(step, scale, &check, retries, apply);
            }
            let upd = self.scaler.on_overflow(true);
            let can_retry = upd.change == ScaleChange::BackedOff;
            if !can_retry || retries >= max_retries {
                let reason = if can_retry {
                    SkipReason::RetriesExhausted
                } else {
                    SkipReason::NonFiniteGradients
                };
                return self.skip(step, upd, check, retries, reason);
            }
            tracing::debug!(step, scale, next = upd.after, "overflow, recomputing");
            retries += 1;
        }
    }

    fn apply<F>(
        &mut self,
        step: u64,
        scale: f64,
        check: &GradCheck,
        retries: u32,
        apply: F,
    ) -> Result<StepOutcome>
    where
        F: FnOnce(&GradStore) -> candle_core::Result<()>,
    {
        let grad_norm = check.sq_norm.sqrt();
        let clip_coef = self.clip_coefficient(grad_norm);
        let coef = clip_coef / scale;
        let mut store = GradStore::default();
        for (i, g) in &check.grads {
            let g = if coef == 1.0 {
                g.clone()
            } else {
                g.affine(coef, 0.0)?
            };
            store.insert(self.weights.params()[*i].master(), g);
        }
        apply(&store)?;
        self.finish_applied(step, scale, grad_norm, clip_coef, retries)
    }

    fn skip(
        &mut self,
        step: u64,
        upd: ScaleUpdate,
        check: GradCheck,
        retries: u32,
        reason: SkipReason,
    ) -> Result<StepOutcome> {
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
            reason
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
            retries,
        })
    }
}
