//! LayerNorm (optional bias) and RMSNorm over the last dimension, differentiable.
//!
//! The forward kernel normalises each row in one sweep (two reductions over the row while it
//! is in cache, then the affine output) and saves only the per-row mean and `rstd =
//! 1/sqrt(var + eps)` (f32, f64 for f64 inputs). The backward recomputes `xhat` from them and
//! computes, per row,
//!
//! * LayerNorm: `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`,
//! * RMSNorm: `dx = rstd * (g - xhat * mean(g * xhat))`, with `xhat = x * rstd`,
//!
//! where `g = dy * w`, and `dw = sum_rows dy * xhat`, `db = sum_rows dy` as partial sums over
//! fixed blocks of rows (`cpu::for_row_blocks`) added in block order, so gradients are
//! bit-for-bit the same on any number of threads. 16-bit inputs are widened to f32 for all the
//! arithmetic and rounded once.
//!
//! On CUDA, both norms run the Triton kernels when they are switched on (`norm/cuda.rs`,
//! `cuda_kernels::set_triton`) and the row fits their tile (`C <= 4096`); otherwise they
//! compute the composite inside the op.
//! Candle's own CUDA forwards (`candle_nn::ops::{rms_norm, layer_norm}`) are not used for that
//! fallback: they return no statistics (the backward needs `rstd`, so a reduction would run
//! again), use the approximate `rsqrtf`, accumulate f64 in f32, and LayerNorm's variance is
//! `E[x^2] - mean^2`, which cancels for rows whose mean is large against their spread.

#[cfg(feature = "cuda")]
mod cuda;
mod kernel;

use crate::cpu::{self, Elem};
use crate::cuda_kernels::{self, triton_for, triton_input};
use crate::op::{self, acc_dtype, check_like, cpu_of, Grads, In, Kernel, Saved};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Result, Shape, Tensor, D};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Layer,
    Rms,
}

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * w + b` (biased variance,
/// as PyTorch), `x: [.., C]`, `w` and `b`: `[C]`, all of one float dtype.
///
/// Differentiable in `x`, `w` and `b`. On the CPU a fused kernel (statistics in f32, f64 for
/// f64); on CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`; f32, bf16,
/// f16, `C <= 4096`) their fused kernels; elsewhere [`layer_norm_composite`]'s expression
/// inside the same op.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f32, 2., 3.], [0., 0., 3.]], &Device::Cpu)?;
/// let w = Tensor::new(&[1f32, 1., 1.], &Device::Cpu)?;
/// let b = Tensor::new(&[0f32, 0., 1.], &Device::Cpu)?;
/// let y = candle_fused::norm::layer_norm(&x, &w, Some(&b), 1e-5)?;
/// let r = candle_fused::norm::layer_norm_composite(&x, &w, Some(&b), 1e-5)?;
/// let d = (y - r)?.abs()?.sum_all()?.to_scalar::<f32>()?;
/// assert!(d < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    check("layer_norm", x, w, b, eps)?;
    norm(x, w, b, eps, Kind::Layer)
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * w`, `x: [.., C]`, `w: [C]`.
///
/// Differentiable in `x` and `w`; see [`layer_norm`] for the paths it takes.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[3f32, 4.], [1., -1.]], &Device::Cpu)?;
/// let w = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let y = candle_fused::norm::rms_norm(&x, &w, 0.0)?.to_vec2::<f32>()?;
/// // rms of [3, 4] is sqrt(12.5)
/// assert!((y[0][1] - 8.0 / 12.5f32.sqrt()).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    check("rms_norm", x, w, None, eps)?;
    norm(x, w, None, eps, Kind::Rms)
}

/// The reference LayerNorm from plain differentiable Candle ops (`mean_keepdim`, `sqr`,
/// `sqrt`, broadcast ops; statistics and affine in f32 for 16-bit inputs, rounded once).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f64, 3.]], &Device::Cpu)?;
/// let w = Tensor::new(&[1f64, 1.], &Device::Cpu)?;
/// let y = candle_fused::norm::layer_norm_composite(&x, &w, None, 0.0)?.to_vec2::<f64>()?;
/// assert_eq!(y, [[-1.0, 1.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm_composite(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    check("layer_norm_composite", x, w, b, eps)?;
    Ok(composite(x, w, b, eps, Kind::Layer)?.0)
}

/// The reference RMSNorm from plain differentiable Candle ops (see [`layer_norm_composite`]).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f64, -1.]], &Device::Cpu)?;
/// let w = Tensor::new(&[2f64, 2.], &Device::Cpu)?;
/// let y = candle_fused::norm::rms_norm_composite(&x, &w, 0.0)?.to_vec2::<f64>()?;
/// assert_eq!(y, [[2.0, -2.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm_composite(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    check("rms_norm_composite", x, w, None, eps)?;
    Ok(composite(x, w, None, eps, Kind::Rms)?.0)
}

fn check(op: &str, x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<()> {
    op::check_float(op, "x", x)?;
    let c = match x.dims().last() {
        Some(&c) if c > 0 => c,
        _ => bail!(
            "{op}: x must have rank >= 1 and a non-empty last dim, got shape {:?}",
            x.shape()
        ),
    };
    for (name, t) in [("w", Some(w)), ("b", b)] {
        let Some(t) = t else { continue };
        if t.dims() != [c] {
            bail!(
                "{op}: {name} must have shape [{c}] (x's last dim), got {:?}",
                t.shape()
            )
        }
        check_like(op, (name, t), ("x", x))?;
    }
    if !(eps.is_finite() && eps >= 0.0) {
        bail!("{op}: eps must be finite and >= 0, got {eps}")
    }
    Ok(())
}

/// `(y, mean, rstd)`: the output in x's dtype and the statistics (`[.., 1]`, f32 or f64; no
/// mean for RMSNorm), from plain ops (differentiable when the inputs track a graph).
fn composite(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
    kind: Kind,
) -> Result<(Tensor, Option<Tensor>, Tensor)> {
    let dt = x.dtype();
    let acc = acc_dtype(dt);
    let xf = x.to_dtype(acc)?;
    let (xhat, mean, rstd) = match kind {
        Kind::Layer => {
            let mean = xf.mean_keepdim(D::Minus1)?;
            let xc = xf.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
            let rstd = var.affine(1.0, eps)?.sqrt()?.recip()?;
            (xc.broadcast_mul(&rstd)?, Some(mean), rstd)
        }
        Kind::Rms => {
            let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
            let rstd = ms.affine(1.0, eps)?.sqrt()?.recip()?;
            (xf.broadcast_mul(&rstd)?, None, rstd)
        }
    };
    let mut y = xhat.broadcast_mul(&w.to_dtype(acc)?)?;
    if let Some(b) = b {
        y = y.broadcast_add(&b.to_dtype(acc)?)?;
    }
    Ok((y.to_dtype(dt)?, mean, rstd))
}

fn norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64, kind: Kind) -> Result<Tensor> {
    let c = x.dims().last().copied().unwrap_or(1);
    let block_c = match kind {
        Kind::Layer => cuda_kernels::layer_norm::BLOCK_C,
        Kind::Rms => cuda_kernels::rms_norm::BLOCK_C,
    };
    if triton_for(x) && c <= block_c {
        // the Triton kernels (CUDA, on by default): nothing computed beforehand
        let op = NormOp {
            triton: true,
            ..NormOp::new(kind, eps)
        };
        let (x, w) = (triton_input(x)?, triton_input(w)?);
        let b = b.map(triton_input).transpose()?;
        return op::apply(op, &[&x, &w], b.as_ref(), None);
    }
    if cpu::has_kernel(x) {
        let op = NormOp::new(kind, eps);
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let b = b.map(Tensor::contiguous).transpose()?;
        return op::apply(op, &[&x, &w], b.as_ref(), None);
    }
    let bd = b.map(Tensor::detach);
    let (y, mean, rstd) = composite(&x.detach(), &w.detach(), bd.as_ref(), eps, kind)?;
    let op = NormOp::new(kind, eps);
    if let Some(m) = mean {
        op.mean.set(m.flatten_all()?.contiguous()?);
    }
    op.rstd.set(rstd.flatten_all()?.contiguous()?);
    op::apply(op, &[x, w], b, Some(y))
}

/// The norm op: `(x, w)` or `(x, w, b)`.
struct NormOp {
    kind: Kind,
    eps: f64,
    /// Per-row mean (LayerNorm only) and rstd, `[N]`, f32 (f64 for f64).
    mean: Saved,
    rstd: Saved,
    /// Forward and backward run the Triton kernels (CUDA, `src/norm/cuda.rs`).
    triton: bool,
}

impl NormOp {
    fn new(kind: Kind, eps: f64) -> Self {
        Self {
            kind,
            eps,
            mean: Saved::default(),
            rstd: Saved::default(),
            triton: false,
        }
    }

    /// The gradients from composite ops on detached tensors (devices without a kernel).
    #[allow(clippy::too_many_arguments)]
    fn composite_bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        has_b: bool,
        dy: &Tensor,
        mean: Option<Tensor>,
        rstd: Tensor,
        [need_x, need_w, need_b]: [bool; 3],
    ) -> Result<Grads> {
        let dt = x.dtype();
        let acc = acc_dtype(dt);
        let c = x.dims().last().copied().unwrap_or(1);
        let n = x.elem_count() / c;
        let xf = x.detach().to_dtype(acc)?.reshape((n, c))?;
        let dyf = dy.detach().to_dtype(acc)?.reshape((n, c))?;
        let r = rstd.detach().reshape((n, 1))?;
        let xhat = match mean {
            Some(m) => xf.broadcast_sub(&m.detach().reshape((n, 1))?)?,
            None => xf,
        }
        .broadcast_mul(&r)?;
        let dx = if need_x {
            let g = dyf.broadcast_mul(&w.detach().to_dtype(acc)?)?;
            let mgx = (&g * &xhat)?.mean_keepdim(1)?;
            let mut inner = (&g - xhat.broadcast_mul(&mgx)?)?;
            if self.kind == Kind::Layer {
                inner = inner.broadcast_sub(&g.mean_keepdim(1)?)?;
            }
            Some(inner.broadcast_mul(&r)?.to_dtype(dt)?.reshape(x.shape())?)
        } else {
            None
        };
        let dw = if need_w {
            Some((&dyf * &xhat)?.sum(0)?.to_dtype(dt)?)
        } else {
            None
        };
        let db = if has_b && need_b {
            Some(dyf.sum(0)?.to_dtype(dt)?)
        } else {
            None
        };
        Ok([dx, dw, db])
    }
}

impl Kernel for NormOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Layer => "candle-fused-layer-norm",
            Kind::Rms => "candle-fused-rms-norm",
        }
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sx, lx), (sw, lw), b) = (ins[0], ins[1], ins.get(2));
        let shape = lx.shape().clone();
        let c = shape.dims().last().copied().unwrap_or(1);
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let ws = cpu::contiguous::<T>(sw, lw)?;
            let bs = b.map(|(s, l)| cpu::contiguous::<T>(s, l)).transpose()?;
            let (y, mean, rstd) = kernel::fwd_kernel(xs, ws, bs, c, self.eps, self.kind);
            let n = rstd.len();
            if self.kind == Kind::Layer {
                self.mean.set(cpu::tensor(mean, n)?);
            }
            self.rstd.set(cpu::tensor(rstd, n)?);
            Ok((T::storage(y), shape))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        let stats = [&self.mean, &self.rstd];
        match (self.kind, ins) {
            (Kind::Rms, &[x, w]) => cuda::rms_fwd(x, w, self.eps, &self.rstd),
            (Kind::Layer, &[x, w]) => cuda::layer_fwd(x, w, None, self.eps, stats),
            (Kind::Layer, &[x, w, b]) => cuda::layer_fwd(x, w, Some(b), self.eps, stats),
            _ => bail!("{}: no CUDA kernel", self.name()),
        }
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (x, w, b) = (ins[0], ins[1], ins.get(2));
        let need = [x.track_op(), w.track_op(), b.is_some_and(|b| b.track_op())];
        let rstd = self.rstd.get()?;
        let mean = match self.kind {
            Kind::Layer => Some(self.mean.get()?),
            Kind::Rms => None,
        };
        op::triton_path!(
            self.triton,
            self.name(),
            match &mean {
                Some(m) => cuda::layer_bwd(x, w, b.is_some(), dy, [m, &rstd], need),
                None => cuda::rms_bwd(x, w, dy, &rstd, need),
            }
        );
        let c = x.dims().last().copied().unwrap_or(1);
        if !(cpu::has_kernel(x) && dy.device().is_cpu() && rstd.device().is_cpu()) {
            return self.composite_bwd(x, w, b.is_some(), dy, mean, rstd, need);
        }
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let mean = mean.map(|m| m.contiguous()).transpose()?;
        let rstd = rstd.contiguous()?;
        cpu::dispatch!(x.dtype(), T => {
            let (gx, lx) = x.storage_and_layout();
            let (gw, lw) = w.storage_and_layout();
            let (gd, ld) = dy.storage_and_layout();
            let (gr, lr) = rstd.storage_and_layout();
            let xs = cpu::contiguous::<T>(cpu_of(&gx)?, lx)?;
            let ws = cpu::contiguous::<T>(cpu_of(&gw)?, lw)?;
            let dys = cpu::contiguous::<T>(cpu_of(&gd)?, ld)?;
            let rs = cpu::contiguous::<<T as Elem>::Acc>(cpu_of(&gr)?, lr)?;
            let gm = mean.as_ref().map(|m| m.storage_and_layout());
            let ms = match &gm {
                Some((g, l)) => Some(cpu::contiguous::<<T as Elem>::Acc>(cpu_of(g)?, l)?),
                None => None,
            };
            let (dx, dw, db) = kernel::bwd_kernel(xs, ws, dys, ms, rs, c, need[1], need[2]);
            let dx = need[0].then(|| cpu::tensor(dx, x.shape())).transpose()?;
            let dw = dw.map(|v| cpu::tensor(v, c)).transpose()?;
            let db = db.map(|v| cpu::tensor(v, c)).transpose()?;
            Ok([dx, dw, db])
        })
    }
}
