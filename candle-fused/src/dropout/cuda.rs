//! Dropout on CUDA through the Triton kernel (`triton/dropout.py`, launch table
//! `cuda_kernels/dropout.rs`): the mask is drawn inside the kernel from Philox4x32-10 with the
//! CPU kernel's counter layout, uniform and keep scale, so the forward, the backward (the same
//! kernel on `dy`) and [`super::dropout_mask`] give the CPU's bits with no host round trip.

use crate::cuda_kernels::dropout::scalars;
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, CudaIn, Output};
use crate::cuda_kernels::triton_input;
use crate::philox::RngKey;
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Result, Shape, Tensor};

/// `x * mask` of `(p, key)` by the `dropout` kernel, `x` contiguous and aligned.
fn run((sx, lx): CudaIn<'_>, p: f32, key: RngKey) -> Result<Output> {
    let (dt, n) = (sx.dtype(), lx.shape().elem_count());
    let mut y = Output::new(sx.device(), lx.shape().clone(), dt)?;
    let tensors = vec![
        Buf::read(sx, lx).view(&[n])?,
        Buf::write(&mut y).view(&[n])?,
    ];
    launch("dropout", dt, tensors, &scalars(p, key, dt)?)?;
    Ok(y)
}

/// The forward: `x * mask`, as `Kernel::cuda_fwd` returns it.
pub(super) fn fwd(x: CudaIn<'_>, p: f32, key: RngKey) -> Result<(CudaStorage, Shape)> {
    Ok(run(x, p, key)?.into_parts())
}

/// `t * mask` as a tensor outside any graph: the backward on `dy` (the same key gives the same
/// mask) and `dropout_mask` on ones (`1 * m == m` exactly).
pub(super) fn masked(t: &Tensor, p: f32, key: RngKey) -> Result<Tensor> {
    let t = triton_input(t)?;
    let (s, l) = t.storage_and_layout();
    Ok(run((cuda_of(&s)?, l), p, key)?.into_tensor())
}
