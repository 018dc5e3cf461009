//! RoPE on CUDA through the Triton kernels (`triton/rope.py`, launch table
//! `cuda_kernels/rope.rs`): `rope_fwd` rotates `x` `[B, T, H, D]` into `y` `[B, H, T, D]`,
//! `rope_bwd` rotates `dy` back by `-angle` into `dx` `[B, T, H, D]`, one program per position.
//! Every tensor is contiguous and 16-byte aligned (`triton_input`); the tables are `[TB, T,
//! D/2]` f32 (`TB = 1` when shared by the batch), as `rope` prepared them; the kernels' `T`,
//! `H`, `HALF`, `TB` arguments are bound from these shapes by `check_launch`, which also checks
//! `D = 2 * HALF` and that `TB` divides `B`. Nothing is reduced, so the results do not depend
//! on the launch, and the formulas (two products and one add or subtract in f32, no FMA) are
//! the CPU kernel's (`kernel.rs`).

use super::Geom;
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, CudaIn, Output};
use crate::cuda_kernels::triton_input;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Device, Result, Shape, Tensor};

/// `y [B, H, T, D]` from `x [B, T, H, D]` (contiguous) by `rope_fwd`.
pub(super) fn fwd(
    (sx, lx): CudaIn<'_>,
    g: &Geom,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(CudaStorage, Shape)> {
    let (dt, dev) = (sx.dtype(), sx.device());
    let dd = 2 * g.half;
    let mut y = Output::new(dev, (g.b, g.h, g.t, dd), dt)?;
    let (gc, lc) = cos.storage_and_layout();
    let (gs, ls) = sin.storage_and_layout();
    let tensors = vec![
        Buf::read(sx, lx),
        Buf::read(cuda_of(&gc)?, lc),
        Buf::read(cuda_of(&gs)?, ls),
        Buf::write(&mut y),
    ];
    launch("rope_fwd", dt, tensors, &[])?;
    Ok(y.into_parts())
}

/// `dx [B, T, H, D]` (in `dt`, x's dtype) from `dy [B, H, T, D]` by `rope_bwd`.
pub(super) fn bwd(dy: &Tensor, g: &Geom, cos: &Tensor, sin: &Tensor, dt: DType) -> Result<Tensor> {
    let Device::Cuda(dev) = dy.device() else {
        bail!("rope: the Triton backward needs CUDA tensors")
    };
    let dy = triton_input(&dy.to_dtype(dt)?)?;
    let mut dx = Output::new(dev, (g.b, g.t, g.h, 2 * g.half), dt)?;
    {
        let (gd, ld) = dy.storage_and_layout();
        let (gc, lc) = cos.storage_and_layout();
        let (gs, ls) = sin.storage_and_layout();
        let tensors = vec![
            Buf::read(cuda_of(&gd)?, ld),
            Buf::read(cuda_of(&gc)?, lc),
            Buf::read(cuda_of(&gs)?, ls),
            Buf::write(&mut dx),
        ];
        launch("rope_bwd", dt, tensors, &[])?;
    }
    Ok(dx.into_tensor())
}
