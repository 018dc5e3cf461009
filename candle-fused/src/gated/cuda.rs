//! The gated activations on CUDA through the Triton kernels (SwiGLU: `triton/swiglu.py`,
//! `cuda_kernels/swiglu.rs`; GeGLU: `geglu_*` of `triton/gelu.py`, `cuda_kernels/gelu.rs`): one
//! elementwise pass each way over the flattened tensors, the CPU kernel's formulas and
//! operation order (its `exp_f32` / `tanh_f32`, correctly rounded divisions), so `y`, `d_gate`
//! and `d_up` are the CPU's bits. Nothing is saved: the backward recomputes the activation
//! from `gate` and writes both gradients in one pass.

use crate::cuda_kernels::launch::{cuda_of, launch, Buf, CudaIn, Output};
use crate::cuda_kernels::triton_input;
use crate::op::Grads;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, Device, Result, Shape, Tensor};

/// `y = act(gate) * up` by the forward `entry` (`gate`, `up` contiguous and aligned:
/// `triton_input`).
pub(super) fn fwd(
    entry: &str,
    (sg, lg): CudaIn<'_>,
    (su, lu): CudaIn<'_>,
) -> Result<(CudaStorage, Shape)> {
    let (dt, n) = (sg.dtype(), lg.shape().elem_count());
    let mut y = Output::new(sg.device(), lg.shape().clone(), dt)?;
    let tensors = vec![
        Buf::read(sg, lg).view(&[n])?,
        Buf::read(su, lu).view(&[n])?,
        Buf::write(&mut y).view(&[n])?,
    ];
    launch(entry, dt, tensors, &[])?;
    Ok(y.into_parts())
}

/// `[d_gate, d_up, None]` by the backward `entry` (both written in one pass; each returned
/// where its input needs it).
pub(super) fn bwd(
    entry: &str,
    gate: &Tensor,
    up: &Tensor,
    dy: &Tensor,
    [need_gate, need_up]: [bool; 2],
) -> Result<Grads> {
    let (dt, n) = (gate.dtype(), gate.elem_count());
    let Device::Cuda(dev) = gate.device() else {
        bail!("{entry}: the Triton backward needs CUDA tensors")
    };
    let (gate, up) = (triton_input(gate)?, triton_input(up)?);
    let dy = triton_input(&dy.to_dtype(dt)?)?;
    let mut d_gate = Output::new(dev, gate.shape().clone(), dt)?;
    let mut d_up = Output::new(dev, gate.shape().clone(), dt)?;
    {
        let (gg, lg) = gate.storage_and_layout();
        let (gu, lu) = up.storage_and_layout();
        let (gd, ld) = dy.storage_and_layout();
        let tensors = vec![
            Buf::read(cuda_of(&gg)?, lg).view(&[n])?,
            Buf::read(cuda_of(&gu)?, lu).view(&[n])?,
            Buf::read(cuda_of(&gd)?, ld).view(&[n])?,
            Buf::write(&mut d_gate).view(&[n])?,
            Buf::write(&mut d_up).view(&[n])?,
        ];
        launch(entry, dt, tensors, &[])?;
    }
    Ok([
        need_gate.then(|| d_gate.into_tensor()),
        need_up.then(|| d_up.into_tensor()),
        None,
    ])
}
