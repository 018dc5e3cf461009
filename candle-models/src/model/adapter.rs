//! What a linear layer's weight and adapter are to the model: how the weight is stored
//! ([`Layout`]) and what may run the layer in its place ([`LinearAdapter`]). The [`Builder`]
//! hands adapters out by module path and every [`Linear`] runs them.
//!
//! [`Builder`]: super::Builder
//! [`Linear`]: super::Linear

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_fused::nf4::Nf4Weight;

use super::{Ctx, WeightMap};

/// What runs a linear layer in place of its plain `y = x W + b`: an adapter (a LoRA, say,
/// `x W + b + s B A x`), computing the whole output so that it can fuse the base GEMM with its
/// own. It owns its own parameters, which are not the layer's.
pub trait LinearAdapter: Send + Sync + std::fmt::Debug {
    /// The adapted layer's output for `x [.., in]`, the layer's weight `w` as an `[in, out]`
    /// view and its bias, all in `ctx.dtype`.
    fn forward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor>;

    /// The adapted layer's output over a frozen 4-bit weight `w [out, in]` (QLoRA) and its
    /// bias (in `compute`, the dtype the 4-bit product computes in: bitsandbytes'
    /// `bnb_4bit_compute_dtype`), in `x`'s dtype. By default the whole weight dequantized to
    /// `compute` and [`LinearAdapter::forward`] in `compute`; an adapter that can,
    /// dequantizes a tile at a time.
    fn forward_nf4(
        &self,
        x: &Tensor,
        w: &Nf4Weight,
        b: Option<&Tensor>,
        compute: DType,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let dense = w.dequantize(compute)?;
        let ctx = ctx.clone().with_dtype(compute);
        self.forward(&x.to_dtype(compute)?, &dense.t()?, b, &ctx)?
            .to_dtype(x.dtype())
    }

    /// The adapter's own parameters.
    fn params(&self) -> Vec<Tensor>;

    /// The same adapter with its parameters mapped by `f` (cast, copied to a device).
    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinearAdapter>>;
}

/// How the weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[in, out]`, `y = x W + b` (GPT-2's `Conv1D`).
    InOut,
    /// `[out, in]`, `y = x Wᵀ + b` (`torch.nn.Linear`).
    OutIn,
}
