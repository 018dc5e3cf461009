//! SwiGLU, the gated activation of Llama-family MLPs: `silu(gate) * up`, differentiable.
//!
//! With `s = sigmoid(g) = 1 / (1 + e^-g)`, elementwise:
//!
//! ```text
//! forward:   y      = g s u                          (silu(g) = g s)
//! backward:  d_gate = dy u s (1 + g (1 - s))         (silu'(g) = s (1 + g (1 - s)))
//!            d_up   = dy g s
//! ```
//!
//! One of the crate's gated ops (the other is [`crate::geglu`]): the forward reads `gate` and
//! `up` once and writes `y`; nothing is saved: the backward recomputes `s` from `gate` and
//! writes both gradients in one pass. `gate` and `up` may have any strides, e.g. the two halves
//! of one packed `[.., 2I]` projection (`h.narrow(D::Minus1, 0, I)`, `h.narrow(D::Minus1, I,
//! I)`): the kernel reads them in place, row by row. The gradients come back contiguous, in the
//! inputs' shape.
//!
//! **Precision**: 16-bit inputs are widened to f32, every product and the sigmoid run in f32,
//! and each output is rounded once. f32 (and 16-bit) kernels take `e^-g` from
//! [`exp_f32`](crate::gelu::exp_f32), the vectorising exponential of [`crate::gelu`] (< 1 ulp), so
//! `s` is within ~2 ulp of `1 / (1 + expf(-g))` and `y` within ~4 ulp of Candle's `silu(g) *
//! u`. Measured against an f64 reference on 64K random elements: 1.2e-7 of the largest `|y|`
//! (Candle's f32 `silu(g) * u`: 9.7e-8); the tests hold the kernel to 1e-6 of the f32
//! composite, values and gradients. The f64 kernel uses std's `exp`. No element depends on another: the same bits on any number of threads.
//!
//! On CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`), forward and
//! backward run the Triton kernels (`triton/swiglu.py`), which reproduce the CPU kernel bit for
//! bit; strided inputs (the halves of a packed projection) are copied to contiguous tensors
//! first. Otherwise CUDA computes [`swiglu_composite`]'s expression inside the op.

use crate::gated::{gated, gated_composite, Gate};
use candle_core::{Result, Tensor};

/// SwiGLU: `silu(gate) * up` elementwise (`silu(g) = g / (1 + e^-g)`), `gate` and `up` of one
/// shape, dtype and device, any strides (e.g. the two halves of one packed `[.., 2I]`
/// projection); the result is contiguous, in their shape and dtype.
///
/// Differentiable in `gate` and `up`. On the CPU a one-pass kernel each way (16-bit inputs
/// computed in f32, rounded once; nothing saved); on CUDA the Triton kernels when switched on
/// (the same bits); elsewhere [`swiglu_composite`]'s expression inside the same op.
///
/// ```
/// use candle_core::{Device, Tensor, Var, D};
/// use candle_fused::swiglu::{swiglu, swiglu_composite};
/// let h = Var::randn(0f32, 1.0, (2, 3, 2 * 8), &Device::Cpu)?; // a packed [gate | up] projection
/// let (gate, up) = (h.narrow(D::Minus1, 0, 8)?, h.narrow(D::Minus1, 8, 8)?);
/// let y = swiglu(&gate, &up)?;
/// let r = swiglu_composite(&gate, &up)?;
/// assert!((&y - r)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? < 1e-6);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&h).unwrap().dims(), &[2, 3, 16]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated(Gate::Silu, gate, up)
}

/// The reference of [`swiglu`] from plain differentiable Candle ops: `candle_nn::ops::silu(gate)
/// * up`, in f32 for 16-bit inputs (rounded once). Same arguments and result as [`swiglu`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// let gate = Tensor::new(&[0f64, 1., -30.], &Device::Cpu)?;
/// let up = Tensor::new(&[5f64, 2., 1.], &Device::Cpu)?;
/// let y = candle_fused::swiglu::swiglu_composite(&gate, &up)?.to_vec1::<f64>()?;
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 2.0 / (1.0 + (-1f64).exp())).abs() < 1e-15);
/// assert!(y[2].abs() < 1e-11);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_composite(Gate::Silu, "swiglu_composite", gate, up)
}
