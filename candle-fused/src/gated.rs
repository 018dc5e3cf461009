//! The gated activations of transformer MLPs, `act(gate) * up`, as one differentiable op with
//! the activation a parameter ([`Gate`]): SwiGLU (`silu`, [`crate::swiglu`]) and GeGLU (tanh
//! GELU, [`crate::geglu`]).
//!
//! With `a = act(g)` and `a' = act'(g)`, elementwise:
//!
//! ```text
//! forward:   y      = a u
//! backward:  d_gate = dy u a'
//!            d_up   = dy a
//! ```
//!
//! The forward reads `gate` and `up` once and writes `y`; nothing is saved: the backward
//! recomputes `a` and `a'` from `gate` and writes both gradients in one pass. `gate` and `up`
//! may have any strides, e.g. the two halves of one packed `[.., 2I]` projection: the kernel
//! reads them in place, row by row. The gradients come back contiguous, in the inputs' shape.
//! 16-bit inputs are widened to f32, every product and the activation run in f32, each output
//! is rounded once; the f32 activations take the crate's vectorising
//! [`exp_f32`](crate::gelu::exp_f32) / [`tanh_f32`](crate::gelu::tanh_f32), the f64 ones std's.
//! No element depends on another: the same bits on any number of threads.
//!
//! On CUDA with the Triton kernels switched on, forward and backward run the activation's
//! Triton kernels (`gated/cuda.rs`), which reproduce the CPU kernel bit for bit; strided inputs
//! are copied to contiguous tensors first. Otherwise CUDA computes the composite expression
//! inside the op.

#[cfg(feature = "cuda")]
mod cuda;

use crate::cpu::{self, Elem, Real};
use crate::cuda_kernels::{triton_flat, triton_input};
use crate::gelu::{gelu_grad, gelu_grad_composite, gelu_val, FastMath};
use crate::op::{self, acc_dtype, check_like, Grads, In, Kernel};
use crate::pool::Shared;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result, Shape, Tensor, D};

/// The activation of a gated op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// `silu(g) = g / (1 + e^-g)`: SwiGLU.
    Silu,
    /// GPT-2's tanh GELU, as [`crate::gelu::gelu`] computes it: GeGLU (Gemma's MLP).
    GeluTanh,
}

/// The names of a gated op: the public op's (in errors), the Candle op's, and the Triton
/// kernels' entries (forward, backward).
struct Names {
    op: &'static str,
    custom: &'static str,
    fwd: &'static str,
    bwd: &'static str,
}

impl Gate {
    /// Its op's [`Names`].
    fn names(self) -> Names {
        let n = |op, custom, fwd, bwd| Names {
            op,
            custom,
            fwd,
            bwd,
        };
        match self {
            Gate::Silu => n("swiglu", "candle-fused-swiglu", "swiglu_fwd", "swiglu_bwd"),
            Gate::GeluTanh => n("geglu", "candle-fused-geglu", "geglu_fwd", "geglu_bwd"),
        }
    }

    /// `act(g)` from plain differentiable ops (`g` in the accumulation dtype).
    fn composite(self, g: &Tensor) -> Result<Tensor> {
        match self {
            Gate::Silu => candle_nn::ops::silu(g),
            Gate::GeluTanh => crate::gelu::gelu_composite(g),
        }
    }

    /// `(act(g), act'(g))` from plain ops (`g` detached, in the accumulation dtype).
    fn composite_pair(self, g: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Gate::Silu => {
                let s = (g.neg()?.exp()? + 1.0)?.recip()?;
                let gs = (g * &s)?;
                // s (1 + g (1 - s)) = s + g s - g s^2 = s + gs (1 - s)
                let dsilu = (&s + (&gs * s.affine(-1.0, 1.0)?)?)?;
                Ok((gs, dsilu))
            }
            Gate::GeluTanh => Ok((self.composite(g)?, gelu_grad_composite(g)?)),
        }
    }
}

/// An activation's value and derivative, in the kernels' operation order.
trait Activation {
    /// `act(g)`.
    fn val<A: FastMath>(g: A) -> A;
    /// `(act(g), act'(g))`.
    fn pair<A: FastMath>(g: A) -> (A, A);
}

/// [`Gate::Silu`].
struct Silu;

impl Activation for Silu {
    #[inline(always)]
    fn val<A: FastMath>(g: A) -> A {
        g * sigmoid(g)
    }
    #[inline(always)]
    fn pair<A: FastMath>(g: A) -> (A, A) {
        let s = sigmoid(g);
        let gs = g * s;
        (gs, s + gs * (A::ONE - s))
    }
}

/// [`Gate::GeluTanh`].
struct GeluTanh;

impl Activation for GeluTanh {
    #[inline(always)]
    fn val<A: FastMath>(g: A) -> A {
        gelu_val(g)
    }
    #[inline(always)]
    fn pair<A: FastMath>(g: A) -> (A, A) {
        (gelu_val(g), gelu_grad(g))
    }
}

/// `act(gate) * up`: the public ops' body (see [`crate::swiglu::swiglu`]).
pub(crate) fn gated(act: Gate, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let names = act.names();
    check(names.op, gate, up)?;
    if triton_flat(gate.device(), gate.dtype(), gate.elem_count())
        && crate::cuda_kernels::may_launch(names.fwd)
        && crate::cuda_kernels::may_launch(names.bwd)
    {
        // the Triton kernels (CUDA, on by default): nothing computed beforehand
        let (gate, up) = (triton_input(gate)?, triton_input(up)?);
        return op::apply(GatedOp { act, triton: true }, &[&gate, &up], None, None);
    }
    let op = GatedOp { act, triton: false };
    if cpu::has_kernel(gate) && gate.elem_count() > 0 {
        // The kernel reads rows through their strides but wants each row's elements side by side.
        let unit = |t: &Tensor| match t.stride().last() {
            Some(&s) if s != 1 && t.dim(D::Minus1).is_ok_and(|c| c > 1) => t.contiguous(),
            _ => Ok(t.clone()),
        };
        return op::apply(op, &[&unit(gate)?, &unit(up)?], None, None);
    }
    let y = composite(act, &gate.detach(), &up.detach())?;
    op::apply(op, &[gate, up], None, Some(y))
}

/// `act(gate) * up` from plain differentiable ops, in f32 for 16-bit inputs (rounded once):
/// the public composites' body; `op` names the caller in errors.
pub(crate) fn gated_composite(act: Gate, op: &str, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(op, gate, up)?;
    composite(act, gate, up)
}

fn check(op: &str, gate: &Tensor, up: &Tensor) -> Result<()> {
    op::check_float(op, "gate", gate)?;
    let dims = gate.dims();
    if dims != up.dims() {
        let other = up.dims();
        bail!("{op}: gate and up must have the same shape, got {dims:?} and {other:?}")
    }
    check_like(op, ("gate", gate), ("up", up))
}

/// `act(gate) * up` from plain ops, in f32 for 16-bit inputs.
fn composite(act: Gate, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let dt = gate.dtype();
    let acc = acc_dtype(dt);
    let y = (act.composite(&gate.to_dtype(acc)?)? * up.to_dtype(acc)?)?;
    y.to_dtype(dt)
}

/// `(d_gate, d_up)` from composite ops on detached tensors (devices without a kernel).
fn composite_bwd(act: Gate, gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = gate.dtype();
    let acc = acc_dtype(dt);
    let g = gate.detach().to_dtype(acc)?;
    let u = up.detach().to_dtype(acc)?;
    let dy = dy.detach().to_dtype(acc)?;
    let (a, da) = act.composite_pair(&g)?;
    let d_gate = ((&dy * u)? * da)?;
    let d_up = (dy * a)?;
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
        bail!("candle-fused: gated kernel input needs a unit last stride, got {strides:?}")
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
fn fwd_kernel<T: Elem, F: Activation>(p: &Rows, gate: &[T], up: &[T], n: usize) -> Vec<T>
where
    T::Acc: FastMath,
{
    let mut y = vec![T::from_acc(T::Acc::ZERO); n];
    cpu::for_rows(&mut y, p.len, 6 * p.len, |r, yr| {
        let (g0, u0) = (p.starts[0][r], p.starts[1][r]);
        let (gr, ur) = (&gate[g0..g0 + yr.len()], &up[u0..u0 + yr.len()]);
        for ((o, gv), uv) in yr.iter_mut().zip(gr).zip(ur) {
            *o = T::from_acc(F::val(gv.acc()) * uv.acc());
        }
    });
    y
}

/// `(d_gate, d_up)` (contiguous) from `gate`, `up` (read through `p`) and `dy` (contiguous).
fn bwd_kernel<T: Elem, F: Activation>(p: &Rows, gate: &[T], up: &[T], dy: &[T]) -> (Vec<T>, Vec<T>)
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
            let (act, dact) = F::pair(g);
            *a = T::from_acc(d * u * dact);
            *b = T::from_acc(d * act);
        }
    });
    (dg, du)
}

/// The op on `(gate, up)`.
struct GatedOp {
    act: Gate,
    /// Forward and backward run the Triton kernels (CUDA, `gated/cuda.rs`).
    triton: bool,
}

impl Kernel for GatedOp {
    fn name(&self) -> &'static str {
        self.act.names().custom
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sg, lg), (su, lu)) = (ins[0], ins[1]);
        let p = rows(lg, lu)?;
        let n = lg.shape().elem_count();
        let (g, u) = (sg, su);
        let y = cpu::dispatch!(sg.dtype(), T => {
            let (g, u) = (T::slice(g)?, T::slice(u)?);
            T::storage(match self.act {
                Gate::Silu => fwd_kernel::<T, Silu>(&p, g, u, n),
                Gate::GeluTanh => fwd_kernel::<T, GeluTanh>(&p, g, u, n),
            })
        });
        Ok((y, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        cuda::fwd(self.act.names().fwd, ins[0], ins[1])
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (gate, up) = (ins[0], ins[1]);
        let need = [gate.track_op(), up.track_op()];
        op::triton_path!(
            self.triton,
            self.name(),
            cuda::bwd(self.act.names().bwd, gate, up, dy, need)
        );
        if !(cpu::has_kernel(gate) && dy.device().is_cpu()) {
            let (dg, du) = composite_bwd(self.act, gate, up, dy)?;
            return Ok([need[0].then_some(dg), need[1].then_some(du), None]);
        }
        let dy = dy.to_dtype(gate.dtype())?.contiguous()?;
        let (gg, lg) = gate.storage_and_layout();
        let (gu, lu) = up.storage_and_layout();
        let p = rows(lg, lu)?;
        let (dg, du) = cpu::dispatch!(gate.dtype(), T => {
            let gs = T::slice(op::cpu_of(&gg)?)?;
            let us = T::slice(op::cpu_of(&gu)?)?;
            let (dg, du) = cpu::with_slice::<T, _>(&dy, |dys| Ok(match self.act {
                Gate::Silu => bwd_kernel::<T, Silu>(&p, gs, us, dys),
                Gate::GeluTanh => bwd_kernel::<T, GeluTanh>(&p, gs, us, dys),
            }))?;
            (cpu::tensor(dg, gate.shape())?, cpu::tensor(du, gate.shape())?)
        });
        Ok([need[0].then_some(dg), need[1].then_some(du), None])
    }
}
