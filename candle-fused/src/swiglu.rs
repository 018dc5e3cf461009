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
//! The forward reads `gate` and `up` once and writes `y`; nothing is saved: the backward
//! recomputes `s` from `gate` and writes both gradients in one pass. `gate` and `up` may have
//! any strides, e.g. the two halves of one packed `[.., 2I]` projection
//! (`h.narrow(D::Minus1, 0, I)`, `h.narrow(D::Minus1, I, I)`): the kernel reads them in place,
//! row by row. The gradients come back contiguous, in the inputs' shape.
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
//! backward run the Triton kernels (`swiglu/cuda.rs`), which reproduce the CPU kernel bit for
//! bit; strided inputs (the halves of a packed projection) are copied to contiguous tensors
//! first. Otherwise CUDA computes [`swiglu_composite`]'s expression inside the op.

#[cfg(feature = "cuda")]
mod cuda;

use crate::cpu::{self, Elem, Real};
use crate::cuda_kernels::{triton_flat, triton_input};
use crate::gelu::FastMath;
use crate::op::{self, acc_dtype, check_like, Grads, In, Kernel};
use crate::pool::Shared;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result, Shape, Tensor, D};

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
    check("swiglu", gate, up)?;
    if triton_flat(gate.device(), gate.dtype(), gate.elem_count()) {
        // the Triton kernels (CUDA, on by default): nothing computed beforehand
        let (gate, up) = (triton_input(gate)?, triton_input(up)?);
        return op::apply(SwigluOp { triton: true }, &[&gate, &up], None, None);
    }
    if cpu::has_kernel(gate) && gate.elem_count() > 0 {
        // The kernel reads rows through their strides but wants each row's elements side by side.
        let unit = |t: &Tensor| match t.stride().last() {
            Some(&s) if s != 1 && t.dim(D::Minus1).is_ok_and(|c| c > 1) => t.contiguous(),
            _ => Ok(t.clone()),
        };
        let op = SwigluOp { triton: false };
        return op::apply(op, &[&unit(gate)?, &unit(up)?], None, None);
    }
    let y = composite(&gate.detach(), &up.detach())?;
    op::apply(SwigluOp { triton: false }, &[gate, up], None, Some(y))
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
    check("swiglu_composite", gate, up)?;
    composite(gate, up)
}

fn check(op: &str, gate: &Tensor, up: &Tensor) -> Result<()> {
    if !gate.dtype().is_float() {
        bail!("{op}: gate must be a float tensor, got {:?}", gate.dtype())
    }
    if gate.dims() != up.dims() {
        bail!(
            "{op}: gate and up must have the same shape, got {:?} and {:?}",
            gate.shape(),
            up.shape()
        )
    }
    check_like(op, ("gate", gate), ("up", up))
}

/// `silu(gate) * up` from plain ops, in f32 for 16-bit inputs.
fn composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let dt = gate.dtype();
    let acc = acc_dtype(dt);
    let y = (candle_nn::ops::silu(&gate.to_dtype(acc)?)? * up.to_dtype(acc)?)?;
    y.to_dtype(dt)
}

/// `(d_gate, d_up)` from composite ops on detached tensors (devices without a kernel).
fn composite_bwd(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = gate.dtype();
    let acc = acc_dtype(dt);
    let g = gate.detach().to_dtype(acc)?;
    let u = up.detach().to_dtype(acc)?;
    let dy = dy.detach().to_dtype(acc)?;
    let s = (g.neg()?.exp()? + 1.0)?.recip()?;
    let gs = (&g * &s)?;
    // s (1 + g (1 - s)) = s + g s - g s^2 = s + gs (1 - s)
    let dsilu = (&s + (&gs * s.affine(-1.0, 1.0)?)?)?;
    let d_gate = ((&dy * u)? * dsilu)?;
    let d_up = (dy * gs)?;
    Ok((d_gate.to_dtype(dt)?, d_up.to_dtype(dt)?))
}

/// Elements per parallel work item when both inputs are contiguous.
const CHUNK: usize = 4096;

/// How the kernels walk the elements: `rows` pieces of `len` elements (the last may be
/// shorter), piece `r` of input `k` starting at `starts[k][r]` in its storage.
struct Rows {
    len: usize,
    starts: [Vec<usize>; 2],
}

/// The pieces for `gate` and `up`: `CHUNK`-long slices of the flattened tensors when both
/// are contiguous, else their rows (last dim, stride 1), wherever their strides put them.
fn rows(lg: &Layout, lu: &Layout) -> Result<Rows> {
    let n = lg.shape().elem_count();
    if let (Some((g0, _)), Some((u0, _))) = (lg.contiguous_offsets(), lu.contiguous_offsets()) {
        let starts = |s0: usize| (0..n.div_ceil(CHUNK)).map(|r| s0 + r * CHUNK).collect();
        return Ok(Rows {
            len: CHUNK,
            starts: [starts(g0), starts(u0)],
        });
    }
    let len = lg.dims().last().copied().unwrap_or(1);
    Ok(Rows {
        len,
        starts: [row_starts(lg)?, row_starts(lu)?],
    })
}

/// The start of every row (last dim) of a layout whose rows have unit stride.
fn row_starts(l: &Layout) -> Result<Vec<usize>> {
    let (dims, strides) = (l.dims(), l.stride());
    let lead = dims.len().saturating_sub(1);
    if dims.last().is_some_and(|&c| c > 1) && strides[lead] != 1 {
        bail!("candle-fused: swiglu kernel input needs a unit last stride, got {strides:?}")
    }
    let n_rows: usize = dims[..lead].iter().product();
    let mut out = Vec::with_capacity(n_rows);
    let (mut idx, mut off) = (vec![0usize; lead], l.start_offset());
    for _ in 0..n_rows {
        out.push(off);
        // Next row: an odometer over the leading dims.
        for k in (0..lead).rev() {
            idx[k] += 1;
            off += strides[k];
            if idx[k] < dims[k] {
                break;
            }
            off -= strides[k] * dims[k];
            idx[k] = 0;
        }
    }
    Ok(out)
}

/// `1 / (1 + e^-g)`.
#[inline(always)]
fn sigmoid<A: FastMath>(g: A) -> A {
    A::ONE / (A::ONE + (-g).exp_fast())
}

/// `y` (contiguous) from `gate` and `up` (whole storages, read through `p`).
fn fwd_kernel<T: Elem>(p: &Rows, gate: &[T], up: &[T], n: usize) -> Vec<T>
where
    T::Acc: FastMath,
{
    let mut y = vec![T::from_acc(T::Acc::ZERO); n];
    cpu::for_rows(&mut y, p.len, 6 * p.len, |r, yr| {
        let (g0, u0) = (p.starts[0][r], p.starts[1][r]);
        let (gr, ur) = (&gate[g0..g0 + yr.len()], &up[u0..u0 + yr.len()]);
        for ((o, gv), uv) in yr.iter_mut().zip(gr).zip(ur) {
            let g = gv.acc();
            *o = T::from_acc(g * sigmoid(g) * uv.acc());
        }
    });
    y
}

/// `(d_gate, d_up)` (contiguous) from `gate`, `up` (read through `p`) and `dy` (contiguous).
fn bwd_kernel<T: Elem>(p: &Rows, gate: &[T], up: &[T], dy: &[T]) -> (Vec<T>, Vec<T>)
where
    T::Acc: FastMath,
{
    let n = dy.len();
    let zero = T::from_acc(T::Acc::ZERO);
    let (mut dg, mut du) = (vec![zero; n], vec![zero; n]);
    let du_at = Shared(du.as_mut_ptr());
    cpu::for_rows(&mut dg, p.len, 8 * p.len, |r, dgr| {
        let (g0, u0, o) = (p.starts[0][r], p.starts[1][r], r * p.len);
        let m = dgr.len();
        let (gr, ur, dyr) = (&gate[g0..g0 + m], &up[u0..u0 + m], &dy[o..o + m]);
        // SAFETY: piece r writes elements o..o + m of `du` (n long), the same range of `dg` that
        // `for_rows` hands it alone; `du` outlives the parallel section.
        let dur = unsafe { std::slice::from_raw_parts_mut(du_at.at(o), m) };
        for ((((a, b), gv), uv), dv) in dgr.iter_mut().zip(dur).zip(gr).zip(ur).zip(dyr) {
            let (g, u, d) = (gv.acc(), uv.acc(), dv.acc());
            let s = sigmoid(g);
            let gs = g * s;
            *a = T::from_acc(d * u * (s + gs * (T::Acc::ONE - s)));
            *b = T::from_acc(d * gs);
        }
    });
    (dg, du)
}

/// The op on `(gate, up)`.
struct SwigluOp {
    /// Forward and backward run the Triton kernels (CUDA, `swiglu/cuda.rs`).
    triton: bool,
}

impl Kernel for SwigluOp {
    fn name(&self) -> &'static str {
        "candle-fused-swiglu"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sg, lg), (su, lu)) = (ins[0], ins[1]);
        let p = rows(lg, lu)?;
        let n = lg.shape().elem_count();
        let y = cpu::dispatch!(sg.dtype(), T => {
            T::storage(fwd_kernel::<T>(&p, T::slice(sg)?, T::slice(su)?, n))
        });
        Ok((y, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ins: &[crate::cuda_kernels::launch::CudaIn<'_>],
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::fwd(ins[0], ins[1])
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (gate, up) = (ins[0], ins[1]);
        let need = [gate.track_op(), up.track_op()];
        if self.triton {
            #[cfg(feature = "cuda")]
            return cuda::bwd(gate, up, dy, need);
            #[cfg(not(feature = "cuda"))]
            bail!("{}: Triton kernels need the `cuda` feature", self.name());
        }
        if !(cpu::has_kernel(gate) && dy.device().is_cpu()) {
            let (dg, du) = composite_bwd(gate, up, dy)?;
            return Ok([need[0].then_some(dg), need[1].then_some(du), None]);
        }
        let dy = dy.to_dtype(gate.dtype())?.contiguous()?;
        let (gg, lg) = gate.storage_and_layout();
        let (gu, lu) = up.storage_and_layout();
        let p = rows(lg, lu)?;
        let (dg, du) = cpu::dispatch!(gate.dtype(), T => {
            let gs = T::slice(op::cpu_of(&gg)?)?;
            let us = T::slice(op::cpu_of(&gu)?)?;
            let (dg, du) = cpu::with_slice::<T, _>(&dy, |dys| Ok(bwd_kernel::<T>(&p, gs, us, dys)))?;
            (cpu::tensor(dg, gate.shape())?, cpu::tensor(du, gate.shape())?)
        });
        Ok([need[0].then_some(dg), need[1].then_some(du), None])
    }
}
