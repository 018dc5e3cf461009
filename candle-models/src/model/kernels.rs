//! Which implementation of the model's ops runs: `candle-fused`'s kernels (the default) or
//! their composite Candle expressions, `candle-fused`'s `*_composite` references
//! (`--kernels reference`, for debugging and comparison).
//!
//! The model calls these methods and never branches on the choice itself; both paths compute
//! the same function with the same dropout masks (the fused kernels are checked against the
//! composite expressions in `candle-fused`'s tests, and the whole model in
//! `trainer/tests/kernels.rs`). The ops that draw dropout (attention, dropout itself) take
//! their keys from the forward context and are defined beside it, in `ctx.rs`.

use candle_core::{DType, Tensor};
use candle_data::named_enum;
use candle_fused::host::Targets;
use candle_fused::linear_cross_entropy as lce;
use candle_fused::{
    cross_entropy, embedding, geglu, linear, linear_add, linear_gelu, norm, rope, swiglu,
};
use serde::{Deserialize, Serialize};

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
    /// Runs `fused` or `reference`, by the choice.
    fn pick<T>(self, fused: impl FnOnce() -> T, reference: impl FnOnce() -> T) -> T {
        match self {
            Kernels::Fused => fused(),
            Kernels::Reference => reference(),
        }
    }

    /// The rows of the table `w [V, C]` at the token ids `idx` (u32, any shape):
    /// `[idx.dims.., C]`. Fused: `candle_fused::embedding`, whose backward sums each row of
    /// `dW` in f32 in ascending position, ordered from `host_ids` (the same ids on the host;
    /// `None`: read from `idx` once). Reference, and fused for an f32 / f64 table on the CPU:
    /// Candle's `index_select`, whose backward (`index_add`) adds the same rows in the same
    /// order in the table's dtype, but onto the gradient the table already has (a tied head's),
    /// row by row: the op would add its sums to it once, a last-bit change of every default
    /// (tied, f32, CPU) run.
    pub fn embedding(self, w: &Tensor, idx: &Tensor, host_ids: Option<&[u32]>) -> R {
        let exact_already = w.device().is_cpu() && matches!(w.dtype(), DType::F32 | DType::F64);
        match self {
            Kernels::Fused if !exact_already => embedding::embedding(w, idx, host_ids),
            _ => embedding::embedding_composite(w, idx),
        }
    }

    /// GPT-2's Conv1D: `x W + b` with `W: [in, out]`.
    pub fn linear(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        self.pick(
            || linear::linear(x, w, b),
            || linear::linear_composite(x, w, b),
        )
    }

    /// `r + (x W + b)`: a projection and the residual add after it, one op where there is no
    /// bias (`candle_fused::linear_add`; the same bits as the two).
    pub fn linear_add(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, r: &Tensor) -> R {
        self.pick(
            || linear_add::linear_add(x, w, b, r),
            || linear_add::linear_add_composite(x, w, b, r),
        )
    }

    /// `gelu(x W + b)` (tanh GELU): the MLP's first layer, bias and activation in one kernel.
    pub fn linear_gelu(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        self.pick(
            || linear_gelu::linear_gelu(x, w, b),
            || linear_gelu::linear_gelu_composite(x, w, b),
        )
    }

    /// LayerNorm over the last dimension; statistics in at least f32.
    pub fn layer_norm(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> R {
        self.pick(
            || norm::layer_norm(x, w, b, eps),
            || norm::layer_norm_composite(x, w, b, eps),
        )
    }

    /// Mean cross-entropy of `logits [.., V]` against `targets` (u32), over the positions where
    /// `mask` is 1 (all positions without a mask); computed in at least f32.
    pub fn cross_entropy(self, logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>) -> R {
        self.pick(
            || cross_entropy::cross_entropy(logits, targets, mask, None),
            || cross_entropy::cross_entropy_composite(logits, targets, mask, None),
        )
    }

    /// [`Kernels::cross_entropy`] over the targets that are not `ignore` (the loss mask folded
    /// into the targets, as PyTorch's `ignore_index`).
    pub fn cross_entropy_ignoring<'a>(
        self,
        logits: &Tensor,
        targets: impl Into<Targets<'a>>,
        ignore: u32,
    ) -> R {
        let targets = targets.into();
        self.pick(
            || cross_entropy::cross_entropy(logits, targets, None, Some(ignore)),
            || cross_entropy::cross_entropy_composite(logits, targets, None, Some(ignore)),
        )
    }
}

// The Llama family's ops.
impl Kernels {
    /// RMSNorm over the last dimension; statistics in at least f32.
    pub fn rms_norm(self, x: &Tensor, w: &Tensor, eps: f64) -> R {
        self.pick(
            || norm::rms_norm(x, w, eps),
            || norm::rms_norm_composite(x, w, eps),
        )
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
        self.pick(
            || rope::rope(x, cos, sin),
            || rope::rope_composite(x, cos, sin),
        )
    }

    /// `silu(gate) * up`.
    pub fn swiglu(self, gate: &Tensor, up: &Tensor) -> R {
        self.pick(
            || swiglu::swiglu(gate, up),
            || swiglu::swiglu_composite(gate, up),
        )
    }

    /// `gelu_tanh(gate) * up` (GeGLU, Gemma's MLP).
    pub fn geglu(self, gate: &Tensor, up: &Tensor) -> R {
        self.pick(
            || geglu::geglu(gate, up),
            || geglu::geglu_composite(gate, up),
        )
    }

    /// Cross-entropy of the logits `x [N, C] wᵀ` (`w [V, C]`) against `targets [N]`, ignoring
    /// `ignore`: the mean over the counted targets, or with `per_token` the loss of each target
    /// (`[N]`, 0 where it is `ignore`), differentiable for any upstream gradient. Fused, a chunk
    /// of rows at a time without the `[N, V]` logits (the gradients computed on the way);
    /// reference, the whole logits and the composite loss.
    pub fn linear_cross_entropy<'a>(
        self,
        x: &Tensor,
        w: &Tensor,
        targets: impl Into<Targets<'a>>,
        ignore: u32,
        per_token: bool,
    ) -> R {
        let (t, ignore) = (targets.into(), Some(ignore));
        match (self, per_token) {
            (Kernels::Fused, false) => lce::linear_cross_entropy(x, w, t, ignore),
            (Kernels::Reference, false) => lce::linear_cross_entropy_composite(x, w, t, ignore),
            (Kernels::Fused, true) => lce::linear_cross_entropy_per_token(x, w, t, ignore),
            (Kernels::Reference, true) => {
                lce::linear_cross_entropy_per_token_composite(x, w, t, ignore)
            }
        }
    }
}
