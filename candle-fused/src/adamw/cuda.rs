//! AdamW and the sum of squares on CUDA through the Triton kernels (`triton/adamw.py`, launch
//! table `cuda_kernels/adamw.rs`).
//!
//! **The update** is one kernel that reads the gradient and writes `param`, `exp_avg` and
//! `exp_avg_sq` in place, bit-identical to the CPU's three passes (the same f32 operations in
//! the same order, the constants rounded as the CPU rounds them). It writes three tensors, so
//! it holds all three storages mutably: Candle's in-place ops lock one destination each, and
//! are nested here (`exp_avg`, then `exp_avg_sq`, then `param` with the gradient as its source),
//! so the kernel gets each through `&mut` and nothing is written through a read lock. The
//! storages are distinct (`check_args`), so the nested locks cannot meet each other.
//!
//! **The sum of squares** is `sumsq_partial` (f64 sums over fixed blocks of 1024 elements) and
//! `sumsq_total` (their ordered f64 sum, rounded once to f32), a scalar left on the device:
//! `global_norm` still adds the tensors' sums there and reads the total back once.

use crate::cuda_kernels::adamw::SUMSQ_BLOCK;
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, Output};
use crate::cuda_kernels::{triton_input, Scalar};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, DType, Device, InplaceOp1, InplaceOp2, Layout, Result, Tensor,
};
use std::cell::Cell;

/// An in-place op on one tensor that hands its storage, mutably, to a closure (once).
struct WithMut<F>(Cell<Option<F>>);

impl<F: FnOnce(&mut CudaStorage, &Layout) -> Result<()>> InplaceOp1 for WithMut<F> {
    fn name(&self) -> &'static str {
        "candle-fused-adamw-update"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("candle-fused adamw: the Triton update runs on CUDA only")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        match self.0.take() {
            Some(f) => f(s, l),
            None => bail!("candle-fused adamw: in-place op run twice"),
        }
    }
}

/// [`WithMut`] with a source tensor read beside the destination.
struct WithMutSrc<F>(Cell<Option<F>>);

impl<F> InplaceOp2 for WithMutSrc<F>
where
    F: FnOnce(&mut CudaStorage, &Layout, &CudaStorage, &Layout) -> Result<()>,
{
    fn name(&self) -> &'static str {
        "candle-fused-adamw-update"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("candle-fused adamw: the Triton update runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        s: &mut CudaStorage,
        l: &Layout,
        src: &CudaStorage,
        src_l: &Layout,
    ) -> Result<()> {
        match self.0.take() {
            Some(f) => f(s, l, src, src_l),
            None => bail!("candle-fused adamw: in-place op run twice"),
        }
    }
}

/// One AdamW step by `adamw_update`, in place. `param`, `exp_avg`, `exp_avg_sq`: f32,
/// contiguous, 16-byte aligned, distinct storages (checked by the caller); `scalars`: the
/// step's constants (`cuda_kernels::adamw::scalars`).
pub(super) fn update(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    scalars: &[Scalar; 9],
) -> Result<()> {
    let grad = triton_input(grad)?;
    let n = param.elem_count();
    exp_avg.inplace_op1(&WithMut(Cell::new(Some(
        |sm: &mut CudaStorage, lm: &Layout| {
            exp_avg_sq.inplace_op1(&WithMut(Cell::new(Some(
                |sv: &mut CudaStorage, lv: &Layout| {
                    param.inplace_op2(
                        &grad,
                        &WithMutSrc(Cell::new(Some(
                            |sp: &mut CudaStorage, lp: &Layout, sg: &CudaStorage, lg: &Layout| {
                                let tensors = vec![
                                    Buf::update(sp, lp).view(&[n])?,
                                    Buf::read(sg, lg).view(&[n])?,
                                    Buf::update(sm, lm).view(&[n])?,
                                    Buf::update(sv, lv).view(&[n])?,
                                ];
                                launch("adamw_update", sg.dtype(), tensors, scalars)?;
                                Ok(())
                            },
                        ))),
                    )
                },
            ))))
        },
    ))))
}

/// `sum(t^2)` as a scalar f32 tensor on the device: `sumsq_partial`, then `sumsq_total`.
pub(super) fn sum_of_squares(t: &Tensor) -> Result<Tensor> {
    let Device::Cuda(dev) = t.device() else {
        bail!("candle-fused sum_of_squares: the Triton kernels need a CUDA tensor")
    };
    let t = triton_input(t)?;
    let e = t.elem_count();
    let mut partial = Output::new(dev, e.div_ceil(SUMSQ_BLOCK), DType::F64)?;
    {
        let (g, l) = t.storage_and_layout();
        let tensors = vec![
            Buf::read(cuda_of(&g)?, l).view(&[e])?,
            Buf::write(&mut partial),
        ];
        launch("sumsq_partial", t.dtype(), tensors, &[])?;
    }
    let mut total = Output::new(dev, (), DType::F32)?;
    let tensors = vec![
        Buf::read_output(&partial),
        Buf::write(&mut total).view(&[1])?,
    ];
    // one variant: it reads only the f64 partials
    launch("sumsq_total", DType::F32, tensors, &[])?;
    Ok(total.into_tensor())
}
