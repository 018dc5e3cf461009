//! The embedding backward on CUDA through the Triton kernel (`triton/embedding.py`, launch
//! table `cuda_kernels/embedding.rs`): the host's segments (positions sorted by id, each id's
//! start) copied to the device (no read-back), then one `embedding_bwd` launch writing every
//! row of `dW` once, each summed in f32 in ascending position: the CPU kernel's bits.

use super::Segments;
use crate::cuda_kernels::embedding::BLOCK_C;
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, Output};
use crate::cuda_kernels::table::MAX_GRID_YZ;
use crate::cuda_kernels::triton_input;
use candle_core::{bail, DType, Device, Result, Tensor};

/// Whether the kernel takes a `[V, C]` table over `n` ids: every size an i32, the column
/// blocks within the grid's y limit.
pub(super) fn fits(v: usize, c: usize, n: usize) -> bool {
    [v, c, n].iter().all(|&x| i32::try_from(x).is_ok()) && c.div_ceil(BLOCK_C) <= MAX_GRID_YZ
}

/// `dW [V, C]` in `dt` from `dy [.., C]` and the segments.
pub(super) fn bwd(dy: &Tensor, dt: DType, seg: &Segments, v: usize, c: usize) -> Result<Tensor> {
    let Device::Cuda(dev) = dy.device() else {
        bail!("embedding: the Triton backward needs CUDA tensors")
    };
    let n = seg.order.len();
    let dy = triton_input(&dy.to_dtype(dt)?)?;
    let order = Tensor::from_slice(&seg.order, n, dy.device())?;
    let start = Tensor::from_slice(&seg.start[..v], v, dy.device())?;
    let mut dw = Output::new(dev, (v, c), dt)?;
    let (gd, ld) = dy.storage_and_layout();
    let (go, lo) = order.storage_and_layout();
    let (gs, ls) = start.storage_and_layout();
    let tensors = vec![
        Buf::read(cuda_of(&gd)?, ld).view(&[n, c])?,
        Buf::read(cuda_of(&go)?, lo),
        Buf::read(cuda_of(&gs)?, ls),
        Buf::write(&mut dw),
    ];
    launch("embedding_bwd", dt, tensors, &[])?;
    Ok(dw.into_tensor())
}
