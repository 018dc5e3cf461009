//! SGD with momentum, as PyTorch's `torch.optim.SGD`: `lr`, `momentum`, `dampening`,
//! `nesterov` and (L2, coupled) `weight_decay`, with the state PyTorch names
//! `momentum_buffer`, held by the trainer so that a run checkpoints and resumes exactly.
//!
//! A run names it `optimizer = "sgd"`; its options other than `lr` are the run's
//! `optimizer_options` (`momentum=0.9,nesterov=true`), which it reads and
//! checks as PyTorch does.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::Optimizer;
use crate::config::RunKeys;
use crate::model::Params;
use crate::{Error, Result};

/// SGD hyper-parameters (PyTorch's names and defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate (the schedule overrides it every step).
    pub lr: f64,
    /// Momentum factor (0: plain SGD, no state).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`), every parameter.
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening = 0`).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    /// Errors as PyTorch's `SGD` does: negative `lr`, `momentum` or `weight_decay`, and
    /// `nesterov` without momentum or with dampening (named as the run's keys).
    pub fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.into()));
        if !(self.lr >= 0.0 && self.lr.is_finite()) {
            return bad("lr must be a finite number >= 0");
        }
        let finite = [self.momentum, self.dampening, self.weight_decay];
        if finite.iter().any(|v| !v.is_finite()) {
            return bad("optimizer_options: momentum, dampening and weight_decay must be finite");
        }
        if self.momentum < 0.0 {
            return bad("optimizer_options.momentum must be >= 0");
        }
        if self.weight_decay < 0.0 {
            return bad("optimizer_options.weight_decay must be >= 0");
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad("optimizer_options.nesterov needs momentum > 0 and dampening = 0");
        }
        Ok(())
    }
}

struct Slot {
    name: String,
    var: Var,
    /// The momentum buffer (`None` without momentum).
    buf: Option<Tensor>,
}

/// SGD with momentum over named f32 parameters, as PyTorch's `torch.optim.SGD` (`lr`,
/// `momentum`, `dampening`, `nesterov`, coupled `weight_decay`); a run names it
/// `optimizer = "sgd"` and gives its options in `optimizer_options`.
///
/// Its state is `{param}.momentum_buffer` for every parameter when `momentum > 0` (none
/// otherwise). PyTorch starts a parameter's buffer at its first gradient (`buf = grad`); here
/// the buffers exist from the start, zero, and the first update sets them to the gradient, so
/// that checkpoints and ZeRO-1 see the same names throughout: the same unless a parameter has
/// no gradient at the first update and `dampening` is not 0.
///
/// ```
/// use candle_core::{Device, Var};
/// use trainer::model::Params;
/// use trainer::optim::{Optimizer, Sgd, SgdConfig};
/// let w = Var::new(&[1f32, -2.], &Device::Cpu)?;
/// let params = Params::from_vars([("w".to_string(), w.clone())]);
/// let mut sgd = Sgd::new(&params, SgdConfig { momentum: 0.9, ..Default::default() })?;
/// let grads = w.as_tensor().sqr()?.sum_all()?.backward()?; // grad = 2 w
/// sgd.step(&grads, 1.0, 0.1)?;
/// assert_eq!(w.as_tensor().to_vec1::<f32>()?, [0.8, -1.6]);
/// assert_eq!(sgd.state()[0].0, "w.momentum_buffer");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Sgd {
    config: SgdConfig,
    slots: Vec<Slot>,
    step: usize,
}

impl Sgd {
    /// The state's suffix (PyTorch's name).
    const BUFFER: &'static str = "momentum_buffer";

    /// An optimiser for every parameter in `params` (f32), `config` checked
    /// ([`SgdConfig::check`]).
    pub fn new(params: &Params, config: SgdConfig) -> Result<Self> {
        config.check()?;
        let mut slots = Vec::with_capacity(params.len());
        for (name, var) in params.iter() {
            if var.dtype() != DType::F32 {
                return Err(Error::Config(format!(
                    "SGD keeps f32 state: parameter `{name}` is {:?}",
                    var.dtype()
                )));
            }
            let buf = match config.momentum > 0.0 {
                true => Some(var.zeros_like()?),
                false => None,
            };
            slots.push(Slot {
                name: name.clone(),
                var: var.clone(),
                buf,
            });
        }
        Ok(Sgd {
            config,
            slots,
            step: 0,
        })
    }

    /// The run's SGD ([`super::build`]'s `sgd`): its key `lr` and its `optimizer_options`
    /// `momentum`, `dampening`, `weight_decay` (0 by default) and `nesterov` (false), checked.
    pub(crate) fn from_keys(run: &RunKeys, params: &Params) -> Result<Box<dyn Optimizer>> {
        let mut o = run.part("optimizer_options", "sgd");
        let sgd = SgdConfig {
            lr: o.key("lr")?,
            momentum: o.f64("momentum", 0.0)?,
            dampening: o.f64("dampening", 0.0)?,
            weight_decay: o.f64("weight_decay", 0.0)?,
            nesterov: o.bool("nesterov", false)?,
        };
        o.finish()?;
        Ok(Box::new(Sgd::new(params, sgd)?))
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// One update of a parameter from its gradient `g` (already scaled), PyTorch's order:
    /// decay into the gradient, the buffer, Nesterov's look-ahead, the step.
    fn update(&self, slot: &Slot, g: &Tensor, first: bool) -> candle_core::Result<Option<Tensor>> {
        let c = &self.config;
        let p = slot.var.as_tensor().detach();
        let mut d = g.clone();
        if c.weight_decay != 0.0 {
            d = (d + p.affine(c.weight_decay, 0.0)?)?;
        }
        let mut buf = None;
        if let Some(old) = &slot.buf {
            let b = match first {
                true => d.copy()?,
                false => (old.affine(c.momentum, 0.0)? + d.affine(1.0 - c.dampening, 0.0)?)?,
            };
            d = match c.nesterov {
                true => (d + b.affine(c.momentum, 0.0)?)?,
                false => b.clone(),
            };
            buf = Some(b);
        }
        slot.var.set(&(p - d.affine(c.lr, 0.0)?)?)?;
        Ok(buf)
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &str {
        "sgd"
    }

    /// Parameters without a gradient are left alone (their buffers too), like PyTorch.
    fn step(&mut self, grads: &GradStore, grad_scale: f64, lr: f64) -> candle_core::Result<()> {
        self.config.lr = lr;
        let first = self.step == 0;
        self.step += 1;
        for i in 0..self.slots.len() {
            let Some(g) = grads.get(&self.slots[i].var) else {
                continue;
            };
            // Detached: a variable's gradient can still carry the backward graph.
            let g = match grad_scale == 1.0 {
                true => g.detach(),
                false => g.detach().affine(grad_scale, 0.0)?,
            };
            let buf = self.update(&self.slots[i], &g, first)?;
            if buf.is_some() {
                self.slots[i].buf = buf;
            }
        }
        Ok(())
    }

    fn step_count(&self) -> usize {
        self.step
    }

    /// `{param}.momentum_buffer` of every parameter kept (none without momentum).
    fn state(&self) -> Vec<(String, Tensor)> {
        (self.slots.iter())
            .filter_map(|s| {
                (s.buf.as_ref()).map(|b| (format!("{}.{}", s.name, Self::BUFFER), b.clone()))
            })
            .collect()
    }

    /// Every buffer must be present, f32, with its parameter's shape; nothing else may be.
    fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: usize) -> Result<()> {
        let bad = |m: String| Err(Error::checkpoint("optimizer state", m));
        let expected: Vec<String> = (self.slots.iter())
            .filter(|s| s.buf.is_some())
            .map(|s| format!("{}.{}", s.name, Self::BUFFER))
            .collect();
        if let Some(extra) = tensors.keys().filter(|k| !expected.contains(k)).min() {
            return bad(format!(
                "unexpected `{extra}` (no parameter of the model has it)"
            ));
        }
        for s in self.slots.iter_mut().filter(|s| s.buf.is_some()) {
            let key = format!("{}.{}", s.name, Self::BUFFER);
            let Some(t) = tensors.get(&key) else {
                return bad(format!("missing `{key}`"));
            };
            if t.dtype() != DType::F32 {
                return bad(format!(
                    "`{key}` is {:?}; the trainer writes f32",
                    t.dtype()
                ));
            }
            if t.dims() != s.var.dims() {
                let (got, want) = (t.dims(), s.var.dims());
                return bad(format!("`{key}` has shape {got:?}, parameter has {want:?}"));
            }
            s.buf = Some(t.to_device(s.var.device())?.force_contiguous()?.copy()?);
        }
        self.step = step;
        Ok(())
    }

    fn retain(&mut self, keep: &dyn Fn(&str) -> bool) {
        self.slots.retain(|s| keep(&s.name));
    }

    /// One f32 buffer with momentum, nothing without.
    fn state_bytes_per_param(&self) -> usize {
        match self.config.momentum > 0.0 {
            true => DType::F32.size_in_bytes(),
            false => 0,
        }
    }
}
