//! The loss as a part: the [`Objective`] trait every executor (plain, remat, pipeline, data
//! parallel) runs at the end of the model's chain, [`CrossEntropy`] (next-token
//! cross-entropy, the trainer's default) and [`Dpo`] (direct preference optimisation), and
//! [`build`], the registry the config's `objective` name goes through.
//!
//! An objective does two things:
//! - **the loss of a batch's rows** from the head's outputs ([`HeadOutput`]: the whole logits,
//!   the per-token log-probabilities of the targets, chunked where the head can, and the
//!   head's fused mean cross-entropy), as a scalar: the mean over the rows' *units*;
//! - **the units of each row** ([`Objective::row_units`], on the host from the batch): how
//!   much the row weighs in a mean over several batches. The trainer weighs accumulated
//!   micro-batches, pipeline microbatches and data-parallel shards by their share of the
//!   units, so their weighted mean is the loss over the whole step's rows (counted target
//!   tokens for cross-entropy; pairs for [`Dpo`], which keeps a pair's rows in one batch).
//!
//! An objective that compares the model with a reference ([`Objective::needs_reference`])
//! reads the reference's values of its rows from the context ([`Ctx::reference`]), and one
//! with metrics of its own hands them to the trainer's log ([`Objective::take_metrics`]).
//!
//! Adding an objective: one module implementing [`Objective`] with a constructor from the
//! run's keys that reads and checks its options (`objective_options`, through
//! [`OptionReader`](crate::config::OptionReader)), its `mod` line here, and one line in
//! [`build`]'s table. A program can also plug its own into a trainer (`Trainer::objective`) without
//! registering it.

mod cross_entropy;
mod dpo;
mod registry;

use std::fmt;

use candle_core::Tensor;

pub use cross_entropy::CrossEntropy;
pub use dpo::{reference_log_probs, Dpo, DpoLoss, DpoTerms, DPO_METRICS};
pub use registry::build;

use crate::data::Batch;
use crate::model::{Ctx, Link};
use crate::{Error, Result};

/// A training loss: given the head's outputs for a batch, the mean loss over the batch's
/// units; given a batch, the units of each row (see the [module docs](self)).
///
/// A label-smoothed cross-entropy (PyTorch's `CrossEntropyLoss(label_smoothing = eps)`),
/// weighted like the built-in cross-entropy:
///
/// ```
/// use candle_core::{DType, Tensor, D};
/// use trainer::data::Batch;
/// use trainer::model::IGNORE;
/// use trainer::objective::{CrossEntropy, HeadOutput, Objective};
///
/// #[derive(Debug)]
/// struct LabelSmoothing { eps: f64 }
///
/// impl Objective for LabelSmoothing {
///     fn name(&self) -> &str { "label-smoothing" }
///     fn row_units(&self, batch: &Batch) -> candle_core::Result<Vec<f64>> {
///         CrossEntropy.row_units(batch)
///     }
///     fn loss(&self, out: &HeadOutput<'_>) -> candle_core::Result<Tensor> {
///         let ce = out.mean_cross_entropy()?;
///         // the mean over the counted targets of -(1/V) Σ_j log p_j
///         let logits = out.logits()?;
///         let v = logits.dim(D::Minus1)? as f64;
///         let uniform = candle_nn::ops::log_softmax(&logits, D::Minus1)?.sum(D::Minus1)?;
///         let counted = out.targets().ne(IGNORE)?.to_dtype(DType::F32)?;
///         let n = counted.sum_all()?.maximum(1f32)?;
///         let smooth = (uniform * &counted)?.sum_all()?.div(&n)?.affine(-1.0 / v, 0.0)?;
///         ce.affine(1.0 - self.eps, 0.0)? + smooth.affine(self.eps, 0.0)?
///     }
/// }
/// ```
pub trait Objective: Send + Sync + fmt::Debug {
    /// A short name for messages and the config (`cross-entropy`).
    fn name(&self) -> &str;

    /// The units of each row of `batch` (`B` values, on the host; no more than one read back
    /// from the device): a micro-batch, a pipeline microbatch or a data-parallel shard weighs
    /// its share of the units of the rows it holds. Rows with no unit contribute nothing.
    fn row_units(&self, batch: &Batch) -> candle_core::Result<Vec<f64>>;

    /// Rows that belong together, consecutive in a batch (a preference pair's chosen and
    /// rejected rows: 2): the trainer never splits such a group between data-parallel ranks or
    /// pipeline microbatches, and refuses sizes that would (`batch_size` and each pipeline
    /// microbatch must hold whole groups). 1 by default.
    fn rows_per_group(&self) -> usize {
        1
    }

    /// Whether the loss compares the model with a reference model: the trainer then hands it
    /// the reference's summed log-probability of each row's counted targets in
    /// [`Ctx::reference`] (computed before the forward: the base with the adapters off under
    /// LoRA). `false` by default.
    fn needs_reference(&self) -> bool {
        false
    }

    /// The objective's own metrics of the rows it computed losses for since the last call,
    /// drained (at most one read back from the device): the trainer logs them with each step
    /// (`metrics.jsonl`, TensorBoard `train/<name>`). None by default.
    fn take_metrics(&self) -> candle_core::Result<Vec<(String, f64)>> {
        Ok(Vec::new())
    }

    /// The loss of the rows the head saw: a differentiable scalar, f32 (f64 when computing in
    /// f64), the mean over the rows' units (0 when they have none). Reads nothing back from
    /// the device (the step reads the loss once, with the gradient norm).
    fn loss(&self, out: &HeadOutput<'_>) -> candle_core::Result<Tensor>;
}

/// `objective`'s units of each row of `batch`, checked: one finite, non-negative value per
/// row (an error naming the objective otherwise).
pub(crate) fn units_of(objective: &dyn Objective, batch: &Batch) -> Result<Vec<f64>> {
    let units = objective.row_units(batch)?;
    let rows = batch.x.dim(0)?;
    if units.len() != rows {
        return Err(Error::Config(format!(
            "objective `{}` gave {} row units for a batch of {rows} rows",
            objective.name(),
            units.len()
        )));
    }
    if let Some((i, u)) = units
        .iter()
        .enumerate()
        .find(|(_, u)| !(u.is_finite() && **u >= 0.0))
    {
        return Err(Error::Config(format!(
            "objective `{}` gave row {i} the units {u} (not a finite number >= 0)",
            objective.name()
        )));
    }
    Ok(units)
}

/// Errors unless `rows` (a batch or microbatch of `what`) holds whole groups of `objective`'s
/// [`Objective::rows_per_group`].
pub(crate) fn check_groups(objective: &dyn Objective, rows: usize, what: &str) -> Result<()> {
    let g = objective.rows_per_group().max(1);
    if !rows.is_multiple_of(g) {
        return Err(Error::Config(format!(
            "objective `{}` keeps {g} rows together, but {what} has {rows} rows",
            objective.name()
        )));
    }
    Ok(())
}

/// What the model's head gives an objective for a batch: its hidden states, the batch's
/// targets (u32 `[B, T]`, [`IGNORE`](crate::model::IGNORE) where a target does not count) and
/// the step's context, with the head's outputs computed on demand.
#[derive(Clone, Copy, Debug)]
pub struct HeadOutput<'a> {
    head: &'a Link,
    hidden: &'a Tensor,
    targets: &'a Tensor,
    ctx: &'a Ctx,
}

impl<'a> HeadOutput<'a> {
    /// The outputs of `head` (the chain's last link) for its input `hidden` (`[B, T, C]`).
    pub fn new(head: &'a Link, hidden: &'a Tensor, targets: &'a Tensor, ctx: &'a Ctx) -> Self {
        HeadOutput {
            head,
            hidden,
            targets,
            ctx,
        }
    }

    /// The batch's targets (u32 `[B, T]`, [`IGNORE`](crate::model::IGNORE) where a target
    /// does not count).
    pub fn targets(&self) -> &'a Tensor {
        self.targets
    }

    /// The step's context (dtype, kernels, dropout seed).
    pub fn ctx(&self) -> &'a Ctx {
        self.ctx
    }

    /// The whole logits, `[B, T, V]` f32 (f64 computing in f64): the `[B, T, V]` tensor the
    /// chunked losses avoid.
    pub fn logits(&self) -> candle_core::Result<Tensor> {
        self.head.forward(self.hidden, self.ctx)
    }

    /// The log-probability of each target, `[B, T]` f32 (f64 computing in f64), 0 where the
    /// target does not count: a chunk of rows at a time where the head can (no `[B, T, V]`
    /// logits), differentiable for any upstream gradient.
    pub fn token_log_probs(&self) -> candle_core::Result<Tensor> {
        self.head
            .token_losses(self.hidden, self.targets, self.ctx)?
            .neg()
    }

    /// The mean cross-entropy over the counted targets: the head's own loss (chunked and fused
    /// where it can), what [`CrossEntropy`] returns.
    pub fn mean_cross_entropy(&self) -> candle_core::Result<Tensor> {
        Ok(self.head.loss(self.hidden, self.targets, self.ctx)?.mean)
    }
}
