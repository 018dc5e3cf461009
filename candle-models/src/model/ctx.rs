//! The per-call forward context: training mode, dropout keying, compute dtype, kernels, and
//! what travels with the batch's rows (positions, document ids); and the [`Kernels`] ops that
//! draw dropout with the context's keys (attention, dropout).

use std::sync::Arc;

use candle_core::{DType, Tensor, TensorId};
use candle_fused::attention::{self, AttentionConfig};
use candle_fused::host::Targets;
use candle_fused::{dropout, RngKey};

pub use candle_data::{HostTokens, Rows};

use super::Kernels;

type R = candle_core::Result<Tensor>;

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
    /// the trainer's `Tuning::without_adapters` for the modules to save).
    pub adapters: bool,
    /// A reference model's values for the input's rows (`[B]`, the compute's float dtype), set
    /// before the forward for an objective that compares the policy with a reference: the
    /// summed completion log-probabilities a preference objective reads (the trainer's
    /// `Dpo`). `None` for every other objective.
    pub reference: Option<Tensor>,
    /// The host copy of the targets tensor the head is given (flat, row-major, as the batch
    /// was built; see [`Ctx::with_host_targets`]): the cross-entropy ops then read nothing
    /// back. `None`: they read the targets once.
    pub host_targets: Option<HostTargets>,
}

/// One targets tensor's values on the host ([`Ctx::host_targets`]), used only for that tensor.
#[derive(Clone, Debug)]
pub struct HostTargets {
    id: TensorId,
    values: Arc<[u32]>,
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
            reference: None,
            host_targets: None,
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

    /// The same context with `values`, the host copy of `targets` (flat, row-major; a length
    /// other than the targets' is refused by the op that uses it).
    pub fn with_host_targets(self, targets: &Tensor, values: Arc<[u32]>) -> Self {
        let host_targets = Some(HostTargets {
            id: targets.id(),
            values,
        });
        Ctx {
            host_targets,
            ..self
        }
    }

    /// `t` (the targets tensor `of`, or a reshape of it) for a cross-entropy op, with `of`'s
    /// host copy when this context holds one ([`Ctx::with_host_targets`]).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_models::model::Ctx;
    /// let targets = Tensor::new(&[[1u32, 2], [3, 4]], &Device::Cpu)?;
    /// let ctx = Ctx::eval().with_host_targets(&targets, vec![1, 2, 3, 4].into());
    /// let flat = targets.flatten_all()?;
    /// assert_eq!(ctx.targets(&targets, &flat).tensor().dims(), [4]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn targets<'a>(&'a self, of: &Tensor, t: &'a Tensor) -> Targets<'a> {
        match &self.host_targets {
            Some(h) if h.id == of.id() => Targets::new(t).with_host(&h.values),
            _ => Targets::new(t),
        }
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
    /// use candle_models::model::Ctx;
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

    /// The same context with a reference model's values for the rows (see [`Ctx::reference`]).
    pub fn with_reference(self, reference: Option<Tensor>) -> Self {
        Ctx { reference, ..self }
    }
}

// The ops whose dropout the context keys (training mode, seed, first row).
impl Kernels {
    /// Causal self-attention of GPT-2's fused projection `qkv [B, T, 3C]` with `n_head` heads,
    /// dropout `p` on the attention probabilities (at dropout site `site`): `[B, T, C]`.
    pub fn causal_attention(self, qkv: &Tensor, n_head: usize, p: f32, ctx: &Ctx, site: u64) -> R {
        let t = qkv.dim(1)?;
        let p = if ctx.train { p } else { 0.0 };
        let mut cfg = AttentionConfig::causal();
        if p > 0.0 {
            // Keyed by the global row, like `dropout` (probabilities are [B, H, T, T]).
            let offset = (ctx.row * n_head * t * t) as u64;
            cfg = cfg.with_dropout(p, RngKey::new(ctx.seed, site).with_offset(offset));
        }
        match self {
            Kernels::Fused => attention::attention_qkv(qkv, n_head, &cfg),
            Kernels::Reference => attention::attention_qkv_composite(qkv, n_head, &cfg),
        }
    }

    /// Inverted dropout with a mask that is a pure function of `(ctx.seed, site)` and the
    /// element's index in the whole batch (`x`'s rows are rows `ctx.row..` of it, see
    /// [`Ctx::row`]): the same Philox mask on both kernels; `x` itself when not training or
    /// `p == 0`.
    pub fn dropout(self, x: &Tensor, p: f32, ctx: &Ctx, site: u64) -> R {
        if !ctx.train || p == 0.0 {
            return Ok(x.clone());
        }
        let row_len = x.elem_count() / x.dim(0)?.max(1);
        let key = RngKey::new(ctx.seed, site).with_offset((ctx.row * row_len) as u64);
        match self {
            Kernels::Fused => dropout::dropout(x, p, key),
            Kernels::Reference => dropout::dropout_composite(x, p, key),
        }
    }

    /// Causal grouped-query attention of `q [B, H, T, D]` over `k`, `v` `[B, KV, Tk, D]`
    /// (queries at the end of the keys), within `window` tokens and, given `doc_ids [B, Tk]`,
    /// within each token's document, scores scaled by `scale` (`None`: `1 / sqrt(D)`); dropout
    /// `p` on the probabilities at dropout site `site`. Returns `[B, T, H * D]` (heads merged).
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_attention(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
        scale: Option<f64>,
        doc_ids: Option<&Tensor>,
        p: f32,
        ctx: &Ctx,
        site: u64,
    ) -> R {
        let (h, t) = (q.dim(1)?, q.dim(2)?);
        let tk = k.dim(2)?;
        let mut cfg = AttentionConfig::causal();
        if let Some(w) = window {
            cfg = cfg.with_window(w);
        }
        if let Some(s) = scale {
            cfg = cfg.with_scale(s);
        }
        if let Some(ids) = doc_ids {
            cfg = cfg.with_doc_ids(ids.clone());
        }
        if p > 0.0 && ctx.train {
            // Keyed by the global row, like `dropout` (probabilities are [B, H, T, Tk]).
            let offset = (ctx.row * h * t * tk) as u64;
            cfg = cfg.with_dropout(p, RngKey::new(ctx.seed, site).with_offset(offset));
        }
        match self {
            Kernels::Fused => attention::attention_merged(q, k, v, &cfg),
            Kernels::Reference => attention::attention_merged_composite(q, k, v, &cfg),
        }
    }
}
