//! Bias + tanh GELU on CUDA through the Triton kernels (`triton/gelu.py`, launch table
//! `cuda_kernels/gelu.rs`). The kernels reproduce the CPU kernel's `exp_f32` / `tanh_f32` and
//! formulas operation for operation, so `y` and `dx` are the CPU's bits. With a bias, the
//! backward writes `dx` and the `db` partial sums over fixed blocks of `ROWS_PER_PROGRAM` rows
//! in one kernel, then adds the partial rows in order and rounds once (no atomics: the same
//! bits on every run; the CPU's bits up to 4096 rows, where its row blocks are also 16).

use crate::cuda_kernels::gelu::ROWS_PER_PROGRAM;
use crate::cuda_kernels::launch::{cuda_of, launch, rows_cols, Buf, CudaIn, Output};
use crate::cuda_kernels::triton_input;
use crate::op::Grads;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Device, Result, Shape, Tensor};

/// `y = gelu(x)` by `gelu_fwd` over the flattened `x`.
pub(super) fn fwd((sx, lx): CudaIn<'_>) -> Result<(CudaStorage, Shape)> {
    let (dt, n) = (sx.dtype(), lx.shape().elem_count());
    let mut y = Output::new(sx.device(), lx.shape().clone(), dt)?;
    let tensors = vec![
        Buf::read(sx, lx).view(&[n])?,
        Buf::write(&mut y).view(&[n])?,
    ];
    launch("gelu_fwd", dt, tensors, &[])?;
    Ok(y.into_parts())
}

/// `y = gelu(x + b)` by `bias_gelu_fwd`, `x` seen as `[N, C]`.
pub(super) fn bias_fwd((sx, lx): CudaIn<'_>, (sb, lb): CudaIn<'_>) -> Result<(CudaStorage, Shape)> {
    let dt = sx.dtype();
    let (n, c) = rows_cols(lx.dims());
    let mut y = Output::new(sx.device(), lx.shape().clone(), dt)?;
    let tensors = vec![
        Buf::read(sx, lx).view(&[n, c])?,
        Buf::read(sb, lb),
        Buf::write(&mut y).view(&[n, c])?,
    ];
    launch("bias_gelu_fwd", dt, tensors, &[])?;
    Ok(y.into_parts())
}

/// `[dx, db, None]`: `gelu_bwd` without a bias; with one, `bias_gelu_bwd_dx` (+ the `db`
/// partial sums) and `bias_gelu_bwd_db` (only when `b` needs its gradient). Nothing is
/// launched when neither input needs a gradient.
pub(super) fn bwd(
    x: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    [need_x, need_b]: [bool; 2],
) -> Result<Grads> {
    let need_b = need_b && b.is_some();
    if !(need_x || need_b) {
        return Ok([None, None, None]);
    }
    let dt = x.dtype();
    let Device::Cuda(dev) = x.device() else {
        bail!("bias_gelu: the Triton backward needs CUDA tensors")
    };
    let x = triton_input(x)?;
    let dy = triton_input(&dy.to_dtype(dt)?)?;
    let mut dx = Output::new(dev, x.shape().clone(), dt)?;
    let (gx, lx) = x.storage_and_layout();
    let (gd, ld) = dy.storage_and_layout();
    let (sx, sd) = (cuda_of(&gx)?, cuda_of(&gd)?);
    let Some(b) = b else {
        let e = x.elem_count();
        let tensors = vec![
            Buf::read(sx, lx).view(&[e])?,
            Buf::read(sd, ld).view(&[e])?,
            Buf::write(&mut dx).view(&[e])?,
        ];
        launch("gelu_bwd", dt, tensors, &[])?;
        return Ok([Some(dx.into_tensor()), None, None]);
    };
    let b = triton_input(b)?;
    let (gb, lb) = b.storage_and_layout();
    let (n, c) = rows_cols(x.dims());
    let mut db_partial = Output::new(dev, (n.div_ceil(ROWS_PER_PROGRAM), c), DType::F32)?;
    let tensors = vec![
        Buf::read(sx, lx).view(&[n, c])?,
        Buf::read(cuda_of(&gb)?, lb),
        Buf::read(sd, ld).view(&[n, c])?,
        Buf::write(&mut dx).view(&[n, c])?,
        Buf::write(&mut db_partial),
    ];
    launch("bias_gelu_bwd_dx", dt, tensors, &[])?;
    let db = need_b
        .then(|| db_partial.reduce_rows("bias_gelu_bwd_db", dt))
        .transpose()?;
    Ok([need_x.then(|| dx.into_tensor()), db, None])
}
