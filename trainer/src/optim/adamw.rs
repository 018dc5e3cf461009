//! AdamW, the first [`Optimizer`]: Loshchilov & Hutter's decoupled weight decay, as in
//! PyTorch, with state the trainer owns (so it can be checkpointed); the update is
//! `candle-fused`'s (fused or composite, as [`Kernels`] says).
//!
//! candle-nn's `AdamW` keeps its moments and step count private, so a run using it cannot be
//! resumed exactly. [`AdamW`] here has the same update rule and exposes its state by name
//! ([`Optimizer::state`]: `{param}.exp_avg` and `{param}.exp_avg_sq`, PyTorch's names). It
//! also implements `candle-amp`'s [`ScaledUpdate`] (the fused norm and the `coef * grad`
//! update, so mixed-precision steps copy no gradient) and [`candle_nn::Optimizer`].

use std::collections::HashMap;

use candle_amp::ScaledUpdate;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_fused::adamw::{adamw_composite, adamw_update_multi, AdamWParam, AdamWStep};
use serde::{Deserialize, Serialize};

use super::{global_grad_norm, Optimizer};
use crate::config::RunKeys;
use crate::model::{Kernels, Params};
use crate::{Error, Result};

/// AdamW hyper-parameters (PyTorch's names and defaults, except `weight_decay`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate (the schedule overrides it every step).
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, applied to parameters of rank >= 2 only (matmul and embedding
    /// weights; not biases or LayerNorm scales), as nanoGPT does.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// AdamW over named f32 parameters.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::Optimizer as _;
/// use trainer::model::Params;
/// use trainer::optim::{AdamW, AdamWConfig, Optimizer};
/// let w = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let params = Params::from_vars([("w".to_string(), w.clone())]);
/// let mut opt = AdamW::new(&params, AdamWConfig { lr: 0.1, ..Default::default() })?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// candle_nn::Optimizer::step(&mut opt, &loss.backward()?)?;
/// assert_eq!(opt.step_count(), 1);
/// assert_eq!(opt.state()[0].0, "w.exp_avg");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct AdamW {
    config: AdamWConfig,
    slots: Vec<Slot>,
    step: usize,
    kernels: Kernels,
}

impl AdamW {
    /// An optimiser for every parameter in `params`, with zero moments.
    pub fn new(params: &Params, config: AdamWConfig) -> Result<Self> {
        let mut slots = Vec::with_capacity(params.len());
        for (name, var) in params.iter() {
            if var.dtype() != DType::F32 {
                return Err(Error::Config(format!(
                    "AdamW keeps f32 state: parameter `{name}` is {:?}",
                    var.dtype()
                )));
            }
            // Two buffers of their own: the fused update writes them in place.
            slots.push(Slot {
                name: name.clone(),
                var: var.clone(),
                m: var.zeros_like()?,
                v: var.zeros_like()?,
                decay: var.rank() >= 2,
            });
        }
        Ok(AdamW {
            config,
            slots,
            step: 0,
            kernels: Kernels::Fused,
        })
    }

    /// The run's AdamW ([`super::build`]'s `adamw`): its keys `lr`, `beta1`, `beta2` and
    /// `weight_decay` (finite, betas in [0, 1), decay >= 0), updating on its `kernels`; it
    /// takes no `optimizer_options`.
    pub(crate) fn from_keys(run: &RunKeys, params: &Params) -> Result<Box<dyn Optimizer>> {
        let mut keys = run.part("optimizer_options", "adamw");
        let adamw = AdamWConfig {
            lr: keys.key("lr")?,
            beta1: keys.key("beta1")?,
            beta2: keys.key("beta2")?,
            eps: 1e-8,
            weight_decay: keys.key("weight_decay")?,
        };
        let kernels: Kernels = keys.key("kernels")?;
        keys.finish()?;
        let bad = |m: String| Err(Error::Config(m));
        let floats = [
            ("weight_decay", adamw.weight_decay),
            ("beta1", adamw.beta1),
            ("beta2", adamw.beta2),
        ];
        if let Some((name, v)) = floats.iter().find(|(_, v)| !v.is_finite()) {
            return bad(format!("{name} must be a finite number, got {v}"));
        }
        if !(0.0..1.0).contains(&adamw.beta1) || !(0.0..1.0).contains(&adamw.beta2) {
            return bad("beta1 and beta2 must be in [0, 1)".into());
        }
        if adamw.weight_decay < 0.0 {
            return bad("weight_decay must be >= 0".into());
        }
        Ok(Box::new(AdamW::new(params, adamw)?.with_kernels(kernels)))
    }

    /// The same optimiser updating with other kernels: `Fused` (default) updates every
    /// parameter and its moments in place in one call (`candle_fused::adamw::adamw_update_multi`,
    /// the bits of `adamw_update` per parameter); `Reference`
    /// runs its composite of ~15 Candle ops per parameter (`adamw_composite`).
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// The kernels the update runs on.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The suffixes of the state tensors of each parameter.
    const MOMENTS: [&'static str; 2] = ["exp_avg", "exp_avg_sq"];

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Applies one AdamW update from `grads`. Parameters without a gradient are left alone
    /// (their moments do not decay), like PyTorch.
    pub fn apply(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.apply_scaled(grads, 1.0)
    }

    /// Applies one AdamW update from `grad_scale * grads` (`grad_scale` folds unscaling and
    /// clipping, as `candle_amp::Amp::step` hands it over): neither costs a pass over the
    /// gradients of its own.
    pub fn apply_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> candle_core::Result<()> {
        self.step += 1;
        let c = &self.config;
        let step = AdamWStep {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
            grad_scale,
        };
        // A variable's gradient can still carry the backward graph (Candle detaches the
        // gradients of intermediate nodes, not the sums it stores for variables): without
        // this detach the moments would keep every step's activations alive forever.
        let stepped: Vec<(usize, Tensor)> = (self.slots.iter().enumerate())
            .filter_map(|(i, s)| grads.get(&s.var).map(|g| (i, g.detach())))
            .collect();
        match self.kernels {
            // The whole model in one call: the multi-tensor kernels' unit (one launch per
            // gradient dtype on a GPU once they are launched there).
            Kernels::Fused => {
                let group: Vec<AdamWParam> = (stepped.iter())
                    .map(|(i, g)| {
                        let s = &self.slots[*i];
                        AdamWParam {
                            param: &s.var,
                            grad: g,
                            exp_avg: &s.m,
                            exp_avg_sq: &s.v,
                            decay: s.decay,
                        }
                    })
                    .collect();
                adamw_update_multi(&group, &step)?;
            }
            Kernels::Reference => {
                for (i, g) in &stepped {
                    let slot = &mut self.slots[*i];
                    let step = AdamWStep {
                        weight_decay: if slot.decay { c.weight_decay } else { 0.0 },
                        ..step
                    };
                    let p = slot.var.as_tensor().detach();
                    let (p, m, v) = adamw_composite(&p, g, &slot.m, &slot.v, &step)?;
                    slot.var.set(&p)?;
                    (slot.m, slot.v) = (m, v);
                }
            }
        }
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &str {
        "adamw"
    }

    fn step(&mut self, grads: &GradStore, grad_scale: f64, lr: f64) -> candle_core::Result<()> {
        self.config.lr = lr;
        self.apply_scaled(grads, grad_scale)
    }

    fn step_count(&self) -> usize {
        self.step
    }

    /// `{param}.exp_avg` and `{param}.exp_avg_sq` (PyTorch's names) of every parameter kept.
    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(self.slots.len() * Self::MOMENTS.len());
        for s in &self.slots {
            let [m, v] = Self::MOMENTS;
            out.push((format!("{}.{m}", s.name), s.m.clone()));
            out.push((format!("{}.{v}", s.name), s.v.clone()));
        }
        out
    }

    /// Every moment must be present, f32, with its parameter's shape; nothing else may be.
    fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: usize) -> Result<()> {
        // Exactly the moments of the parameters, as the trainer writes them (f32): an extra
        // tensor is as wrong as a missing one.
        let expected: std::collections::HashSet<String> = self
            .slots
            .iter()
            .flat_map(|s| Self::MOMENTS.map(|m| format!("{}.{m}", s.name)))
            .collect();
        if let Some(extra) = tensors.keys().filter(|k| !expected.contains(*k)).min() {
            return Err(Error::checkpoint(
                "optimizer state",
                format!("unexpected `{extra}` (no parameter of the model has it)"),
            ));
        }
        for s in self.slots.iter_mut() {
            for (suffix, dst) in [(Self::MOMENTS[0], &mut s.m), (Self::MOMENTS[1], &mut s.v)] {
                let key = format!("{}.{suffix}", s.name);
                let t = tensors.get(&key).ok_or_else(|| {
                    Error::checkpoint("optimizer state", format!("missing `{key}`"))
                })?;
                if t.dtype() != DType::F32 {
                    return Err(Error::checkpoint(
                        "optimizer state",
                        format!("`{key}` is {:?}; the trainer writes f32", t.dtype()),
                    ));
                }
                if t.dims() != s.var.dims() {
                    return Err(Error::checkpoint(
                        "optimizer state",
                        format!(
                            "`{key}` has shape {:?}, parameter has {:?}",
                            t.dims(),
                            s.var.dims()
                        ),
                    ));
                }
                // A buffer of its own (the fused update writes it in place).
                *dst = t
                    .to_dtype(DType::F32)?
                    .to_device(s.var.device())?
                    .force_contiguous()?
                    .copy()?;
            }
        }
        self.step = step;
        Ok(())
    }

    fn retain(&mut self, keep: &dyn Fn(&str) -> bool) {
        self.slots.retain(|s| keep(&s.name));
    }

    /// Two f32 moments.
    fn state_bytes_per_param(&self) -> usize {
        Self::MOMENTS.len() * DType::F32.size_in_bytes()
    }
}

impl candle_nn::Optimizer for AdamW {
    type Config = AdamWConfig;

    fn new(vars: Vec<Var>, config: AdamWConfig) -> candle_core::Result<Self> {
        let params = Params::from_vars(
            vars.into_iter()
                .enumerate()
                .map(|(i, v)| (format!("param.{i:05}"), v)),
        );
        AdamW::new(&params, config).map_err(candle_core::Error::wrap)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.apply(grads)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// What `candle_amp::Amp::step` drives when a program steps an `AdamW` itself: the norm is
/// `optim::global_grad_norm` with this optimiser's kernels (one fused reduction); the update is
/// [`AdamW::apply_scaled`]. (The trainer drives any [`Optimizer`] the same way.)
impl ScaledUpdate for AdamW {
    type Error = candle_core::Error;

    fn grad_norm(&mut self, grads: &GradStore, vars: &[Var]) -> candle_core::Result<f64> {
        Ok(f64::from(global_grad_norm(grads, vars, self.kernels)?))
    }

    fn apply(&mut self, grads: &GradStore, _: &[Var], coef: f64) -> candle_core::Result<()> {
        self.apply_scaled(grads, coef)
    }
}
