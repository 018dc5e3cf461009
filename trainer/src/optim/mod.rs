//! The optimiser as a part: the [`Optimizer`] trait the trainer, ZeRO-1, checkpoints and the
//! memory estimate drive, [`AdamW`] (the default) and [`Sgd`] its implementations, [`build`]
//! the registry that makes the one a run's config names (`optimizer`); and, for every
//! optimiser, the global gradient norm and gradient accumulation over Candle's [`GradStore`].
//!
//! Adding an optimiser: one module implementing [`Optimizer`] with a constructor from the run's
//! config that reads and checks its options (`optimizer_options`, through
//! [`OptionReader`](crate::config::OptionReader)), its `mod` line here, and one line in
//! [`build`]'s table.

mod adamw;
mod registry;
mod sgd;

use std::collections::HashMap;

use candle_amp::ScaledUpdate;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_fused::adamw::{sum_of_squares_multi, sum_of_squares_multi_composite};

pub use adamw::{AdamW, AdamWConfig};
pub use registry::{build, state_bytes_per_param};
pub use sgd::{Sgd, SgdConfig};

use crate::model::Kernels;
use crate::Result;

/// An optimiser over named parameters whose state is named tensors, so that a run can be
/// checkpointed, resumed bit-exactly and sharded (ZeRO-1) whatever the update rule.
///
/// State names start with the parameter's name and a dot (`{param}.{what}`): ZeRO-1 hands
/// each tensor to the rank owning its parameter, and checkpoints store them under these
/// names (`optimizer.safetensors`, with [`step_count`](Self::step_count) as its `step`).
/// Checkpoints take f32, f16 or bf16 tensors; ZeRO-1 gathers them as f32.
///
/// Momentum SGD in a few lines, trained, saved and restored by name:
///
/// ```
/// use std::collections::HashMap;
/// use candle_core::{backprop::GradStore, Device, Tensor, Var};
/// use trainer::optim::Optimizer;
///
/// struct Sgd { params: Vec<(String, Var, Tensor)>, steps: usize }
///
/// impl Optimizer for Sgd {
///     fn name(&self) -> &str { "sgd" }
///     fn step(&mut self, grads: &GradStore, scale: f64, lr: f64) -> candle_core::Result<()> {
///         self.steps += 1;
///         for (_, var, buf) in &mut self.params {
///             if let Some(g) = grads.get(var) {
///                 *buf = ((&*buf * 0.9)? + g.affine(scale, 0.0)?)?;
///                 var.set(&(var.as_tensor() - buf.affine(lr, 0.0)?)?)?;
///             }
///         }
///         Ok(())
///     }
///     fn step_count(&self) -> usize { self.steps }
///     fn state(&self) -> Vec<(String, Tensor)> {
///         self.params.iter().map(|(n, _, b)| (format!("{n}.momentum_buffer"), b.clone())).collect()
///     }
///     fn load_state(&mut self, state: &HashMap<String, Tensor>, steps: usize) -> trainer::Result<()> {
///         for (n, _, b) in &mut self.params {
///             let key = format!("{n}.momentum_buffer");
///             *b = state.get(&key).cloned().ok_or_else(|| {
///                 trainer::Error::checkpoint("optimizer state", format!("missing `{key}`"))
///             })?;
///         }
///         self.steps = steps;
///         Ok(())
///     }
///     fn retain(&mut self, keep: &dyn Fn(&str) -> bool) { self.params.retain(|p| keep(&p.0)) }
///     fn state_bytes_per_param(&self) -> usize { 4 }
/// }
///
/// let w = Var::new(&[1f32, -2.], &Device::Cpu)?;
/// let mut sgd = Sgd { params: vec![("w".into(), w.clone(), w.zeros_like()?)], steps: 0 };
/// let grads = w.as_tensor().sqr()?.sum_all()?.backward()?; // grad = 2 w
/// sgd.step(&grads, 1.0, 0.1)?;
/// assert_eq!(w.as_tensor().to_vec1::<f32>()?, [0.8, -1.6]);
/// let saved: HashMap<_, _> = sgd.state().into_iter().collect();
/// let mut again = Sgd { params: vec![("w".into(), w.clone(), w.zeros_like()?)], steps: 0 };
/// again.load_state(&saved, sgd.step_count())?;
/// assert_eq!(again.state()[0].1.to_vec1::<f32>()?, [2.0, -4.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait Optimizer: Send {
    /// A short name for messages (`adamw`).
    fn name(&self) -> &str;

    /// Applies one update at learning rate `lr` from `grad_scale * grad` for every parameter
    /// held that has a gradient in `grads` (`grad_scale` folds unscaling and clipping), and
    /// leaves the others alone.
    fn step(&mut self, grads: &GradStore, grad_scale: f64, lr: f64) -> candle_core::Result<()>;

    /// Number of updates applied so far (saved with the state).
    fn step_count(&self) -> usize;

    /// The state of the parameters held, as named tensors (`{param}.{what}`), in a fixed
    /// order: what a checkpoint saves.
    fn state(&self) -> Vec<(String, Tensor)>;

    /// Restores state saved from [`state`](Self::state) and the update count: the same names
    /// and shapes, or an error naming the tensor.
    fn load_state(&mut self, state: &HashMap<String, Tensor>, step_count: usize) -> Result<()>;

    /// Keeps the state and the updates of the parameters whose name satisfies `keep` only, and
    /// frees the rest (ZeRO-1: each data-parallel rank updates its shard of the parameters).
    fn retain(&mut self, keep: &dyn Fn(&str) -> bool);

    /// Bytes of state the optimiser holds per parameter element (for the memory estimate).
    fn state_bytes_per_param(&self) -> usize;
}

/// An optimiser's state as a checkpoint saves it: its named tensors and update count.
#[derive(Clone, Debug)]
pub struct OptimizerState {
    /// [`Optimizer::state`].
    pub tensors: Vec<(String, Tensor)>,
    /// [`Optimizer::step_count`].
    pub step_count: usize,
}

impl OptimizerState {
    /// The state `optimizer` holds now.
    pub fn of(optimizer: &dyn Optimizer) -> Self {
        OptimizerState {
            tensors: optimizer.state(),
            step_count: optimizer.step_count(),
        }
    }
}

/// What `candle_amp::Amp::step` drives for the trainer: an [`Optimizer`] stepped at `lr`,
/// with the gradient norm the step already read (`norm`, taken by the first
/// [`ScaledUpdate::grad_norm`]; [`global_grad_norm`] over `kernels` after that).
pub(crate) struct Driven<'a> {
    pub optimizer: &'a mut dyn Optimizer,
    pub lr: f64,
    pub norm: Option<f32>,
    pub kernels: Kernels,
}

impl ScaledUpdate for Driven<'_> {
    type Error = candle_core::Error;

    fn grad_norm(&mut self, grads: &GradStore, vars: &[Var]) -> candle_core::Result<f64> {
        if let Some(norm) = self.norm.take() {
            return Ok(f64::from(norm));
        }
        Ok(f64::from(global_grad_norm(grads, vars, self.kernels)?))
    }

    fn apply(&mut self, grads: &GradStore, _: &[Var], coef: f64) -> candle_core::Result<()> {
        self.optimizer.step(grads, coef, self.lr)
    }
}

/// The global L2 norm of the gradients of `vars` (missing gradients count as zero) with one
/// host sync, using `kernels` (the fused one reads each gradient once): `candle_fused`'s
/// `global_norm`, its read counted ([`crate::transfer`]).
pub(crate) fn global_grad_norm(
    grads: &GradStore,
    vars: &[Var],
    kernels: Kernels,
) -> candle_core::Result<f32> {
    match grad_sum_of_squares(grads, vars, kernels)? {
        None => Ok(0.0),
        Some(sum) => Ok(crate::transfer::read_scalar::<f32>(&sum)?.sqrt()),
    }
}

/// The sum of the squares of the gradients of `vars` as an f32 scalar on their device, read
/// nothing back (`None` when no variable has a gradient): `candle_fused`'s `global_norm`
/// before its read, the per-tensor sums added in the order of `vars` (one multi-tensor call,
/// [`sum_of_squares_multi`], or [`sum_of_squares_multi_composite`] with `Kernels::Reference`).
pub(crate) fn grad_sum_of_squares(
    grads: &GradStore,
    vars: &[Var],
    kernels: Kernels,
) -> candle_core::Result<Option<Tensor>> {
    let present: Vec<&Tensor> = vars.iter().filter_map(|v| grads.get(v)).collect();
    match kernels {
        Kernels::Fused => sum_of_squares_multi(&present),
        Kernels::Reference => sum_of_squares_multi_composite(&present),
    }
}

/// Adds the gradients of `from` into `into` (gradient accumulation across micro-batches).
pub fn accumulate(into: &mut GradStore, from: GradStore, vars: &[Var]) -> candle_core::Result<()> {
    let mut from = from;
    for v in vars {
        if let Some(g) = from.remove(v) {
            let g = g.detach();
            let sum = match into.remove(v) {
                Some(acc) => (acc + g)?,
                None => g,
            };
            into.insert(v, sum);
        }
    }
    Ok(())
}
