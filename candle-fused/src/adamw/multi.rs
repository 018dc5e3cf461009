//! Multi-tensor AdamW and sum of squares: a whole group of parameters per call.
//!
//! [`adamw_update_multi`] steps every parameter of a group and [`sum_of_squares_multi`] sums
//! the squares of every gradient of a group. On the CPU they loop over the group with the
//! per-tensor kernels ([`adamw_update`], [`sum_of_squares`]), so the results are those of
//! the per-tensor calls to the last bit (the global norm keeps its bits: the same f64 sums
//! over the same fixed blocks, rounded to f32 per tensor and added in f32 in the group's
//! order). The point of the group is the GPU: the per-tensor kernels cost one launch per
//! parameter (two per gradient for the sum of squares, plus an add), where the multi-tensor
//! Triton kernels of `triton/adamw.py` (`adamw_update_multi`, `sumsq_partial_multi`,
//! `sumsq_total_multi`) walk a small table of the group's tensors in one launch per gradient
//! dtype. Those are checked in the interpreter against these functions' results, bit for bit,
//! and run on CUDA with the Triton kernels switched on (`adamw/cuda.rs`) for the members the
//! per-tensor kernels would take (f32 state on 16-byte boundaries, a gradient dtype they
//! cover); other members, and every other device, are stepped and summed tensor by tensor.

use super::{
    adamw_update, check_args, storage_addr, sum_of_squares, sum_of_squares_composite, AdamWParam,
    AdamWStep,
};
use candle_core::{Result, Tensor};

/// Checks every member as [`adamw_update`] does, and that no two members' tensors overlap in
/// memory (a parameter listed twice would be stepped twice, racing on a GPU); views of one
/// storage that do not overlap are fine.
pub(super) fn check_group(group: &[AdamWParam<'_>], s: &AdamWStep) -> Result<()> {
    s.check()?;
    let mut spans = Vec::with_capacity(group.len() * 4);
    for (i, a) in group.iter().enumerate() {
        check_args(a.param.as_tensor(), a.grad, a.exp_avg, a.exp_avg_sq)
            .map_err(|e| e.context(format!("candle-fused adamw_update_multi: tensor {i}")))?;
        for t in [a.param.as_tensor(), a.grad, a.exp_avg, a.exp_avg_sq] {
            let start = t.layout().start_offset();
            spans.push((storage_addr(t), start, start + t.elem_count(), i));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        let ((addr, _, end, i), (next_addr, next_start, _, j)) = (w[0], w[1]);
        if addr == next_addr && next_start < end {
            candle_core::bail!(
                "candle-fused adamw_update_multi: tensors {} and {} overlap in memory",
                i.min(j),
                i.max(j)
            )
        }
    }
    if let Some(first) = group.first() {
        let dev = first.param.device();
        if let Some(i) = group
            .iter()
            .position(|a| !a.param.device().same_device(dev))
        {
            candle_core::bail!(
                "candle-fused adamw_update_multi: tensor {i} is on another device than tensor 0"
            )
        }
    }
    Ok(())
}

/// One AdamW step of a group of parameters, in place: for each member, what [`adamw_update`]
/// does with `s` (its weight decay only where [`AdamWParam::decay`]), with the same bits.
///
/// Everything is checked before anything is written: each member as [`adamw_update`] checks
/// it, one device for all, and no two members' tensors overlapping in memory. The members are
/// then stepped one by one by [`adamw_update`] (see the module documentation for the GPU).
/// An empty group does nothing.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::adamw::{adamw_update_multi, AdamWParam, AdamWStep};
/// let dev = &Device::Cpu;
/// let (w, b) = (Var::new(&[[1f32, -2.]], dev)?, Var::new(&[0.5f32], dev)?);
/// let (gw, gb) = (Tensor::new(&[[0.5f32, -0.5]], dev)?, Tensor::new(&[1f32], dev)?);
/// let (mw, vw, mb, vb) = (w.zeros_like()?, w.zeros_like()?, b.zeros_like()?, b.zeros_like()?);
/// let group = [
///     AdamWParam { param: &w, grad: &gw, exp_avg: &mw, exp_avg_sq: &vw, decay: true },
///     AdamWParam { param: &b, grad: &gb, exp_avg: &mb, exp_avg_sq: &vb, decay: false },
/// ];
/// adamw_update_multi(&group, &AdamWStep { lr: 0.1, ..Default::default() })?;
/// // the first step moves each weight by ~lr against its gradient's sign
/// assert!((b.to_vec1::<f32>()?[0] - 0.4).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn adamw_update_multi(group: &[AdamWParam<'_>], s: &AdamWStep) -> Result<()> {
    check_group(group, s)?;
    let (fused, rest): (Vec<&AdamWParam<'_>>, Vec<_>) = group.iter().partition(|a| on_triton(a));
    #[cfg(feature = "cuda")]
    if !fused.is_empty() {
        let scalars = crate::cuda_kernels::adamw::scalars(s)?;
        // one launch (per chunk) for each gradient dtype
        let mut dtypes = Vec::new();
        for a in &fused {
            if !dtypes.contains(&a.grad.dtype()) {
                dtypes.push(a.grad.dtype());
            }
        }
        for dt in dtypes {
            let members: Vec<AdamWParam<'_>> = fused
                .iter()
                .filter(|a| a.grad.dtype() == dt)
                .map(|a| **a)
                .collect();
            super::cuda::update_multi(&members, &scalars)?;
        }
    }
    #[cfg(not(feature = "cuda"))]
    if !fused.is_empty() {
        candle_core::bail!("candle-fused adamw: Triton kernels need the `cuda` feature");
    }
    for a in rest {
        adamw_update(a.param, a.grad, a.exp_avg, a.exp_avg_sq, &a.step(s))?;
    }
    Ok(())
}

/// Whether [`adamw_update`] would step `a` with the Triton kernel, so the multi-tensor kernel
/// takes it (when it may run: `cuda_kernels::UNPROVEN`).
fn on_triton(a: &AdamWParam<'_>) -> bool {
    crate::cuda_kernels::may_launch("adamw_update_multi")
        && super::on_triton(a.param.as_tensor(), a.grad, a.exp_avg, a.exp_avg_sq)
}

/// `sum_i sum(t_i^2)` over a group of tensors as a scalar f32 tensor on their device (`None`
/// for an empty group): the [`sum_of_squares`] of each tensor, added in f32 in the group's
/// order, with the same bits. Not differentiable (meant for gradients); all tensors on one
/// device, of any float dtypes.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::adamw::sum_of_squares_multi;
/// let a = Tensor::new(&[3f32], &Device::Cpu)?;
/// let b = Tensor::new(&[[4f32]], &Device::Cpu)?;
/// let s = sum_of_squares_multi(&[&a, &b])?.expect("two tensors");
/// assert_eq!(s.to_scalar::<f32>()?, 25.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sum_of_squares_multi(ts: &[&Tensor]) -> Result<Option<Tensor>> {
    let Some(first) = ts.first() else {
        return Ok(None);
    };
    if let Some(i) = ts
        .iter()
        .position(|t| !t.device().same_device(first.device()))
    {
        candle_core::bail!(
            "candle-fused sum_of_squares_multi: tensor {i} is on another device than tensor 0"
        )
    }
    #[cfg(feature = "cuda")]
    if crate::cuda_kernels::may_launch("sumsq_partial_multi")
        && ts.iter().all(|t| {
            t.dtype() == first.dtype()
                && crate::cuda_kernels::triton_flat(t.device(), t.dtype(), t.elem_count())
        })
    {
        return Ok(Some(super::cuda::sum_of_squares_multi(ts)?));
    }
    super::sum_in_order(ts, sum_of_squares)
}

/// [`sum_of_squares_multi`] from composite ops: the [`sum_of_squares_composite`] of each
/// tensor, added in the group's order (`None` for an empty group); the reference it is
/// checked against.
pub fn sum_of_squares_multi_composite(ts: &[&Tensor]) -> Result<Option<Tensor>> {
    super::sum_in_order(ts, sum_of_squares_composite)
}
