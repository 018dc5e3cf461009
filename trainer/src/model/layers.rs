//! Differentiable building blocks: Conv1D, LayerNorm, seeded dropout and the causal mask.

use candle_core::{DType, Device, Tensor, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Ctx;

/// GPT-2's "Conv1D": a linear layer whose weight is stored `[in, out]` (`y = x W + b`).
#[derive(Clone, Debug)]
pub struct Conv1D {
    /// `[in, out]`.
    pub weight: Tensor,
    /// `[out]`, if the layer has a bias.
    pub bias: Option<Tensor>,
}

impl Conv1D {
    /// Wraps a weight `[in, out]` and an optional bias `[out]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Conv1D { weight, bias }
    }

    /// `[.., in] -> [.., out]`, computing in `ctx.dtype`.
    pub fn forward_ctx(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let y = x.broadcast_matmul(&self.weight.to_dtype(ctx.dtype)?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(ctx.dtype)?),
            None => Ok(y),
        }
    }
}

/// Layer normalisation over the last dimension, written from primitive ops so it has a
/// backward (Candle's fused `layer_norm` has none). Statistics are computed in at least f32
/// (see [`stat_dtype`]); the output has the input's dtype.
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

    /// Normalises `x` and applies the affine transform, computing in `ctx.dtype`.
    pub fn forward_ctx(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(stat_dtype(dtype))?;
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let xhat = xc
            .broadcast_div(&(var + self.eps)?.sqrt()?)?
            .to_dtype(dtype)?;
        let y = xhat.broadcast_mul(&self.weight.to_dtype(ctx.dtype)?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(ctx.dtype)?),
            None => Ok(y),
        }
    }
}

/// The dtype for numerically sensitive computations (softmax, normalisation statistics, the
/// loss): f32 for half-precision inputs, the input's own dtype otherwise (f32 or f64).
pub fn stat_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// Additive causal mask `[T, T]` in f32: 0 on and below the diagonal, -inf above.
pub fn causal_mask(t: usize, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (t, t), device)
}

/// Inverted dropout with a mask drawn from a host RNG seeded by `(ctx.seed, site)`.
///
/// The same `(seed, site)` and shape always give the same mask, on every device. Returns `x`
/// unchanged when not training or when `p == 0`.
pub fn dropout(x: &Tensor, p: f32, ctx: &Ctx, site: u64) -> candle_core::Result<Tensor> {
    if !ctx.train || p == 0.0 {
        return Ok(x.clone());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(ctx.seed);
    rng.set_stream(site);
    let keep = 1.0 / (1.0 - p);
    let n = x.elem_count();
    let mask: Vec<f32> = (0..n)
        .map(|_| if rng.random::<f32>() < p { 0.0 } else { keep })
        .collect();
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * mask
}
