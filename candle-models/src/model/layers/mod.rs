//! The shared layers architectures are built from: LayerNorm and RMSNorm (`w` or Gemma's
//! `1 + w`), rotary grouped-query attention with its options (window, score scale),
//! the gated (SwiGLU or GeGLU) MLP, the pre-norm decoder block (Gemma's four norms an option), the token embedding and the head (a norm, then the projection to the vocabulary,
//! with a chunked loss), plus seeded dropout and the statistics dtype.
//!
//! An architecture module holds only what differs: its config, its `config.json` form and
//! how it puts these layers together (the Llama family is configuration of them alone).
//! Each layer's weights are walked once, by its `Weights::map`; the list of a layer's weights
//! is what that walk visits.

mod attention;
mod block;
#[cfg(test)]
mod block_nodes;
mod decoder;
pub(crate) mod head;
pub(crate) mod hf_decoder;
mod rms_norm;
mod rope;

use std::cell::RefCell;

use candle_core::{DType, Tensor};

use super::{Builder, Ctx, KvCache, WeightMap};
use crate::Result;

pub use attention::{Attention, BlockOptions, GateAct};
pub use block::{Block, GatedMlp};
pub use decoder::Decoder;
pub use head::Embed;
pub use rms_norm::RmsNorm;
pub use rope::RopeScaling;

/// A module's weights, walked once: [`Weights::map`] rebuilds the module over mapped weights
/// (in the order its structure declares them) and [`Weights::weights`] lists what that walk
/// visits, so the two never disagree.
pub(crate) trait Weights: Sized {
    /// The same module with every weight mapped by `f` (cast, copied to a device).
    fn map(&self, f: WeightMap) -> candle_core::Result<Self>;

    /// Every weight the module reads, in the order [`Weights::map`] visits them.
    fn weights(&self) -> Vec<Tensor> {
        let seen = RefCell::new(Vec::new());
        let visit = |t: &Tensor| {
            seen.borrow_mut().push(t.clone());
            Ok(t.clone())
        };
        // The identity map cannot fail on a built module; a walk that did would list fewer
        // weights, which the ownership check reports.
        let _ = Weights::map(self, &visit);
        seen.into_inner()
    }
}

/// What a link does over a key/value cache (evaluation): the embedding of tokens after the
/// cached ones, a block reading and extending the cache.
pub(crate) trait Cached {
    /// The link over new tokens `x`, `cache.len` tokens already in `cache`.
    fn cached(&self, x: &Tensor, cache: &mut KvCache, ctx: &Ctx) -> candle_core::Result<Tensor>;
}

/// Layer normalisation over the last dimension, with `candle-fused`'s kernel (or, with
/// `--kernels reference`, written from primitive ops; Candle's own fused `layer_norm` has no
/// backward). Statistics are computed in at least f32 (see `stat_dtype`); the output has the
/// input's dtype.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// Scale `[C]`.
    pub weight: Tensor,
    /// Shift `[C]`, if any.
    pub bias: Option<Tensor>,
    eps: f64,
}

impl LayerNorm {
    /// A LayerNorm with the given scale, optional shift and epsilon.
    pub fn new(weight: Tensor, bias: Option<Tensor>, eps: f64) -> Self {
        LayerNorm { weight, bias, eps }
    }

    /// The LayerNorm `b.weight [c]` (and `b.bias [c]` if `bias`).
    pub fn build(b: &Builder, c: usize, bias: bool, eps: f64) -> Result<Self> {
        Ok(LayerNorm::new(
            b.get(&[c], "weight")?,
            b.get_if(bias, &[c], "bias")?,
            eps,
        ))
    }

    /// The same LayerNorm with its tensors mapped by `f` (e.g. cast to a dtype).
    pub fn map(
        &self,
        f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(LayerNorm::new(
            f(&self.weight)?,
            self.bias.as_ref().map(&f).transpose()?,
            self.eps,
        ))
    }

    /// Normalises `x` and applies the affine transform, computing in `ctx.dtype`.
    pub fn forward_ctx(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let w = self.weight.to_dtype(x.dtype())?;
        let b = self
            .bias
            .as_ref()
            .map(|b| b.to_dtype(x.dtype()))
            .transpose()?;
        ctx.kernels.layer_norm(x, &w, b.as_ref(), self.eps)
    }
}

/// The dtype for numerically sensitive computations (softmax, normalisation statistics, the
/// loss): f32 for half-precision inputs, the input's own dtype otherwise (f32 or f64).
pub(crate) fn stat_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}
