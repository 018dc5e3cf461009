//! GeGLU, the gated activation of Gemma's MLPs: `gelu_tanh(gate) * up`, differentiable.
//!
//! `gelu_tanh` is GPT-2's tanh approximation, exactly as [`crate::gelu::gelu`] computes it
//! (transformers' `gelu_pytorch_tanh`, torch's `gelu(x, approximate="tanh")`). With `t =
//! tanh(K0 (g + K1 g^3))`, `K0 = sqrt(2/pi)`, `K1 = 0.044715`, elementwise:
//!
//! ```text
//! forward:   y      = gelu(g) u                     (gelu(g) = 0.5 g (1 + t))
//! backward:  d_gate = dy u gelu'(g)                 (gelu'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) K0 (1 + 3 K1 g^2))
//!            d_up   = dy gelu(g)
//! ```
//!
//! The same op as [`crate::swiglu`] with another activation: one pass each way, nothing saved
//! (the backward recomputes `gelu` and `gelu'` from `gate`), `gate` and `up` read in place
//! through their strides (the halves of a packed `[.., 2I]` projection), the gradients
//! contiguous.
//!
//! **Precision**: 16-bit inputs are widened to f32 and each output rounded once; the f32 (and
//! 16-bit) kernels take `tanh` from [`tanh_f32`](crate::gelu::tanh_f32) (<= 1.5 ulp), so they
//! are the bits of [`crate::gelu::gelu`]'s kernel times `up`; against the composite (Candle's
//! `tanh`) the tests allow 1e-5 of the largest value (f32), two units of the format's rounding
//! (bf16 / f16). The f64 kernel uses std's `tanh`.
//!
//! On CUDA with the Triton kernels switched on, forward and backward run the `geglu_*` kernels
//! of `triton/gelu.py` (the CPU kernel's bits; not yet run on a GPU, so only with
//! `cuda_kernels::UNPROVEN_ENV` set); otherwise CUDA computes [`geglu_composite`]'s expression
//! inside the op.

use crate::gated::{gated, gated_composite, Gate};
use candle_core::{Result, Tensor};

/// GeGLU: `gelu_tanh(gate) * up` elementwise, `gate` and `up` of one shape, dtype and device,
/// any strides; the result is contiguous, in their shape and dtype. The contract of
/// [`crate::swiglu::swiglu`], with the tanh GELU of [`crate::gelu::gelu`] for `silu`.
///
/// ```
/// use candle_core::{Device, Tensor, Var, D};
/// use candle_fused::geglu::{geglu, geglu_composite};
/// let h = Var::randn(0f32, 1.0, (2, 3, 2 * 8), &Device::Cpu)?; // a packed [gate | up] projection
/// let (gate, up) = (h.narrow(D::Minus1, 0, 8)?, h.narrow(D::Minus1, 8, 8)?);
/// let y = geglu(&gate, &up)?;
/// let r = geglu_composite(&gate, &up)?;
/// assert!((&y - r)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? < 1e-5);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&h).unwrap().dims(), &[2, 3, 16]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated(Gate::GeluTanh, gate, up)
}

/// The reference of [`geglu`] from plain differentiable Candle ops:
/// [`gelu_composite`](crate::gelu::gelu_composite)`(gate) * up`, in f32 for 16-bit inputs
/// (rounded once). Same arguments and result as [`geglu`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// let gate = Tensor::new(&[0f64, 1., -30.], &Device::Cpu)?;
/// let up = Tensor::new(&[5f64, 2., 1.], &Device::Cpu)?;
/// let y = candle_fused::geglu::geglu_composite(&gate, &up)?.to_vec1::<f64>()?;
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 2.0 * 0.841_191_990_607_859_2).abs() < 1e-12);
/// assert_eq!(y[2], 0.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn geglu_composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_composite(Gate::GeluTanh, "geglu_composite", gate, up)
}
