//! Precision policy: which computations stay in f32 while the rest runs in f16/bf16.
//!
//! A model holds a [`PrecisionPolicy`] and routes the precision-sensitive operations through
//! it: weights through [`weight`](PrecisionPolicy::weight), inputs through
//! [`cast`](PrecisionPolicy::cast), attention probabilities through
//! [`softmax`](PrecisionPolicy::softmax), normalisation through
//! [`layer_norm`](PrecisionPolicy::layer_norm)/[`rms_norm`](PrecisionPolicy::rms_norm) and
//! the loss through [`cross_entropy`](PrecisionPolicy::cross_entropy). Matmuls and
//! elementwise ops run in whatever dtype their inputs have, i.e. the compute dtype. Every
//! helper is built from differentiable Candle ops, upcasts to f32 when the policy says so,
//! and returns the input's dtype (the loss helper returns f32 when `loss_f32` is set).
//!
//! ```
//! use candle_amp::PrecisionPolicy;
//! use candle_core::{DType, Device, Tensor, D};
//! let p = PrecisionPolicy::mixed(DType::F16);
//! let w = Tensor::ones((4, 4), DType::F32, &Device::Cpu)?; // f32 master
//! let x = p.cast(&Tensor::ones((2, 4), DType::F32, &Device::Cpu)?)?;
//! let h = x.matmul(&p.weight(&w)?)?; // f16 matmul
//! let probs = p.softmax(&h, D::Minus1)?; // computed in f32, returned as f16
//! assert_eq!(probs.dtype(), DType::F16);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{DType, Result, Tensor, D};

/// Which computations stay in f32. Construct with [`mixed`](Self::mixed) (all guards on),
/// [`pure`](Self::pure) (none) or [`full_f32`](Self::full_f32), then adjust with setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrecisionPolicy {
    /// dtype of weights and activations in matmuls and elementwise ops.
    pub compute_dtype: DType,
    /// Compute softmax / log-softmax in f32 (large logits overflow `exp` in f16).
    pub softmax_f32: bool,
    /// Compute normalisation statistics (mean, variance) in f32.
    pub norm_f32: bool,
    /// Compute the loss in f32 and return it as f32.
    pub loss_f32: bool,
    /// Compute sums and means over many elements in f32.
    pub reductions_f32: bool,
}

impl PrecisionPolicy {
    /// Mixed precision: compute in `compute_dtype`, keep softmax, norms, loss and reductions
    /// in f32.
    pub fn mixed(compute_dtype: DType) -> Self {
        Self {
            compute_dtype,
            softmax_f32: true,
            norm_f32: true,
            loss_f32: true,
            reductions_f32: true,
        }
    }

    /// Everything in `compute_dtype`, no f32 islands (the naive baseline).
    pub fn pure(compute_dtype: DType) -> Self {
        Self {
            compute_dtype,
            softmax_f32: false,
            norm_f32: false,
            loss_f32: false,
            reductions_f32: false,
        }
    }

    /// Plain f32 training.
    pub fn full_f32() -> Self {
        Self::mixed(DType::F32)
    }

    /// Sets whether softmax runs in f32.
    pub fn with_softmax_f32(mut self, on: bool) -> Self {
        self.softmax_f32 = on;
        self
    }

    /// Sets whether normalisation statistics run in f32.
    pub fn with_norm_f32(mut self, on: bool) -> Self {
        self.norm_f32 = on;
        self
    }

    /// Sets whether the loss runs in f32.
    pub fn with_loss_f32(mut self, on: bool) -> Self {
        self.loss_f32 = on;
        self
    }

    /// Sets whether reductions run in f32.
    pub fn with_reductions_f32(mut self, on: bool) -> Self {
        self.reductions_f32 = on;
        self
    }

    /// Casts an activation to the compute dtype.
    pub fn cast(&self, x: &Tensor) -> Result<Tensor> {
        x.to_dtype(self.compute_dtype)
    }

    /// Casts a (master) weight to the compute dtype; differentiable, so an f32 master
    /// receives an f32 gradient.
    pub fn weight(&self, w: &Tensor) -> Result<Tensor> {
        w.to_dtype(self.compute_dtype)
    }

    fn up(x: &Tensor, on: bool) -> Result<Tensor> {
        if on {
            x.to_dtype(DType::F32)
        } else {
            Ok(x.clone())
        }
    }

    /// Differentiable softmax over `dim` (f32 inside if `softmax_f32`), in `x`'s dtype.
    pub fn softmax<I: candle_core::shape::Dim>(&self, x: &Tensor, dim: I) -> Result<Tensor> {
        candle_nn::ops::softmax(&Self::up(x, self.softmax_f32)?, dim)?.to_dtype(x.dtype())
    }

    /// Differentiable log-softmax over `dim` (f32 inside if `softmax_f32`), in `x`'s dtype.
    pub fn log_softmax<I: candle_core::shape::Dim>(&self, x: &Tensor, dim: I) -> Result<Tensor> {
        candle_nn::ops::log_softmax(&Self::up(x, self.softmax_f32)?, dim)?.to_dtype(x.dtype())
    }

    /// Layer norm over the last dimension, `(x - mean) / sqrt(var + eps) * gamma + beta`,
    /// statistics in f32 if `norm_f32`; returns `x`'s dtype.
    pub fn layer_norm(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let xs = Self::up(x, self.norm_f32)?;
        let dt = xs.dtype();
        let mean = xs.mean_keepdim(D::Minus1)?;
        let xc = xs.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
        let y = y.broadcast_mul(&gamma.to_dtype(dt)?)?;
        let y = match beta {
            Some(b) => y.broadcast_add(&b.to_dtype(dt)?)?,
            None => y,
        };
        y.to_dtype(x.dtype())
    }

    /// RMS norm over the last dimension, `x / sqrt(mean(x^2) + eps) * gamma`, statistics in
    /// f32 if `norm_f32`; returns `x`'s dtype.
    pub fn rms_norm(&self, x: &Tensor, gamma: &Tensor, eps: f64) -> Result<Tensor> {
        let xs = Self::up(x, self.norm_f32)?;
        let dt = xs.dtype();
        let ms = xs.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xs.broadcast_div(&(ms + eps)?.sqrt()?)?;
        y.broadcast_mul(&gamma.to_dtype(dt)?)?.to_dtype(x.dtype())
    }

    /// Mean cross-entropy of `logits` `(N, C)` against class indices `targets` `(N,)`; in f32
    /// (and returned as f32) if `loss_f32`, else in the logits' dtype.
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = Self::up(logits, self.loss_f32)?;
        candle_nn::loss::cross_entropy(&logits, targets)
    }

    /// Sum over `dim` keeping it (f32 inside if `reductions_f32`), in `x`'s dtype.
    pub fn sum_keepdim<I: candle_core::shape::Dim>(&self, x: &Tensor, dim: I) -> Result<Tensor> {
        Self::up(x, self.reductions_f32)?
            .sum_keepdim(dim)?
            .to_dtype(x.dtype())
    }

    /// Mean over `dim` keeping it (f32 inside if `reductions_f32`), in `x`'s dtype.
    pub fn mean_keepdim<I: candle_core::shape::Dim>(&self, x: &Tensor, dim: I) -> Result<Tensor> {
        Self::up(x, self.reductions_f32)?
            .mean_keepdim(dim)?
            .to_dtype(x.dtype())
    }
}
