//! RMSNorm and LayerNorm on CUDA through the Triton kernels (`triton/rms_norm.py`,
//! `triton/layer_norm.py`; launch tables `cuda_kernels/{rms_norm,layer_norm}.rs`): the forward
//! saves `rstd` (and LayerNorm's `mean`), f32; the backward computes `dx` and the `dW` (and
//! `dB`) partial sums over fixed blocks of `ROWS_PER_PROGRAM` rows in one kernel, then adds
//! the partial rows in order (no atomics: the same bits on every run). The formulas are the CPU
//! kernel's (`kernel.rs`), as the interpreter check of the Triton source verifies.

use crate::cuda_kernels::launch::{cuda_of, launch, rows_cols, Buf, CudaIn, Output};
use crate::cuda_kernels::{layer_norm, rms_norm::ROWS_PER_PROGRAM, triton_input, Scalar};
use crate::op::{Grads, Saved};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Device, Result, Shape, Tensor};

/// `y = x * rstd * w` by `rms_norm_fwd`, one program per row; `rstd` ([N], f32) into `saved`.
pub(super) fn rms_fwd(
    (sx, lx): CudaIn<'_>,
    (sw, lw): CudaIn<'_>,
    eps: f64,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let (dt, dev) = (sx.dtype(), sx.device());
    let (n, c) = rows_cols(lx.dims());
    let mut y = Output::new(dev, lx.shape().clone(), dt)?;
    let mut rstd = Output::new(dev, n, DType::F32)?;
    let tensors = vec![
        Buf::read(sx, lx).view(&[n, c])?,
        Buf::read(sw, lw),
        Buf::write(&mut y).view(&[n, c])?,
        Buf::write(&mut rstd),
    ];
    // eps in f32, as the CPU kernel's f32 statistics take it
    launch("rms_norm_fwd", dt, tensors, &[Scalar::F32(eps as f32)])?;
    saved.set(rstd.into_tensor());
    Ok(y.into_parts())
}

/// `[dx, dw, None]` by `rms_norm_bwd_dx` (+ the `dW` partial sums) and `rms_norm_bwd_dw` (only
/// when `w` needs its gradient).
pub(super) fn rms_bwd(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    rstd: &Tensor,
    [need_x, need_w, _]: [bool; 3],
) -> Result<Grads> {
    let dt = x.dtype();
    let (n, c) = rows_cols(x.dims());
    let Device::Cuda(dev) = x.device() else {
        bail!("rms_norm: the Triton backward needs CUDA tensors")
    };
    let (x, w, rstd) = (triton_input(x)?, triton_input(w)?, triton_input(rstd)?);
    let dy = triton_input(&dy.to_dtype(dt)?)?;
    let p = n.div_ceil(ROWS_PER_PROGRAM);
    let mut dx = Output::new(dev, x.shape().clone(), dt)?;
    let mut dw_partial = Output::new(dev, (p, c), DType::F32)?;
    {
        let (gx, lx) = x.storage_and_layout();
        let (gw, lw) = w.storage_and_layout();
        let (gd, ld) = dy.storage_and_layout();
        let (gr, lr) = rstd.storage_and_layout();
        let tensors = vec![
            Buf::read(cuda_of(&gx)?, lx).view(&[n, c])?,
            Buf::read(cuda_of(&gw)?, lw),
            Buf::read(cuda_of(&gd)?, ld).view(&[n, c])?,
            Buf::read(cuda_of(&gr)?, lr).view(&[n])?,
            Buf::write(&mut dx).view(&[n, c])?,
            Buf::write(&mut dw_partial),
        ];
        launch("rms_norm_bwd_dx", dt, tensors, &[])?;
    }
    let dw = need_w
        .then(|| dw_partial.reduce_rows("rms_norm_bwd_dw", dt))
        .transpose()?;
    Ok([need_x.then(|| dx.into_tensor()), dw, None])
}

/// `y = (x - mean) * rstd * w (+ b)` by `layer_norm_fwd` (with a bias) or
/// `layer_norm_fwd_no_bias`, one program per row; `mean` and `rstd` ([N], f32) into the slots.
pub(super) fn layer_fwd(
    (sx, lx): CudaIn<'_>,
    (sw, lw): CudaIn<'_>,
    b: Option<CudaIn<'_>>,
    eps: f64,
    [saved_mean, saved_rstd]: [&Saved; 2],
) -> Result<(CudaStorage, Shape)> {
    let (dt, dev) = (sx.dtype(), sx.device());
    let (n, c) = rows_cols(lx.dims());
    let mut y = Output::new(dev, lx.shape().clone(), dt)?;
    let mut mean = Output::new(dev, n, DType::F32)?;
    let mut rstd = Output::new(dev, n, DType::F32)?;
    let mut tensors = vec![Buf::read(sx, lx).view(&[n, c])?, Buf::read(sw, lw)];
    // the bias entry takes `B` right after `W`; the other entry has no such parameter
    let entry = match b {
        Some((sb, lb)) => {
            tensors.push(Buf::read(sb, lb));
            "layer_norm_fwd"
        }
        None => "layer_norm_fwd_no_bias",
    };
    tensors.extend([
        Buf::write(&mut y).view(&[n, c])?,
        Buf::write(&mut mean),
        Buf::write(&mut rstd),
    ]);
    // eps in f32, as the CPU kernel's f32 statistics take it
    launch(entry, dt, tensors, &[Scalar::F32(eps as f32)])?;
    saved_mean.set(mean.into_tensor());
    saved_rstd.set(rstd.into_tensor());
    Ok(y.into_parts())
}

/// `[dx, dw, db]` by `layer_norm_bwd_dx` (`_no_bias` without a bias: no `dB` partial sums),
/// then `layer_norm_bwd_reduce` once for `dw` and once for `db`, each only when needed.
pub(super) fn layer_bwd(
    x: &Tensor,
    w: &Tensor,
    has_b: bool,
    dy: &Tensor,
    [mean, rstd]: [&Tensor; 2],
    [need_x, need_w, need_b]: [bool; 3],
) -> Result<Grads> {
    let dt = x.dtype();
    let (n, c) = rows_cols(x.dims());
    let Device::Cuda(dev) = x.device() else {
        bail!("layer_norm: the Triton backward needs CUDA tensors")
    };
    let (x, w) = (triton_input(x)?, triton_input(w)?);
    let (mean, rstd) = (triton_input(mean)?, triton_input(rstd)?);
    let dy = triton_input(&dy.to_dtype(dt)?)?;
    let p = n.div_ceil(layer_norm::ROWS_PER_PROGRAM);
    let mut dx = Output::new(dev, x.shape().clone(), dt)?;
    let mut dw_partial = Output::new(dev, (p, c), DType::F32)?;
    // the bias entry writes the dB partial sums whether or not b needs its gradient
    let mut db_partial = has_b
        .then(|| Output::new(dev, (p, c), DType::F32))
        .transpose()?;
    {
        let (gx, lx) = x.storage_and_layout();
        let (gw, lw) = w.storage_and_layout();
        let (gd, ld) = dy.storage_and_layout();
        let (gm, lm) = mean.storage_and_layout();
        let (gr, lr) = rstd.storage_and_layout();
        let mut tensors = vec![
            Buf::read(cuda_of(&gx)?, lx).view(&[n, c])?,
            Buf::read(cuda_of(&gw)?, lw),
            Buf::read(cuda_of(&gd)?, ld).view(&[n, c])?,
            Buf::read(cuda_of(&gm)?, lm).view(&[n])?,
            Buf::read(cuda_of(&gr)?, lr).view(&[n])?,
            Buf::write(&mut dx).view(&[n, c])?,
            Buf::write(&mut dw_partial),
        ];
        let entry = match db_partial.as_mut() {
            Some(db_partial) => {
                tensors.push(Buf::write(db_partial));
                "layer_norm_bwd_dx"
            }
            None => "layer_norm_bwd_dx_no_bias",
        };
        launch(entry, dt, tensors, &[])?;
    }
    let reduce = "layer_norm_bwd_reduce";
    let dw = need_w
        .then(|| dw_partial.reduce_rows(reduce, dt))
        .transpose()?;
    let db = match &db_partial {
        Some(partial) if need_b => Some(partial.reduce_rows(reduce, dt)?),
        _ => None,
    };
    Ok([need_x.then(|| dx.into_tensor()), dw, db])
}
