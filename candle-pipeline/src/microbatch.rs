//! Splitting a batch-major batch into microbatches with exact loss weighting.
//!
//! The pipeline runs the loss once per microbatch and backpropagates `weight * loss_k`.
//! With [`LossReduction::Mean`] the weight of microbatch `k` is `rows_k / rows_total`, so that
//! `sum_k weight_k * mean_k = mean over the full batch` and the accumulated gradients equal the
//! full-batch gradients, also when the last microbatch is smaller. With [`LossReduction::Sum`]
//! every weight is 1 (the loss function must then return a sum). For a mean over a number of
//! tokens that differs between microbatches (padding, ignored labels), pass explicit weights with
//! [`Microbatches::with_weights`] (e.g. `tokens_k / tokens_total`).

use candle_core::Tensor;

use crate::error::{PipelineError, Result};

/// How the loss function reduces over the rows of a microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReduction {
    /// The loss function returns a mean over the microbatch rows; microbatch `k` is weighted by
    /// `rows_k / rows_total`.
    Mean,
    /// The loss function returns a sum over the microbatch rows; every microbatch has weight 1.
    Sum,
}

impl LossReduction {
    /// The loss weight of a microbatch of `rows` rows of a batch of `total` rows: `rows / total`
    /// for [`LossReduction::Mean`], 1 for [`LossReduction::Sum`].
    pub fn weight(self, rows: usize, total: usize) -> f64 {
        match self {
            LossReduction::Mean => rows as f64 / total as f64,
            LossReduction::Sum => 1.0,
        }
    }
}

/// Sizes of `m` contiguous microbatches covering `total` rows as evenly as possible
/// (the first `total % m` microbatches get one more row).
///
/// ```
/// assert_eq!(candle_pipeline::even_sizes(10, 4).unwrap(), vec![3, 3, 2, 2]);
/// ```
pub fn even_sizes(total: usize, m: usize) -> Result<Vec<usize>> {
    if m == 0 || m > total {
        return Err(PipelineError::Config(format!(
            "cannot split {total} rows into {m} non-empty microbatches"
        )));
    }
    let (q, r) = (total / m, total % m);
    Ok((0..m).map(|k| q + usize::from(k < r)).collect())
}

/// Sizes of chunks of `chunk` rows; the last one holds the remainder (uneven last microbatch).
///
/// ```
/// assert_eq!(candle_pipeline::chunk_sizes(10, 4).unwrap(), vec![4, 4, 2]);
/// ```
pub fn chunk_sizes(total: usize, chunk: usize) -> Result<Vec<usize>> {
    if chunk == 0 || total == 0 {
        return Err(PipelineError::Config(format!(
            "cannot split {total} rows into chunks of {chunk}"
        )));
    }
    let mut sizes = vec![chunk; total / chunk];
    if total % chunk != 0 {
        sizes.push(total % chunk);
    }
    Ok(sizes)
}

/// A batch split along dimension 0 into microbatches of inputs and targets, with the weight
/// applied to each microbatch loss.
#[derive(Debug, Clone)]
pub struct Microbatches {
    inputs: Vec<Tensor>,
    targets: Vec<Tensor>,
    weights: Vec<f64>,
    /// First row of each microbatch in the whole batch.
    rows: Vec<usize>,
    /// The first row of this batch in a larger one ([`Microbatches::with_first_row`]).
    first_row: usize,
    key: u64,
}

impl Microbatches {
    /// Splits `inputs` and `targets` (same size on dimension 0) into `m` microbatches of
    /// (almost) equal size, see [`even_sizes`].
    pub fn split(
        inputs: &Tensor,
        targets: &Tensor,
        m: usize,
        reduction: LossReduction,
    ) -> Result<Self> {
        let sizes = even_sizes(inputs.dim(0)?, m)?;
        Self::split_sizes(inputs, targets, &sizes, reduction)
    }

    /// Splits into microbatches of the given row counts (any sizes, e.g. an uneven last one).
    pub fn split_sizes(
        inputs: &Tensor,
        targets: &Tensor,
        sizes: &[usize],
        reduction: LossReduction,
    ) -> Result<Self> {
        let total = inputs.dim(0)?;
        if targets.dim(0)? != total {
            return Err(PipelineError::Config(format!(
                "inputs have {total} rows but targets have {}",
                targets.dim(0)?
            )));
        }
        if sizes.iter().sum::<usize>() != total || sizes.contains(&0) || sizes.is_empty() {
            return Err(PipelineError::Config(format!(
                "microbatch sizes {sizes:?} do not partition {total} rows"
            )));
        }
        let mut start = 0;
        let (mut xs, mut ys, mut ws) = (vec![], vec![], vec![]);
        for &n in sizes {
            xs.push(inputs.narrow(0, start, n)?);
            ys.push(targets.narrow(0, start, n)?);
            ws.push(reduction.weight(n, total));
            start += n;
        }
        Self::with_weights(xs, ys, ws)
    }

    /// Builds microbatches from explicit parts and loss weights (e.g. `tokens_k / tokens_total`
    /// for a token-mean loss with padding).
    pub fn with_weights(
        inputs: Vec<Tensor>,
        targets: Vec<Tensor>,
        weights: Vec<f64>,
    ) -> Result<Self> {
        if inputs.is_empty() || inputs.len() != targets.len() || inputs.len() != weights.len() {
            return Err(PipelineError::Config(format!(
                "need the same non-zero number of inputs ({}), targets ({}) and weights ({})",
                inputs.len(),
                targets.len(),
                weights.len()
            )));
        }
        let mut rows = Vec::with_capacity(inputs.len());
        let mut row = 0;
        for x in &inputs {
            rows.push(row);
            row += x.dim(0)?;
        }
        Ok(Self {
            inputs,
            targets,
            weights,
            rows,
            first_row: 0,
            key: 0,
        })
    }

    /// Attaches a key the stages receive in every [`Call`](crate::stage::Call) of this batch
    /// (e.g. the step's dropout seed); 0 by default.
    pub fn with_key(mut self, key: u64) -> Self {
        self.key = key;
        self
    }

    /// Shifts every microbatch's first row by `first`: for a batch that is itself rows
    /// `first..` of a larger one (a data-parallel shard), so that [`Microbatches::row`] (and
    /// a stage's [`Call::row`](crate::stage::Call::row)) index the larger batch.
    pub fn with_first_row(mut self, first: usize) -> Self {
        self.first_row = first;
        self
    }

    /// The batch's key (see [`Microbatches::with_key`]).
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Index of microbatch `k`'s first row in the whole batch (the sum of the earlier
    /// microbatches' sizes, plus [`Microbatches::with_first_row`]'s offset).
    pub fn row(&self, k: usize) -> usize {
        self.first_row + self.rows[k]
    }

    /// Number of microbatches.
    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Always false: a `Microbatches` holds at least one microbatch.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Input of microbatch `k`.
    pub fn input(&self, k: usize) -> &Tensor {
        &self.inputs[k]
    }

    /// Target of microbatch `k`.
    pub fn target(&self, k: usize) -> &Tensor {
        &self.targets[k]
    }

    /// Loss weight of microbatch `k`.
    pub fn weight(&self, k: usize) -> f64 {
        self.weights[k]
    }
}
