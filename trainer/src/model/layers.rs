//! Differentiable building blocks: Conv1D, LayerNorm, seeded dropout and the causal mask.

use candle_core::{DType, Device, Tensor};
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
        let (w, b) = self.cast(ctx)?;
        ctx.kernels.linear(x, &w, b.as_ref())
    }

    /// `gelu([.., in] W + b)` (tanh GELU), the bias and activation fused.
    pub fn forward_gelu(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let (w, b) = self.cast(ctx)?;
        ctx.kernels.linear_gelu(x, &w, b.as_ref())
    }

    /// Weight and bias in the compute dtype (free when they already are: the trainer casts
    /// the whole model once per step, [`super::Gpt::to_dtype`]).
    fn cast(&self, ctx: &Ctx) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let w = self.weight.to_dtype(ctx.dtype)?;
        let b = self
            .bias
            .as_ref()
            .map(|b| b.to_dtype(ctx.dtype))
            .transpose()?;
        Ok((w, b))
    }
}

/// Layer normalisation over the last dimension, with `candle-fused`'s kernel (or, with
/// `--kernels reference`, written from primitive ops; Candle's own fused `layer_norm` has no
/// backward). Statistics are computed in at least f32 (see [`stat_dtype`]); the output has the
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

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
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

/// Inverted dropout at dropout site `site`, with the kernels of `ctx` (Philox masks for the
/// fused kernels, ChaCha host masks for the reference ones).
///
/// The same `(ctx.seed, site)` and shape always give the same mask, on every device. Returns
/// `x` unchanged when not training or when `p == 0`.
pub fn dropout(x: &Tensor, p: f32, ctx: &Ctx, site: u64) -> candle_core::Result<Tensor> {
    ctx.kernels.dropout(x, p, ctx, site)
}

/// The reference path's dropout: a mask drawn element by element from a host ChaCha8 stream
/// seeded by `(seed, site)`.
pub fn chacha_dropout(x: &Tensor, p: f32, seed: u64, site: u64) -> candle_core::Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(site);
    let keep = 1.0 / (1.0 - p);
    let n = x.elem_count();
    let mask: Vec<f32> = (0..n)
        .map(|_| if rng.random::<f32>() < p { 0.0 } else { keep })
        .collect();
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * mask
}
