//! Cross-entropy on CUDA through the Triton kernels (`triton/cross_entropy.py`, launch table
//! `cuda_kernels/cross_entropy.rs`): the forward is `ce_fwd` (per-row `nll` and `lse`, f32,
//! `lse` saved) and the loss `Σ w nll / max(Σ w, 1)` formed from them on the device (in f64,
//! as the CPU kernel adds it); the backward is `ce_bwd` into a fresh `[N, V]` gradient. No value
//! is read back to the host on either side: the upstream gradient `g` and the count stay on the
//! device, folded into the kernel's per-row weights (`scale` is 1), which gives the CPU kernel's
//! coefficient `f32(g / count) w` bit for bit (an f32 quotient is the f64 one rounded).

use super::CeOp;
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, CudaIn, Output};
use crate::cuda_kernels::{triton_input, Scalar};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Device, Result, Shape, Tensor};

/// The kernels' `ignore_index`: the u32's bits as an i32, -1 for none (no target of a counted
/// row can be `u32::MAX`: targets are checked `< V`, and `V` fits an i32).
fn ignore_bits(op: &CeOp) -> i32 {
    op.ignore.map_or(-1, |i| i as i32)
}

/// The per-row weights the kernels take: the mask (f32) or ones, `[N]`.
fn weights(op: &CeOp, n: usize, dev: &Device) -> Result<Tensor> {
    match &op.mask {
        Some(m) => Ok(m.clone()),
        None => Tensor::ones(n, DType::F32, dev),
    }
}

/// The loss from `ce_fwd`'s `nll`: `(loss, count)`, as the CPU kernel forms them: the weights
/// of ignored rows 0 (whatever the mask holds there), sums in f64, the loss rounded to f32
/// once; `count = max(Σ w, 1)` kept in f32 as the CPU op keeps it.
fn loss(op: &CeOp, w: &Tensor, nll: &Tensor) -> Result<(Tensor, Tensor)> {
    let w = match op.ignore {
        Some(ig) => op.targets.ne(ig)?.where_cond(w, &w.zeros_like()?)?,
        None => w.clone(),
    }
    .to_dtype(DType::F64)?;
    let one = Tensor::ones((), DType::F64, w.device())?;
    let count = w.sum_all()?.maximum(&one)?;
    // a skipped row's nll is 0 (not read by the kernel), and so is its weight
    let sum = (w * nll.to_dtype(DType::F64)?)?.sum_all()?;
    let loss = (sum / &count)?.to_dtype(DType::F32)?;
    Ok((loss, count.to_dtype(DType::F32)?))
}

/// The forward: the loss (a scalar f32 storage); `lse` and `count` saved in the op.
pub(super) fn fwd(op: &CeOp, (sl, ll): CudaIn<'_>) -> Result<(CudaStorage, Shape)> {
    let (dt, dev) = (sl.dtype(), sl.device());
    let v = op.v;
    let n = ll.shape().elem_count() / v;
    let w = weights(op, n, &Device::Cuda(dev.clone()))?;
    let mut nll = Output::new(dev, n, DType::F32)?;
    let mut lse = Output::new(dev, n, DType::F32)?;
    {
        let (gt, lt) = op.targets.storage_and_layout();
        let (gw, lw) = w.storage_and_layout();
        let tensors = vec![
            Buf::read(sl, ll).view(&[n, v])?,
            Buf::read(cuda_of(&gt)?, lt),
            Buf::read(cuda_of(&gw)?, lw),
            Buf::write(&mut nll),
            Buf::write(&mut lse),
        ];
        launch("ce_fwd", dt, tensors, &[Scalar::I32(ignore_bits(op))])?;
    }
    let (loss, count) = loss(op, &w, &nll.into_tensor())?;
    op.lse.set(lse.into_tensor());
    op.count.set(count);
    let (s, l) = loss.storage_and_layout();
    Ok((cuda_of(&s)?.try_clone(l)?, Shape::from(())))
}

/// The logits' gradient for the upstream gradient `g` (a scalar on the device).
pub(super) fn bwd(op: &CeOp, logits: &Tensor, lse: &Tensor, g: &Tensor) -> Result<Tensor> {
    let Device::Cuda(dev) = logits.device() else {
        bail!("cross_entropy: the Triton backward needs CUDA tensors")
    };
    let dt = logits.dtype();
    let v = op.v;
    let n = logits.elem_count() / v;
    let (logits, lse) = (triton_input(logits)?, triton_input(lse)?);
    // `scale w` per row, the kernel's `scale` 1; rows of weight 0 stay 0 (skipped) even for a
    // non-finite g, as the CPU kernel skips them
    let s = (g.to_dtype(DType::F32)? / op.count.get()?)?;
    let w = weights(op, n, logits.device())?;
    let zero = w.zeros_like()?;
    let coef = w.ne(&zero)?.where_cond(&w.broadcast_mul(&s)?, &zero)?;
    let mut d = Output::new(dev, logits.shape().clone(), dt)?;
    {
        let (gl, ll) = logits.storage_and_layout();
        let (gt, lt) = op.targets.storage_and_layout();
        let (gc, lc) = coef.storage_and_layout();
        let (gs, ls) = lse.storage_and_layout();
        let tensors = vec![
            Buf::read(cuda_of(&gl)?, ll).view(&[n, v])?,
            Buf::read(cuda_of(&gt)?, lt),
            Buf::read(cuda_of(&gc)?, lc),
            Buf::read(cuda_of(&gs)?, ls).view(&[n])?,
            Buf::write(&mut d).view(&[n, v])?,
        ];
        let scalars = [Scalar::I32(ignore_bits(op)), Scalar::F32(1.0)];
        launch("ce_bwd", dt, tensors, &scalars)?;
    }
    Ok(d.into_tensor())
}
