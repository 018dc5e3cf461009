//! `gelu(x W + b)`: GPT-2's MLP up-projection and its activation as one differentiable op.
//!
//! As two ops ([`crate::linear::linear`], then [`crate::gelu::bias_gelu`]) the pre-activation
//! `x W` is a graph node of its own, and Candle's backward gives every node a zeroed gradient
//! buffer and adds into it: a `[N, 4C]` memset and add per layer that nothing needs. Here one op
//! runs the GEMM, keeps `x W` for its backward (the two ops kept it too, as that node) and
//! applies bias + GELU; the backward turns the upstream gradient into the GELU's input
//! gradient and hands it straight to the two GEMMs.
//!
//! The arithmetic is that of the two ops, step for step: the same GEMM without the bias, the
//! same rounding to the storage type, `gelu(z + b)` and its gradient from the same kernels, the
//! bias gradient over the same row blocks. So values and gradients are bit-identical to
//! `bias_gelu(&linear(x, w, None)?, b)` (checked by the tests), on every thread count. Devices
//! without a kernel compute exactly that pair of ops.

use crate::cpu::{self, Elem};
use crate::op::{self, cpu_of, Grads, In, Kernel, Saved};
use crate::{gelu, linear};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Result, Shape, Tensor};

/// `gelu(x [.., in] · w [in, out] + b [out])` (tanh GELU; `b` optional), `[.., out]`.
///
/// `w` may be any 2-D view (e.g. `w.t()` of a `[out, in]` weight), as for
/// [`linear`](crate::linear::linear).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::{gelu::bias_gelu, linear::linear, linear_gelu::linear_gelu};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 4), &dev)?;
/// let w = Var::randn(0f32, 1.0, (4, 16), &dev)?;
/// let b = Var::randn(0f32, 1.0, 16, &dev)?;
/// let y = linear_gelu(&x, &w, Some(&b))?;
/// let two_ops = bias_gelu(&linear(&x, &w, None)?, Some(&b))?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, two_ops.flatten_all()?.to_vec1::<f32>()?);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&w).unwrap().dims(), &[4, 16]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (n_in, n_out) = linear::check(x, w, b)?;
    let x = x.contiguous()?;
    if !cpu::has_kernel(&x) || x.elem_count() == 0 || n_out == 0 {
        return gelu::bias_gelu(&linear::linear(&x, w, None)?, b);
    }
    let op = LinearGeluOp {
        n_in,
        n_out,
        z: Saved::default(),
    };
    let b = b.map(Tensor::contiguous).transpose()?;
    op::apply(op, &[&x, w], b.as_ref(), None)
}

/// The composite reference of [`linear_gelu`]: [`gelu::bias_gelu_composite`] of
/// [`linear::linear_composite`] without the bias.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::linear_gelu::{linear_gelu, linear_gelu_composite};
/// let x = Tensor::randn(0f64, 1.0, (3, 4), &Device::Cpu)?;
/// let w = Tensor::randn(0f64, 1.0, (4, 8), &Device::Cpu)?;
/// let b = Tensor::randn(0f64, 1.0, 8, &Device::Cpu)?;
/// let d = (linear_gelu(&x, &w, Some(&b))? - linear_gelu_composite(&x, &w, Some(&b))?)?;
/// assert!(d.abs()?.max_all()?.to_scalar::<f64>()? < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_gelu_composite(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear::check(x, w, b)?;
    gelu::bias_gelu_composite(&linear::linear_composite(x, w, None)?, b)
}

/// `(x, w)` or `(x, w, b)`; `z` holds `x W` (storage type, no bias) for the backward. It runs
/// only where [`cpu::has_kernel`] holds (other devices take the two-op path).
struct LinearGeluOp {
    n_in: usize,
    n_out: usize,
    z: Saved,
}

impl Kernel for LinearGeluOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear-gelu"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sx, lx), (sw, lw), b) = (ins[0], ins[1], ins.get(2));
        let shape = linear::out_shape(lx, self.n_out);
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let w = linear::strided::<T>(sw, lw)?;
            let z = linear::fwd_kernel(xs, w, None, self.n_in, self.n_out);
            let bs = b.map(|(s, l)| cpu::contiguous::<T>(s, l)).transpose()?;
            let y = gelu::fwd_kernel(&z, bs, self.n_out);
            self.z.set(cpu::tensor(z, shape.clone())?);
            Ok((T::storage(y), shape))
        })
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (x, w, b) = (ins[0], ins[1], ins.get(2));
        let need = [x.track_op(), w.track_op(), b.is_some_and(|b| b.track_op())];
        let (n_in, n_out) = (self.n_in, self.n_out);
        let z = self.z.get()?;
        let x = x.contiguous()?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let b = b.map(|b| b.contiguous()).transpose()?;
        cpu::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&x, |xs| {
                cpu::with_slice::<T, _>(&z, |zs| {
                    cpu::with_slice::<T, _>(&dy, |dys| {
                        // The GELU's input gradient (and the bias's), as `bias_gelu` computes it.
                        let (dz, db) = match &b {
                            Some(b) => cpu::with_slice::<T, _>(b, |bs| {
                                Ok(gelu::bwd_kernel(zs, Some(bs), dys, n_out, need[2]))
                            })?,
                            None => gelu::bwd_kernel(zs, None, dys, n_out, false),
                        };
                        let (sw, lw) = w.storage_and_layout();
                        let ws = linear::strided::<T>(cpu_of(&sw)?, lw)?;
                        let g = linear::bwd_kernel(xs, ws, &dz, n_in, n_out, [need[0], need[1], false]);
                        let dx = g.dx.map(|v| cpu::tensor(v, x.shape())).transpose()?;
                        let dw = g.dw.map(|v| cpu::tensor(v, (n_in, n_out))).transpose()?;
                        let db = db.map(|v| cpu::tensor(v, n_out)).transpose()?;
                        Ok([dx, dw, db])
                    })
                })
            })
        })
    }
}
