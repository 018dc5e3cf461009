//! The per-call forward context: training mode, dropout keying, compute dtype, kernels, and
//! what travels with the batch's rows (positions, document ids).

use candle_core::{DType, Tensor};

use super::Kernels;

/// What travels with a batch's rows: per-token positions and document ids (`u32 [B, T]`).
///
/// Absent means "positions `0..T` in every row, one document per row". With packed rows
/// (several examples in one row), positions restart at every example and tokens attend only
/// within their own document. Every executor hands a slice of the batch's rows the matching
/// rows of these tensors ([`Rows::narrow`]): a pipeline microbatch and a data-parallel shard
/// see exactly what the whole batch would.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    /// Position of each token in its example, `u32 [B, T]`.
    pub positions: Option<Tensor>,
    /// Document id of each token, `u32 [B, T]`.
    pub doc_ids: Option<Tensor>,
}

impl Rows {
    /// Rows `start..start + len` (of the tensors that are present).
    pub fn narrow(&self, start: usize, len: usize) -> candle_core::Result<Rows> {
        let rows = |t: &Option<Tensor>| t.as_ref().map(|t| t.narrow(0, start, len)).transpose();
        Ok(Rows {
            positions: rows(&self.positions)?,
            doc_ids: rows(&self.doc_ids)?,
        })
    }

    /// Whether nothing travels with the rows (default positions, one document per row).
    pub fn is_empty(&self) -> bool {
        self.positions.is_none() && self.doc_ids.is_none()
    }
}

/// Per-call forward context: training mode, dropout seed, compute dtype, kernels and the rows'
/// context.
///
/// Dropout masks are a pure function of `(seed, site)` and the element's index in the batch,
/// where the site is fixed per dropout location in the network. The trainer derives `seed`
/// from the run seed and the step, so a run is reproducible, a resumed run needs no RNG state
/// for dropout, a recomputed block gets the same masks, and a slice of the batch's rows (a
/// pipeline microbatch, a data-parallel shard) gets exactly those rows of the batch's masks.
#[derive(Clone, Debug)]
pub struct Ctx {
    /// Apply dropout (training) or not (evaluation).
    pub train: bool,
    /// Seed of this forward pass's dropout masks.
    pub seed: u64,
    /// Index of the input's first row in the batch the masks are drawn for (0 for a whole
    /// batch; `r` for rows `r..` of it).
    pub row: usize,
    /// Dtype of the computation (weights are cast to it at use, so f32 master weights receive
    /// f32 gradients). Softmax, normalisation statistics and the loss always run in f32.
    pub dtype: DType,
    /// Which implementation of the ops runs (fused kernels by default).
    pub kernels: Kernels,
    /// Positions and document ids of the input's rows.
    pub rows: Rows,
    /// Whether a head that can compute its loss a chunk of rows at a time does so (never
    /// holding the whole `[B, T, vocab]` logits); `false` computes the whole logits (for
    /// comparison).
    pub chunked_loss: bool,
    /// Whether the adapters run (LoRA layers add their update); `false` computes each adapted
    /// linear layer as its base alone (PEFT's `disable_adapter`; see
    /// [`crate::lora::Tuning::without_adapters`] for the modules to save).
    pub adapters: bool,
}

impl Ctx {
    /// Evaluation: no dropout, f32.
    pub fn eval() -> Self {
        Ctx {
            train: false,
            seed: 0,
            row: 0,
            dtype: DType::F32,
            kernels: Kernels::Fused,
            rows: Rows::default(),
            chunked_loss: true,
            adapters: true,
        }
    }

    /// Training with dropout seeded by `seed`, f32.
    pub fn train(seed: u64) -> Self {
        Ctx {
            train: true,
            seed,
            ..Ctx::eval()
        }
    }

    /// The same context with another compute dtype.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Ctx { dtype, ..self }
    }

    /// The same context with other kernels.
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Ctx { kernels, ..self }
    }

    /// The same context for rows `row..` of the batch (see [`Ctx::row`]).
    pub fn with_row(self, row: usize) -> Self {
        Ctx { row, ..self }
    }

    /// The same context with the loss chunked or not (see [`Ctx::chunked_loss`]).
    pub fn with_chunked_loss(self, chunked_loss: bool) -> Self {
        Ctx {
            chunked_loss,
            ..self
        }
    }

    /// The same context with the adapters switched off: every adapted linear layer computes
    /// its base layer alone (PEFT's `disable_adapter`).
    ///
    /// ```
    /// use trainer::model::Ctx;
    /// assert!(Ctx::eval().adapters && !Ctx::eval().without_adapters().adapters);
    /// ```
    pub fn without_adapters(self) -> Self {
        Ctx {
            adapters: false,
            ..self
        }
    }

    /// The same context with the rows' positions and document ids.
    pub fn with_rows(self, rows: Rows) -> Self {
        Ctx { rows, ..self }
    }
}
