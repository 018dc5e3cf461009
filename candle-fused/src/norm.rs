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
//! fixed blocks of rows ([`crate::cpu::for_row_blocks`]) added in block order, so gradients are
//! bit-for-bit the same on any number of threads. 16-bit inputs are widened to f32 for all the
//! arithmetic and rounded once.

use crate::cpu::{self, Elem, Real};
use crate::fallback::{self, Precomputed, Saved};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, DType, Layout, MetalStorage, Result, Shape, Storage, Tensor, D,
};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Layer,
    Rms,
}

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * w + b` (biased variance,
/// as PyTorch), `x: [.., C]`, `w` and `b`: `[C]`, all of one float dtype.
///
/// Differentiable in `x`, `w` and `b`. On the CPU a fused kernel (statistics in f32, f64 for
/// f64); elsewhere [`layer_norm_composite`]'s expression inside the same op.
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

fn acc_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn check(op: &str, x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<()> {
    if !x.dtype().is_float() {
        bail!("{op}: x must be a float tensor, got {:?}", x.dtype())
    }
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
        if t.dtype() != x.dtype() {
            bail!(
                "{op}: {name} has dtype {:?}, x has {:?}",
                t.dtype(),
                x.dtype()
            )
        }
        if !t.device().same_device(x.device()) {
            bail!("{op}: {name} and x are on different devices")
        }
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
    if cpu::has_kernel(x) {
        let op = NormOp::new(kind, eps, None);
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        return match b {
            Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
            None => x.apply_op2(&w, op),
        };
    }
    let bd = b.map(Tensor::detach);
    let (y, mean, rstd) = composite(&x.detach(), &w.detach(), bd.as_ref(), eps, kind)?;
    if !fallback::tracks(&[x, w]) && !b.is_some_and(Tensor::track_op) {
        return Ok(y);
    }
    let op = NormOp::new(kind, eps, Some(Precomputed::new(y)?));
    if let Some(m) = mean {
        op.mean.set(m.flatten_all()?.contiguous()?);
    }
    op.rstd.set(rstd.flatten_all()?.contiguous()?);
    match b {
        Some(b) => x.apply_op3(w, b, op),
        None => x.apply_op2(w, op),
    }
}

/// The norm op: `(x, w)` or `(x, w, b)`.
struct NormOp {
    kind: Kind,
    eps: f64,
    /// `Some` on the fallback path: the output, computed with composite ops.
    pre: Option<Precomputed>,
    /// Per-row mean (LayerNorm only) and rstd, `[N]`, f32 (f64 for f64).
    mean: Saved,
    rstd: Saved,
}

type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

fn cpu_of(s: &Storage) -> Result<&CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        _ => bail!("candle-fused: expected a CPU tensor"),
    }
}

impl NormOp {
    fn new(kind: Kind, eps: f64, pre: Option<Precomputed>) -> Self {
        Self {
            kind,
            eps,
            pre,
            mean: Saved::default(),
            rstd: Saved::default(),
        }
    }

    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Layer => "candle-fused-layer-norm",
            Kind::Rms => "candle-fused-rms-norm",
        }
    }

    fn pre(&self) -> Result<&Precomputed> {
        match &self.pre {
            Some(p) => Ok(p),
            None => bail!("{}: no kernel for this device", self.name()),
        }
    }

    fn fwd_cpu(
        &self,
        (sx, lx): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        if let Some(p) = &self.pre {
            return p.cpu();
        }
        let shape = lx.shape().clone();
        let c = shape.dims().last().copied().unwrap_or(1);
        crate::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let ws = cpu::contiguous::<T>(sw, lw)?;
            let bs = b.map(|(s, l)| cpu::contiguous::<T>(s, l)).transpose()?;
            let (y, mean, rstd) = fwd_kernel(xs, ws, bs, c, self.eps, self.kind);
            let n = rstd.len();
            if self.kind == Kind::Layer {
                self.mean.set(cpu::tensor(mean, n)?);
            }
            self.rstd.set(cpu::tensor(rstd, n)?);
            Ok((T::storage(y), shape))
        })
    }

    fn backward(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, dy: &Tensor) -> Result<Grads> {
        let need_x = x.track_op();
        let need_w = w.track_op();
        let need_b = b.is_some_and(Tensor::track_op);
        let rstd = self.rstd.get()?;
        let mean = match self.kind {
            Kind::Layer => Some(self.mean.get()?),
            Kind::Rms => None,
        };
        let c = x.dims().last().copied().unwrap_or(1);
        if !(cpu::has_kernel(x) && dy.device().is_cpu() && rstd.device().is_cpu()) {
            return self.composite_bwd(x, w, b.is_some(), dy, mean, rstd, (need_x, need_w, need_b));
        }
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let mean = mean.map(|m| m.contiguous()).transpose()?;
        let rstd = rstd.contiguous()?;
        crate::dispatch!(x.dtype(), T => {
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
            let (dx, dw, db) = bwd_kernel(xs, ws, dys, ms, rs, c, need_w, need_b);
            let dx = need_x.then(|| cpu::tensor(dx, x.shape())).transpose()?;
            let dw = dw.map(|v| cpu::tensor(v, c)).transpose()?;
            let db = db.map(|v| cpu::tensor(v, c)).transpose()?;
            Ok((dx, dw, db))
        })
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
        (need_x, need_w, need_b): (bool, bool, bool),
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
        Ok((dx, dw, db))
    }
}

/// `(y, mean, rstd)` for rows of `c` elements (`mean` is all zeros for RMSNorm).
fn fwd_kernel<T: Elem>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    c: usize,
    eps: f64,
    kind: Kind,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    let wa: Vec<T::Acc> = w.iter().map(|v| v.acc()).collect();
    let ba: Option<Vec<T::Acc>> = b.map(|b| b.iter().map(|v| v.acc()).collect());
    let eps = T::Acc::c(eps);
    let inv_c = T::Acc::c(1.0 / c as f64);
    let mut y = vec![T::from_acc(T::Acc::ZERO); x.len()];
    let stats = cpu::for_row_blocks(&mut y, c, 4 * c, |r0, yb| {
        let mut st = Vec::with_capacity(yb.len() / c);
        for (k, yr) in yb.chunks_mut(c).enumerate() {
            let xr = &x[(r0 + k) * c..(r0 + k + 1) * c];
            let (mean, rstd) = match kind {
                Kind::Layer => {
                    let mean = cpu::sum_map(xr, |v| v.acc()) * inv_c;
                    let var = cpu::sum_map(xr, |v| {
                        let d = v.acc() - mean;
                        d * d
                    }) * inv_c;
                    (mean, T::Acc::ONE / (var + eps).sqrt())
                }
                Kind::Rms => {
                    let ms = cpu::sum_map(xr, |v| {
                        let a = v.acc();
                        a * a
                    }) * inv_c;
                    (T::Acc::ZERO, T::Acc::ONE / (ms + eps).sqrt())
                }
            };
            match &ba {
                Some(ba) => {
                    for (((yo, xv), wv), bv) in yr.iter_mut().zip(xr).zip(&wa).zip(ba) {
                        *yo = T::from_acc((xv.acc() - mean) * rstd * *wv + *bv);
                    }
                }
                None => {
                    for ((yo, xv), wv) in yr.iter_mut().zip(xr).zip(&wa) {
                        *yo = T::from_acc((xv.acc() - mean) * rstd * *wv);
                    }
                }
            }
            st.push((mean, rstd));
        }
        st
    });
    let n = x.len() / c;
    let (mut mean, mut rstd) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (m, r) in stats.into_iter().flatten() {
        mean.push(m);
        rstd.push(r);
    }
    (y, mean, rstd)
}

/// `(sum g, sum g * xhat)` over a row, `g = dy * w`, `xhat = (x - mean) * rstd`, 8 lanes.
#[inline(always)]
fn row_sums<T: Elem>(
    x: &[T],
    dy: &[T],
    w: &[T::Acc],
    mean: T::Acc,
    rstd: T::Acc,
) -> (T::Acc, T::Acc) {
    let z = T::Acc::ZERO;
    let (mut a, mut b) = ([z; 8], [z; 8]);
    let (mut cx, mut cd, mut cw) = (x.chunks_exact(8), dy.chunks_exact(8), w.chunks_exact(8));
    for ((xs, ds), ws) in (&mut cx).zip(&mut cd).zip(&mut cw) {
        for l in 0..8 {
            let g = ds[l].acc() * ws[l];
            a[l] += g;
            b[l] += g * ((xs[l].acc() - mean) * rstd);
        }
    }
    let fold = |v: [T::Acc; 8]| ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    let (mut sa, mut sb) = (fold(a), fold(b));
    for ((xv, dv), wv) in cx
        .remainder()
        .iter()
        .zip(cd.remainder())
        .zip(cw.remainder())
    {
        let g = dv.acc() * *wv;
        sa += g;
        sb += g * ((xv.acc() - mean) * rstd);
    }
    (sa, sb)
}

/// `(dx, dw, db)`; `mean` is `None` for RMSNorm (whose `dx` has no `mean(g)` term).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn bwd_kernel<T: Elem>(
    x: &[T],
    w: &[T],
    dy: &[T],
    mean: Option<&[T::Acc]>,
    rstd: &[T::Acc],
    c: usize,
    need_w: bool,
    need_b: bool,
) -> (Vec<T>, Option<Vec<T>>, Option<Vec<T>>) {
    let zero = T::Acc::ZERO;
    let wa: Vec<T::Acc> = w.iter().map(|v| v.acc()).collect();
    let inv_c = T::Acc::c(1.0 / c as f64);
    let mut dx = vec![T::from_acc(zero); x.len()];
    let parts = cpu::for_row_blocks(&mut dx, c, 8 * c, |r0, dxb| {
        let mut dw = if need_w { vec![zero; c] } else { Vec::new() };
        let mut db = if need_b { vec![zero; c] } else { Vec::new() };
        for (k, dxr) in dxb.chunks_mut(c).enumerate() {
            let i = r0 + k;
            let (xr, dyr) = (&x[i * c..(i + 1) * c], &dy[i * c..(i + 1) * c]);
            let m = mean.map_or(zero, |m| m[i]);
            let r = rstd[i];
            let (sg, sgx) = row_sums::<T>(xr, dyr, &wa, m, r);
            let mg = if mean.is_some() { sg * inv_c } else { zero };
            let mgx = sgx * inv_c;
            for (((d, xv), dv), wv) in dxr.iter_mut().zip(xr).zip(dyr).zip(&wa) {
                let xh = (xv.acc() - m) * r;
                *d = T::from_acc(r * (dv.acc() * *wv - mg - xh * mgx));
            }
            if need_w {
                for ((a, xv), dv) in dw.iter_mut().zip(xr).zip(dyr) {
                    *a += dv.acc() * ((xv.acc() - m) * r);
                }
            }
            if need_b {
                for (a, dv) in db.iter_mut().zip(dyr) {
                    *a += dv.acc();
                }
            }
        }
        (dw, db)
    });
    let total = |pick: fn(&(Vec<T::Acc>, Vec<T::Acc>)) -> &Vec<T::Acc>| -> Vec<T> {
        let mut s = vec![zero; c];
        for p in &parts {
            for (a, v) in s.iter_mut().zip(pick(p)) {
                *a += *v;
            }
        }
        s.into_iter().map(T::from_acc).collect()
    };
    let dw = need_w.then(|| total(|p| &p.0));
    let db = need_b.then(|| total(|p| &p.1));
    (dx, dw, db)
}

impl candle_core::CustomOp2 for NormOp {
    fn name(&self) -> &'static str {
        NormOp::name(self)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd_cpu((s1, l1), (s2, l2), None)
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.pre()?.cuda()
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        self.pre()?.metal()
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, None, dy)?;
        Ok((dx, dw))
    }
}

impl candle_core::CustomOp3 for NormOp {
    fn name(&self) -> &'static str {
        NormOp::name(self)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd_cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.pre()?.cuda()
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        self.pre()?.metal()
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Grads> {
        self.backward(x, w, Some(b), dy)
    }
}
