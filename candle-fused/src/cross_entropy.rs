//! Softmax cross-entropy over the last (vocabulary) dimension, with an optional per-row weight
//! mask and an ignore index, differentiable in the logits.
//!
//! The forward computes, per row, the max and the log-sum-exp (in f32, f64 for f64 logits) and
//! the negative log-likelihood `lse_i - l[i, t_i]`; it saves only the `N` log-sum-exps and the
//! scalar count. The backward writes `dlogits[i, j] = g w_i / count (exp(l_ij - lse_i) - [j ==
//! t_i])` in one pass per row, rows in parallel; the log-softmax is never materialised.
//!
//! Weights: `w_i = mask_i` (1 without a mask), and 0 where `t_i == ignore_index`; the loss is
//! `sum_i w_i nll_i / count` with `count = max(sum_i w_i, 1)`, so an all-zero mask gives a loss
//! of 0 and zero gradients, not NaN. Rows of weight 0 are skipped entirely: they contribute
//! exactly 0 to the loss and get exactly 0 gradient even if their logits are not finite (as
//! PyTorch's `ignore_index`). A NaN anywhere else (logits of a counted row, a weight) gives a
//! NaN loss.
//!
//! On CUDA, with the Triton kernels switched on (`cuda_kernels::set_triton`), the forward is
//! `ce_fwd` and the backward `ce_bwd` (`cross_entropy/cuda.rs`, `triton/cross_entropy.py`), the
//! loss formed on the device; otherwise the composite runs inside the op.

#[cfg(feature = "cuda")]
mod cuda;

use crate::cpu::{self, Elem, Real};
use crate::cuda_kernels::{triton_for, triton_input};
use crate::gelu::FastMath;
use crate::host::Targets;
use crate::op::{self, acc_dtype, Grads, In, Kernel, Saved};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Result, Shape, Storage, Tensor, D};

/// Mean softmax cross-entropy of `logits: [.., V]` (f32, f64, bf16, f16) against `targets`
/// (u32, the leading shape of `logits`; a `&Tensor`, or [`Targets`] with their host copy, else
/// they are read back once for the range check), optionally weighted by `mask` (float, the
/// leading shape) and skipping rows whose target is `ignore_index`.
///
/// Returns a scalar (rank 0) in f32 (f64 for f64 logits): `sum_i w_i nll_i / max(sum_i w_i, 1)`
/// (see the [module docs](self)). Targets `>= V` (other than `ignore_index`) are an error.
/// Differentiable in `logits` only; the gradient has the logits' dtype.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[0f32, 0., 0., 0.], [9., 0., 0., 0.]], &Device::Cpu)?;
/// let targets = Tensor::new(&[1u32, 7], &Device::Cpu)?;
/// // row 1 is ignored: the loss is ln 4, the mean over the one counted row
/// let loss = candle_fused::cross_entropy::cross_entropy(&logits, &targets, None, Some(7))?;
/// assert!((loss.to_scalar::<f32>()? - 4f32.ln()).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cross_entropy<'a>(
    logits: &Tensor,
    targets: impl Into<Targets<'a>>,
    mask: Option<&Tensor>,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    let targets = targets.into();
    let (_, v) = check("cross_entropy", logits, &targets, mask, ignore_index)?;
    let acc = acc_dtype(logits.dtype());
    let targets = targets.tensor().flatten_all()?.contiguous()?;
    let mask = match mask {
        Some(m) => Some(m.detach().flatten_all()?.to_dtype(acc)?.contiguous()?),
        None => None,
    };
    let mut op = CeOp {
        targets,
        mask,
        ignore: ignore_index,
        v,
        lse: Saved::default(),
        count: Saved::default(),
        triton: false,
    };
    if triton_for(logits) {
        // the Triton kernels (CUDA, on by default): every argument contiguous and 16-byte aligned
        op.targets = triton_input(&op.targets)?;
        op.mask = op.mask.as_ref().map(triton_input).transpose()?;
        op.triton = true;
        return op::apply(op, &[&triton_input(logits)?], None, None);
    }
    if cpu::has_kernel(logits) {
        return op::apply(op, &[&logits.contiguous()?], None, None);
    }
    let (loss, lse, count) = op.composite_fwd(&logits.detach())?;
    op.lse.set(lse);
    op.count.set(count);
    op::apply(op, &[logits], None, Some(loss))
}

/// The reference cross-entropy from plain differentiable Candle ops
/// (`candle_nn::ops::log_softmax`, `gather`, the mask as a multiply; in f32 for 16-bit logits).
/// Unlike [`cross_entropy`], a non-finite logit in a row of weight 0 still makes it NaN.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[0f64, 0.]], &Device::Cpu)?;
/// let targets = Tensor::new(&[0u32], &Device::Cpu)?;
/// let loss = candle_fused::cross_entropy::cross_entropy_composite(&logits, &targets, None, None)?;
/// assert!((loss.to_scalar::<f64>()? - 2f64.ln()).abs() < 1e-15);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cross_entropy_composite<'a>(
    logits: &Tensor,
    targets: impl Into<Targets<'a>>,
    mask: Option<&Tensor>,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    let (targets, op) = (targets.into(), "cross_entropy_composite");
    let (n, v) = check(op, logits, &targets, mask, ignore_index)?;
    let acc = acc_dtype(logits.dtype());
    let lf = logits.to_dtype(acc)?.reshape((n, v))?;
    let t = targets.tensor().flatten_all()?;
    let (t, w) = weights(&t, mask, ignore_index, acc)?;
    let ls = candle_nn::ops::log_softmax(&lf, D::Minus1)?;
    let nll = ls.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
    let count = w.sum_all()?.maximum(1.0)?;
    (nll * w)?.sum_all()?.div(&count)
}

/// `(N, V)` after checking shapes, dtypes and devices, then the targets' range on the host: the
/// caller's host copy, or one counted read of the targets ([`Targets`]).
fn check(
    op: &str,
    logits: &Tensor,
    targets: &Targets<'_>,
    mask: Option<&Tensor>,
    ignore: Option<u32>,
) -> Result<(usize, usize)> {
    let (given, targets) = (targets, targets.tensor());
    op::check_float(op, "logits", logits)?;
    let (lead, v) = op::split_last(op, ("logits", "V"), logits)?;
    if targets.dtype() != DType::U32 {
        bail!("{op}: targets must be u32, got {:?}", targets.dtype())
    }
    if let Some(m) = mask {
        op::check_float(op, "mask", m)?;
    }
    for (name, t) in [("targets", Some(targets)), ("mask", mask)] {
        let Some(t) = t else { continue };
        if t.dims() != lead {
            bail!(
                "{op}: {name} must have the leading shape of logits {lead:?}, got {:?}",
                t.shape()
            )
        }
        if !t.device().same_device(logits.device()) {
            bail!("{op}: {name} and logits are on different devices")
        }
    }
    check_targets(op, &given.host(op)?, v, ignore)?;
    Ok((lead.iter().product(), v))
}

/// Errors on a target `>= v` that is not `ignore`.
pub(crate) fn check_targets(
    op: &str,
    targets: &[u32],
    v: usize,
    ignore: Option<u32>,
) -> Result<()> {
    match targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| Some(t) != ignore && t as usize >= v)
    {
        Some((i, &t)) => bail!(
            "{op}: target {t} (row {i}) is out of range for {v} classes{}",
            match ignore {
                Some(ig) => format!(" and is not ignore_index {ig}"),
                None => String::new(),
            }
        ),
        None => Ok(()),
    }
}

/// Runs `f` on the contiguous u32 data of a CPU tensor.
fn with_u32<R>(t: &Tensor, f: impl FnOnce(&[u32]) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::U32(v)), Some((a, b))) => f(&v[a..b]),
        _ => bail!("candle-fused: expected a contiguous u32 CPU tensor"),
    }
}

/// `(targets with ignored entries replaced by 0, weights)` for flat targets, from plain ops.
fn weights(
    t: &Tensor,
    mask: Option<&Tensor>,
    ignore: Option<u32>,
    acc: DType,
) -> Result<(Tensor, Tensor)> {
    let w = match mask {
        Some(m) => m.flatten_all()?.to_dtype(acc)?,
        None => Tensor::ones(t.elem_count(), acc, t.device())?,
    };
    match ignore {
        Some(ig) => {
            let keep = t.ne(ig)?;
            let t = keep.where_cond(t, &t.zeros_like()?)?;
            Ok((t, (w * keep.to_dtype(acc)?)?))
        }
        None => Ok((t.clone(), w)),
    }
}

/// The op on the logits; targets and mask (flat, mask in the accumulation dtype) are held.
struct CeOp {
    targets: Tensor,
    mask: Option<Tensor>,
    ignore: Option<u32>,
    v: usize,
    /// Per-row log-sum-exp, `[N]`, f32 (f64 for f64).
    lse: Saved,
    /// `max(sum w, 1)`, a scalar in the same dtype.
    count: Saved,
    /// Forward and backward run the Triton kernels (CUDA, `cross_entropy/cuda.rs`).
    triton: bool,
}

/// The weight of row `i`.
#[inline(always)]
fn weight<A: Real>(i: usize, t: &[u32], mask: Option<&[A]>, ignore: Option<u32>) -> A {
    if Some(t[i]) == ignore {
        A::ZERO
    } else {
        mask.map_or(A::ONE, |m| m[i])
    }
}

/// Log-sum-exp of a row (8 lanes). The max skips NaN, but a NaN still reaches the sum of
/// exponentials, so the result is NaN.
#[inline(always)]
fn row_lse<T: Elem>(row: &[T]) -> T::Acc
where
    T::Acc: FastMath,
{
    let mut mx = [T::Acc::NEG_INFINITY; 8];
    let mut it = row.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            let v = c[l].acc();
            mx[l] = if v > mx[l] { v } else { mx[l] };
        }
    }
    let mut m = mx[0];
    for &v in &mx[1..] {
        m = if v > m { v } else { m };
    }
    for v in it.remainder() {
        let v = v.acc();
        m = if v > m { v } else { m };
    }
    let s = cpu::sum_map(row, |v| (v.acc() - m).exp_fast());
    m + s.ln()
}

/// `(lse per row, loss, count)`; rows of weight 0 are skipped (lse 0).
fn fwd_kernel<T: Elem>(
    l: &[T],
    v: usize,
    t: &[u32],
    mask: Option<&[T::Acc]>,
    ignore: Option<u32>,
) -> (Vec<T::Acc>, f64, f64)
where
    T::Acc: FastMath,
{
    let mut lse = vec![T::Acc::ZERO; t.len()];
    cpu::for_rows(&mut lse, 1, v, |i, o| {
        if weight(i, t, mask, ignore) != T::Acc::ZERO {
            o[0] = row_lse(&l[i * v..(i + 1) * v]);
        }
    });
    let (mut loss, mut count) = (0f64, 0f64);
    for (i, s) in lse.iter().enumerate() {
        let w = weight(i, t, mask, ignore);
        count += w.f64();
        if w != T::Acc::ZERO {
            loss += w.f64() * (*s - l[i * v + t[i] as usize].acc()).f64();
        }
    }
    let count = count.max_nan(1.0);
    (lse, loss / count, count)
}

/// `dlogits` with `scale = g / count`.
fn bwd_kernel<T: Elem>(
    l: &[T],
    v: usize,
    t: &[u32],
    mask: Option<&[T::Acc]>,
    ignore: Option<u32>,
    lse: &[T::Acc],
    scale: f64,
) -> Vec<T>
where
    T::Acc: FastMath,
{
    let zero = T::Acc::ZERO;
    let mut d = vec![T::from_acc(zero); l.len()];
    cpu::for_rows(&mut d, v, 2 * v, |i, dr| {
        let w = weight(i, t, mask, ignore);
        if w == zero {
            return;
        }
        let coef = T::Acc::c(scale) * w;
        let s = lse[i];
        let lr = &l[i * v..(i + 1) * v];
        for (o, x) in dr.iter_mut().zip(lr) {
            *o = T::from_acc(coef * (x.acc() - s).exp_fast());
        }
        let ti = t[i] as usize;
        dr[ti] = T::from_acc(coef * ((lr[ti].acc() - s).exp_fast() - T::Acc::ONE));
    });
    d
}

impl CeOp {
    /// `(loss, lse [N], count)` from plain ops on detached logits (devices without a kernel).
    fn composite_fwd(&self, logits: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let acc = acc_dtype(logits.dtype());
        let n = self.targets.elem_count();
        let lf = logits.to_dtype(acc)?.reshape((n, self.v))?;
        let (t, w) = weights(&self.targets, self.mask.as_ref(), self.ignore, acc)?;
        let mx = lf.max_keepdim(1)?;
        let lse = (lf.broadcast_sub(&mx)?.exp()?.sum_keepdim(1)?.log()? + mx)?;
        let nll = (&lse - lf.gather(&t.unsqueeze(1)?, 1)?)?.squeeze(1)?;
        let keep = w.ne(0.0)?;
        let contrib = keep.where_cond(&(nll * &w)?, &w.zeros_like()?)?;
        let count = w.sum_all()?.maximum(1.0)?;
        let loss = contrib.sum_all()?.div(&count)?;
        Ok((loss, lse.squeeze(1)?, count))
    }

    /// The logits' gradient from plain ops on detached tensors.
    fn composite_bwd(&self, logits: &Tensor, g: &Tensor) -> Result<Tensor> {
        let dt = logits.dtype();
        let acc = acc_dtype(dt);
        let (n, v) = (self.targets.elem_count(), self.v);
        let lf = logits.detach().to_dtype(acc)?.reshape((n, v))?;
        let (t, w) = weights(&self.targets, self.mask.as_ref(), self.ignore, acc)?;
        let lse = self.lse.get()?.reshape((n, 1))?;
        let count = self.count.get()?;
        let coef = w
            .broadcast_mul(&g.detach().to_dtype(acc)?)?
            .broadcast_div(&count)?
            .reshape((n, 1))?;
        let p = lf.broadcast_sub(&lse)?.exp()?;
        let cols = Tensor::arange(0u32, v as u32, logits.device())?.reshape((1, v))?;
        let onehot = cols.broadcast_eq(&t.reshape((n, 1))?)?.to_dtype(acc)?;
        let d = (p - onehot)?.broadcast_mul(&coef)?;
        let keep = w.ne(0.0)?.reshape((n, 1))?.broadcast_as((n, v))?;
        let d = keep.where_cond(&d, &d.zeros_like()?)?;
        d.to_dtype(dt)?.reshape(logits.shape())
    }
}

impl Kernel for CeOp {
    fn name(&self) -> &'static str {
        "candle-fused-cross-entropy"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let (s, l) = ins[0];
        let v = self.v;
        cpu::dispatch!(s.dtype(), T => {
            let ls = cpu::contiguous::<T>(s, l)?;
            with_u32(&self.targets, |ts| {
                let run = |mask: Option<&[<T as Elem>::Acc]>| -> Result<(CpuStorage, Shape)> {
                    let (lse, loss, count) = fwd_kernel::<T>(ls, v, ts, mask, self.ignore);
                    let n = lse.len();
                    self.lse.set(cpu::tensor(lse, n)?);
                    self.count.set(Tensor::new(<<T as Elem>::Acc as Real>::c(count), &candle_core::Device::Cpu)?);
                    let out = vec![<<T as Elem>::Acc as Real>::c(loss)];
                    Ok((<<T as Elem>::Acc as Elem>::storage(out), Shape::from(())))
                };
                match &self.mask {
                    Some(m) => cpu::with_slice::<<T as Elem>::Acc, _>(m, |ms| run(Some(ms))),
                    None => run(None),
                }
            })
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        cuda::fwd(self, ins[0])
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Grads> {
        let logits = ins[0];
        let lse = self.lse.get()?;
        op::triton_path!(
            self.triton,
            self.name(),
            Ok([Some(cuda::bwd(self, logits, &lse, g)?), None, None])
        );
        if !(cpu::has_kernel(logits) && g.device().is_cpu() && lse.device().is_cpu()) {
            return Ok([Some(self.composite_bwd(logits, g)?), None, None]);
        }
        let logits = logits.contiguous()?;
        let lse = lse.contiguous()?;
        let count = self.count.get()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let g = g.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let scale = g / count;
        let v = self.v;
        cpu::dispatch!(logits.dtype(), T => {
            cpu::with_slice::<T, _>(&logits, |ls| {
                cpu::with_slice::<<T as Elem>::Acc, _>(&lse, |ss| {
                    with_u32(&self.targets, |ts| {
                        let d = match &self.mask {
                            Some(m) => cpu::with_slice::<<T as Elem>::Acc, _>(m, |ms| {
                                Ok(bwd_kernel::<T>(ls, v, ts, Some(ms), self.ignore, ss, scale))
                            })?,
                            None => bwd_kernel::<T>(ls, v, ts, None, self.ignore, ss, scale),
                        };
                        Ok([Some(cpu::tensor(d, logits.shape())?), None, None])
                    })
                })
            })
        })
    }
}
