//! `r + x W`: a bias-free projection and the residual add after it as one differentiable op.
//!
//! A pre-norm block ends both halves with `x + proj(..)`. As two ops the projection's output
//! is a graph node of its own, and Candle's backward gives that node a zeroed gradient buffer
//! and adds the upstream gradient into it before the projection's backward can read it: a
//! `[N, C]` memset, an add and two allocations per residual per step that nothing needs. Here
//! the op takes the residual `r` as its third input: the forward runs the GEMM and adds `r` in
//! the same pass over the output, and the backward hands the upstream gradient to the two GEMMs
//! (`dx = dy Wᵀ`, `dW = xᵀ dy`) and, unchanged, to `r` (`dr = dy`).
//!
//! The arithmetic is that of the two ops, step for step: [`linear()`]'s GEMM, its rounding of
//! `x W` to the storage type, then the add in the storage type (16-bit values widened to f32,
//! added, rounded once, as Candle's add does). So values and gradients are bit-identical to
//! `(linear(x, w, None)? + r)?` on every dtype and thread count (checked by the tests).
//!
//! **Where it does not fuse** (and runs exactly those two ops): with a bias (`x W + b` and
//! `r` are four inputs, and a Candle graph node takes at most three), under
//! [`with_composite_fallback`](crate::with_composite_fallback), on devices with no kernel
//! (Metal), and for empty inputs. On CUDA the forward is Candle's cuBLAS GEMM (as
//! [`linear()`]'s) followed by Candle's add kernel on the storages, so only the backward's memset
//! and add go.

use crate::cpu::{self, Elem};
use crate::linear::{self, gemm::narrow, linear, LinearOp};
use crate::op::{self, Grads, In, Kernel};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Result, Shape, Tensor};

/// `r + x [.., in] · w [in, out] + b [out]` (`b` optional), `[.., out]`, `r` of the output's
/// shape: the residual add of a pre-norm block after its projection.
///
/// Without a bias, one op (see the [module docs](self)); with one, [`linear()`] then the add.
/// Either way the result and gradients have the bits of `(linear(x, w, b)? + r)?`. `w` may be
/// any 2-D view, as for [`linear()`].
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::{linear::linear, linear_add::linear_add};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 4), &dev)?;
/// let w = Var::randn(0f32, 1.0, (5, 4), &dev)?; // [out, in]
/// let r = Var::randn(0f32, 1.0, (2, 3, 5), &dev)?;
/// let y = linear_add(&x, &w.t()?, None, &r)?;
/// let two_ops = (linear(&x, &w.t()?, None)? + r.as_tensor())?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, two_ops.flatten_all()?.to_vec1::<f32>()?);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&r).unwrap().dims(), &[2, 3, 5]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_add(x: &Tensor, w: &Tensor, b: Option<&Tensor>, r: &Tensor) -> Result<Tensor> {
    let (n_in, n_out) = check(x, w, b, r)?;
    let x = x.contiguous()?;
    let cuda = cfg!(feature = "cuda") && x.device().is_cuda();
    if b.is_some() || !(cpu::has_kernel(&x) || cuda) || x.elem_count() == 0 || n_out == 0 {
        return linear(&x, w, b)? + r;
    }
    let r = r.contiguous()?;
    op::apply(
        LinearAddOp(LinearOp { n_in, n_out }),
        &[&x, w, &r],
        None,
        None,
    )
}

/// The composite reference of [`linear_add`]: `r +` [`linear::linear_composite`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::linear_add::{linear_add, linear_add_composite};
/// let x = Tensor::randn(0f64, 1.0, (3, 4), &Device::Cpu)?;
/// let w = Tensor::randn(0f64, 1.0, (4, 8), &Device::Cpu)?;
/// let r = Tensor::randn(0f64, 1.0, (3, 8), &Device::Cpu)?;
/// let d = (linear_add(&x, &w, None, &r)? - linear_add_composite(&x, &w, None, &r)?)?;
/// assert!(d.abs()?.max_all()?.to_scalar::<f64>()? < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_add_composite(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    r: &Tensor,
) -> Result<Tensor> {
    check(x, w, b, r)?;
    r + linear::linear_composite(x, w, b)?
}

/// [`linear::check`], and `r` of the output's shape, dtype and device.
fn check(x: &Tensor, w: &Tensor, b: Option<&Tensor>, r: &Tensor) -> Result<(usize, usize)> {
    let (n_in, n_out) = linear::check(x, w, b)?;
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = n_out;
    }
    if r.dims() != dims {
        bail!(
            "candle-fused linear_add: residual {:?} must have the output's shape {dims:?}",
            r.dims()
        );
    }
    op::check_like("candle-fused linear_add", ("residual", r), ("input", x))?;
    Ok((n_in, n_out))
}

/// `(x, w, r)`, all contiguous but `w`; no bias.
struct LinearAddOp(LinearOp);

impl Kernel for LinearAddOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear-add"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sx, lx), (sw, lw), (sr, lr)) = (ins[0], ins[1], ins[2]);
        let LinearOp { n_in, n_out } = self.0;
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let rs = cpu::contiguous::<T>(sr, lr)?;
            let w = linear::strided::<T>(sw, lw)?;
            let mut y = linear::fwd_acc(xs, w, None, n_in, n_out);
            // `x W` rounded to T (as `linear` returns it), then `+ r` rounded again (as
            // Candle's add): a no-op round trip for f32 / f64.
            for (v, r) in y.iter_mut().zip(rs) {
                *v = T::from_acc(*v).acc() + r.acc();
            }
            Ok((T::storage(narrow::<T>(y)), lr.shape().clone()))
        })
    }

    /// `x W` by [`LinearOp`]'s cuBLAS GEMM, then Candle's add kernel with `r`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        let (y, shape) = self.0.cuda_fwd(&ins[..2])?;
        let (sr, lr) = ins[2];
        let ly = candle_core::Layout::contiguous(shape.clone());
        Ok((y.binary_impl::<candle_core::op::Add>(sr, &ly, lr)?, shape))
    }

    fn bwd(&self, ins: &[&Tensor], y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let [dx, dw, _] = self.0.bwd(&ins[..2], y, dy)?;
        let dr = ins[2].track_op().then(|| dy.clone());
        Ok([dx, dw, dr])
    }
}
