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
//!
//! **The multi-tensor forms** ([`update_multi`], [`sum_of_squares_multi`]) launch
//! `adamw_update_multi` once per chunk of [`CHUNK`] parameters of one gradient dtype and
//! `sumsq_partial_multi` + `sumsq_total_multi` once per group: the kernels read an i64 table of
//! the members' device addresses and sizes, built here and copied to the device with the
//! launch. The update holds every member's three state storages mutably while it is queued,
//! by the same nesting of in-place ops as the single update (one level per storage: the chunk
//! bounds the depth), so each address comes from `&mut` and each access is recorded on the
//! stream after the launch.

use super::AdamWParam;
use crate::cuda_kernels::adamw::{BLOCK, SUMSQ_BLOCK};
use crate::cuda_kernels::launch::{cuda_of, launch, pointer, Buf, Output};
use crate::cuda_kernels::{triton_input, Scalar};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, SyncOnDrop};
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

/// Parameters per `adamw_update_multi` launch: each holds three nested in-place locks while
/// the launch is queued, so the chunk bounds the nesting (and the stack) at `3 * CHUNK` levels.
pub(super) const CHUNK: usize = 64;

/// One AdamW step of `group` (gradients of one dtype, every member eligible for the Triton
/// update: f32 state, 16-byte aligned) by `adamw_update_multi`, one launch per [`CHUNK`]
/// members; `scalars` as for [`update`] (the group's weight decay; members without decay get
/// the factor 1 from their table row).
pub(super) fn update_multi(group: &[AdamWParam<'_>], scalars: &[Scalar; 9]) -> Result<()> {
    for chunk in group.chunks(CHUNK) {
        let Device::Cuda(dev) = chunk[0].grad.device() else {
            bail!("candle-fused adamw_update_multi: the Triton kernels need CUDA tensors")
        };
        let grads = chunk
            .iter()
            .map(|a| triton_input(a.grad))
            .collect::<Result<Vec<_>>>()?;
        let stream = dev.cuda_stream();
        let guards: Vec<_> = grads.iter().map(|g| g.storage_and_layout()).collect();
        let mut bufs = guards
            .iter()
            .map(|(s, l)| Ok(Buf::read(cuda_of(s)?, l)))
            .collect::<Result<Vec<_>>>()?;
        let mut grad_ptrs = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            grad_ptrs.push(pointer(b, &stream)?);
        }
        let state: Vec<&Tensor> = chunk
            .iter()
            .flat_map(|a| [a.param.as_tensor(), a.exp_avg, a.exp_avg_sq])
            .collect();
        let mut launch_it = |addrs: &[u64]| -> Result<()> {
            let (mut rows, mut first) = (Vec::with_capacity(chunk.len() * 8), 0usize);
            for (i, a) in chunk.iter().enumerate() {
                let e = a.grad.elem_count();
                let s = &addrs[3 * i..3 * i + 3];
                rows.extend([s[0], grad_ptrs[i].0, s[1], s[2]].map(|p| p as i64));
                rows.extend([e as i64, first as i64, a.decay as i64, 0]);
                first += e.div_ceil(BLOCK);
            }
            let table = Tensor::from_vec(rows, (chunk.len(), 8), &Device::Cuda(dev.clone()))?;
            let (ts, tl) = table.storage_and_layout();
            let g0 = &guards[0];
            let mut args = vec![Scalar::I32(i32_of(first)?)];
            args.extend_from_slice(scalars);
            let tensors = vec![
                Buf::read(cuda_of(&ts)?, tl),
                Buf::read(cuda_of(&g0.0)?, g0.1).view(&[grads[0].elem_count()])?,
            ];
            launch("adamw_update_multi", grads[0].dtype(), tensors, &args)?;
            Ok(())
        };
        with_addresses_mut(&state, &stream, &mut Vec::new(), &mut launch_it)?;
    }
    Ok(())
}

/// Calls `f` with the device address of every tensor of `ts` (f32), each storage held
/// mutably through Candle's in-place lock while `f` runs, and its access recorded on `stream`
/// once `f` has returned (the launch queued).
fn with_addresses_mut(
    ts: &[&Tensor],
    stream: &CudaStream,
    addrs: &mut Vec<u64>,
    f: &mut dyn FnMut(&[u64]) -> Result<()>,
) -> Result<()> {
    let Some((t, rest)) = ts.split_first() else {
        return f(addrs);
    };
    t.inplace_op1(&WithMut(Cell::new(Some(
        |s: &mut CudaStorage, l: &Layout| {
            let mut buf = Buf::update(s, l);
            let (addr, guard): (u64, SyncOnDrop<'_>) = pointer(&mut buf, stream)?;
            addrs.push(addr);
            let r = with_addresses_mut(rest, stream, addrs, f);
            drop(guard);
            r
        },
    ))))
}

fn i32_of(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{n} does not fit an i32")))
}

/// `sum_i sum(t_i^2)` over `ts` (one dtype, each eligible for the Triton sum of squares) as a
/// scalar f32 tensor on the device: `sumsq_partial_multi` (one launch: every tensor's f64
/// partial sums over fixed blocks, in one buffer) and `sumsq_total_multi` (each tensor's
/// partials summed in f64 and rounded to f32, those added in f32 in order): the bits of
/// [`sum_of_squares`] added tensor by tensor.
pub(super) fn sum_of_squares_multi(ts: &[&Tensor]) -> Result<Tensor> {
    let Device::Cuda(dev) = ts[0].device() else {
        bail!("candle-fused sum_of_squares_multi: the Triton kernels need CUDA tensors")
    };
    let xs = ts
        .iter()
        .map(|t| triton_input(t))
        .collect::<Result<Vec<_>>>()?;
    let stream = dev.cuda_stream();
    let guards: Vec<_> = xs.iter().map(|x| x.storage_and_layout()).collect();
    let mut bufs = guards
        .iter()
        .map(|(s, l)| Ok(Buf::read(cuda_of(s)?, l)))
        .collect::<Result<Vec<_>>>()?;
    let mut ptrs = Vec::with_capacity(bufs.len());
    for b in bufs.iter_mut() {
        ptrs.push(pointer(b, &stream)?);
    }
    let (mut rows, mut parts) = (Vec::with_capacity(xs.len() * 4), vec![0i64]);
    let mut first = 0usize;
    for (x, (p, _)) in xs.iter().zip(&ptrs) {
        let e = x.elem_count();
        rows.extend([*p as i64, e as i64, first as i64, first as i64]);
        first += e.div_ceil(SUMSQ_BLOCK);
        parts.push(first as i64);
    }
    let device = Device::Cuda(dev.clone());
    let table = Tensor::from_vec(rows, (xs.len(), 4), &device)?;
    let parts = Tensor::from_vec(parts, xs.len() + 1, &device)?;
    let mut partial = Output::new(dev, first, DType::F64)?;
    {
        let (ts_, tl) = table.storage_and_layout();
        let g0 = &guards[0];
        let tensors = vec![
            Buf::read(cuda_of(&ts_)?, tl),
            Buf::write(&mut partial),
            Buf::read(cuda_of(&g0.0)?, g0.1).view(&[xs[0].elem_count()])?,
        ];
        launch(
            "sumsq_partial_multi",
            xs[0].dtype(),
            tensors,
            &[Scalar::I32(i32_of(first)?)],
        )?;
    }
    drop(ptrs);
    let mut total = Output::new(dev, (), DType::F32)?;
    {
        let (ps, pl) = parts.storage_and_layout();
        let tensors = vec![
            Buf::read(cuda_of(&ps)?, pl),
            Buf::read_output(&partial),
            Buf::write(&mut total).view(&[1])?,
        ];
        launch(
            "sumsq_total_multi",
            DType::F32,
            tensors,
            &[Scalar::I32(i32_of(xs.len())?)],
        )?;
    }
    Ok(total.into_tensor())
}
