//! Which implementation of the model's ops runs: `candle-fused`'s kernels (the default) or
//! their composite Candle expressions, `candle-fused`'s `*_composite` references
//! (`--kernels reference`, for debugging and comparison).
//!
//! The model calls these methods and never branches on the choice itself; both paths compute
//! the same function with the same dropout masks (the fused kernels are checked against the
//! composite expressions in `candle-fused`'s tests, and the whole model in
//! `trainer/tests/kernels.rs`).

use candle_core::Tensor;
use candle_fused::attention::{self, AttentionConfig};
use candle_fused::linear_cross_entropy as lce;
use candle_fused::{cross_entropy, dropout, linear, linear_gelu, norm, rope, swiglu, RngKey};
use serde::{Deserialize, Serialize};

use super::Ctx;

/// The implementation of the model's ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// `candle-fused`: flash-style attention, one-pass LayerNorm, bias+GELU, fused
    /// cross-entropy and Philox dropout, each with its own backward kernel.
    #[default]
    Fused,
    /// `candle-fused`'s composite Candle expressions (primitive softmax, LayerNorm from ~8
    /// ops, the same Philox dropout masks drawn on the host): slower and heavier, kept as the
    /// reference.
    Reference,
}

named_enum!(Kernels, "kernels must be fused or reference", {
    Fused => "fused",
    Reference => "reference",
});

type R = candle_core::Result<Tensor>;

impl Kernels {
    /// GPT-2's Conv1D: `x W + b` with `W: [in, out]`.
    pub fn linear(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => linear::linear(x, w, b),
            Kernels::Reference => linear::linear_composite(x, w, b),
        }
    }

    /// `gelu(x W + b)` (tanh GELU): the MLP's first layer, bias and activation in one kernel.
    pub fn linear_gelu(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => linear_gelu::linear_gelu(x, w, b),
            Kernels::Reference => linear_gelu::linear_gelu_composite(x, w, b),
        }
    }

    /// LayerNorm over the last dimension; statistics in at least f32.
    pub fn layer_norm(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> R {
        match self {
            Kernels::Fused => norm::layer_norm(x, w, b, eps),
            Kernels::Reference => norm::layer_norm_composite(x, w, b, eps),
        }
    }

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

    /// Mean cross-entropy of `logits [.., V]` against `targets` (u32), over the positions where
    /// `mask` is 1 (all positions without a mask); computed in at least f32.
    pub fn cross_entropy(self, logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => cross_entropy::cross_entropy(logits, targets, mask, None),
            Kernels::Reference => {
                cross_entropy::cross_entropy_composite(logits, targets, mask, None)
            }
        }
    }

    /// [`Kernels::cross_entropy`] over the targets that are not `ignore` (the loss mask folded
    /// into the targets, as PyTorch's `ignore_index`).
    pub fn cross_entropy_ignoring(self, logits: &Tensor, targets: &Tensor, ignore: u32) -> R {
        match self {
            Kernels::Fused => cross_entropy::cross_entropy(logits, targets, None, Some(ignore)),
            Kernels::Reference => {
                cross_entropy::cross_entropy_composite(logits, targets, None, Some(ignore))
            }
        }
    }
}

// The Llama family's ops.
impl Kernels {
    /// RMSNorm over the last dimension; statistics in at least f32.
    pub fn rms_norm(self, x: &Tensor, w: &Tensor, eps: f64) -> R {
        match self {
            Kernels::Fused => norm::rms_norm(x, w, eps),
            Kernels::Reference => norm::rms_norm_composite(x, w, eps),
        }
    }

    /// RoPE tables `cos`, `sin` `[B, T, D/2]` (f32) of `positions [B, T]` (u32) and
    /// `inv_freq [D/2]` (f32), as transformers computes them (the same for both kernels).
    pub fn rope_tables(
        self,
        positions: &Tensor,
        inv_freq: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        rope::rope_tables(positions, inv_freq)
    }

    /// RoPE in transformers' split-halves convention of `x [B, T, H, D]`, returned as
    /// `[B, H, T, D]` (ready for attention).
    pub fn rope(self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> R {
        match self {
            Kernels::Fused => rope::rope(x, cos, sin),
            Kernels::Reference => rope::rope_composite(x, cos, sin),
        }
    }

    /// `silu(gate) * up`.
    pub fn swiglu(self, gate: &Tensor, up: &Tensor) -> R {
        match self {
            Kernels::Fused => swiglu::swiglu(gate, up),
            Kernels::Reference => swiglu::swiglu_composite(gate, up),
        }
    }

    /// Causal grouped-query attention of `q [B, H, T, D]` over `k`, `v` `[B, KV, Tk, D]`
    /// (queries at the end of the keys), within `window` tokens and, given `doc_ids [B, Tk]`,
    /// within each token's document; dropout `p` on the probabilities at dropout site `site`.
    /// Returns `[B, T, H * D]` (heads merged).
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_attention(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
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

    /// Mean cross-entropy of the logits `x [N, C] wᵀ` (`w [V, C]`) against `targets [N]`,
    /// ignoring `ignore`: fused, a chunk of rows at a time without the `[N, V]` logits (the
    /// gradients computed on the way); reference, the whole logits and the composite loss.
    pub fn linear_cross_entropy(self, x: &Tensor, w: &Tensor, targets: &Tensor, ignore: u32) -> R {
        match self {
            Kernels::Fused => lce::linear_cross_entropy(x, w, targets, Some(ignore)),
            Kernels::Reference => lce::linear_cross_entropy_composite(x, w, targets, Some(ignore)),
        }
    }

    /// [`Kernels::linear_cross_entropy`] before the mean: the loss of each target (`[N]`, 0
    /// where it is `ignore`), differentiable for any upstream gradient.
    pub fn linear_cross_entropy_per_token(
        self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        ignore: u32,
    ) -> R {
        match self {
            Kernels::Fused => lce::linear_cross_entropy_per_token(x, w, targets, Some(ignore)),
            Kernels::Reference => {
                lce::linear_cross_entropy_per_token_composite(x, w, targets, Some(ignore))
            }
        }
    }
}
