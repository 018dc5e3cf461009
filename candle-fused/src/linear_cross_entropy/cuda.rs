//! The pass of [`super::kernel`] on CUDA (f32, bf16, f16; Triton switched on): the host loop
//! documented in `cuda_kernels/cross_entropy.rs`. The GEMMs are Candle's matmuls (cuBLAS, f32
//! sums rounded once to the dtype, as the CPU's GEMMs); per chunk of counted rows one Triton
//! kernel, `ce_fwd_bwd`, reduces the logits to `nll` and turns them, in place, into their
//! gradient `G = s (softmax - onehot)` (`ce_fwd` when no gradient is asked for):
//!
//! ```text
//! L  = xc Wᵀ           [R, V]   (a fresh buffer per chunk; G in place over it)
//! dx rows += G W       [R, C]   (rounded once per row)
//! dW32    += Gᵀ xc     [V, C]   (f32, chunks added in order; rounded once at the end)
//! ```
//!
//! Only one chunk's logits exist at a time, nothing of size `N x V`. The loss terms stay on the
//! device (the per-row `nll` of every chunk, summed in f64 at the end), so the loop reads
//! nothing back to the host: the targets it needs are the host copy `run` already made.
//!
//! The per-token form's recomputing backward ([`RowGrad`]) runs the same loop with `ce_bwd`
//! instead: the chunk's saved `lse` (LSE) and its rows' upstream gradients as the per-row
//! WEIGHT (`G = s g_i (softmax - onehot)`; a row with `g_i = 0` gets exactly zero, as the
//! kernel skips it), then the GEMMs asked for.

use super::fallback::{DeviceOut, RowGrad};
use super::kernel::Pass;
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, Output};
use crate::cuda_kernels::Scalar;
use crate::op::Saved;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Result, Tensor,
};

/// What `fallback::run` computes (Σ nll in f64, the rows' nll and lse in f32) for `x2 [n, c]`
/// and `w [v, c]` (detached, on a CUDA device) over `p`'s counted rows, by the chunk loop.
pub(super) fn run(
    x2: &Tensor,
    w: &Tensor,
    p: &Pass<'_>,
    rg: Option<&RowGrad>,
) -> Result<DeviceOut> {
    let (dev, dt) = (x2.device(), x2.dtype());
    let (n, c, m) = (p.n, p.c, p.rows.len());
    if m == 0 {
        return no_rows(p, dev, dt);
    }
    // Candle's matmul wants row- or column-major operands: a strided view is copied once.
    let w = w.contiguous()?;
    let wt = w.t()?;
    let chunk = p.chunk.clamp(1, m);
    let (targets, stride) = chunk_targets(p, chunk, dev)?;
    // The counted rows on the device, to gather `x` and scatter `dx` (none when all count).
    let rows = if m == n {
        None
    } else {
        let r: Vec<u32> = p.rows.iter().map(|&i| i as u32).collect();
        Some(Tensor::from_vec(r, m, dev)?)
    };
    let ones = Tensor::ones(chunk, DType::F32, dev)?;
    let grads = p.need[0] || p.need[1];
    let (mut nlls, mut lses) = (Vec::new(), Vec::new());
    let mut dxs = Vec::new();
    let mut dw: Option<Tensor> = None;
    for (k, start) in (0..m).step_by(chunk).enumerate() {
        let r = chunk.min(m - start);
        let xc = match &rows {
            None => x2.narrow(0, start, r)?,
            Some(rows) => x2.index_select(&rows.narrow(0, start, r)?, 0)?,
        };
        let logits = xc.matmul(&wt)?;
        let (weight, pass) = match rg {
            // fresh copies: a kernel's pointers are 16-byte aligned, a view from `start` may not be
            Some(rg) => (
                rg.g.narrow(0, start, r)?.to_dtype(DType::F32)?.copy()?,
                Kind::Bwd(rg.lse.narrow(0, start, r)?.to_dtype(DType::F32)?.copy()?),
            ),
            None if grads => (ones.narrow(0, 0, r)?, Kind::FwdBwd),
            None => (ones.narrow(0, 0, r)?, Kind::Fwd),
        };
        let ce = ChunkCe {
            targets: targets.narrow(0, k * stride, r)?,
            weight,
            scale: p.scale as f32,
            pass,
            nll: Saved::default(),
            lse: Saved::default(),
        };
        logits.inplace_op1(&ce)?;
        if rg.is_none() {
            nlls.push(ce.nll.get()?);
            lses.push(ce.lse.get()?);
        }
        if !grads {
            continue;
        }
        // `logits` now holds G, rounded to the dtype (the CPU rounds it before its GEMMs too)
        if p.need[0] {
            dxs.push(logits.matmul(&w)?);
        }
        if p.need[1] {
            let d = logits
                .to_dtype(DType::F32)?
                .t()?
                .matmul(&xc.to_dtype(DType::F32)?)?;
            dw = Some(match dw {
                Some(s) => (s + d)?,
                None => d,
            });
        }
    }
    let (nll, lse) = match rg {
        // the backward's loop computes no loss: the forward's values stand in
        Some(rg) => (rg.lse.zeros_like()?, rg.lse.clone()),
        None => (Tensor::cat(&nlls, 0)?, Tensor::cat(&lses, 0)?),
    };
    let nll_sum = nll.to_dtype(DType::F64)?.sum_all()?;
    let dx = if p.need[0] {
        let dxc = Tensor::cat(&dxs, 0)?;
        Some(match &rows {
            None => dxc,
            Some(rows) => Tensor::zeros((n, c), dt, dev)?.index_add(rows, &dxc, 0)?,
        })
    } else {
        None
    };
    let dw = dw.map(|d| d.to_dtype(dt)).transpose()?;
    Ok(DeviceOut {
        nll_sum,
        nll,
        lse,
        dx,
        dw,
    })
}

/// The loss and gradients of no counted row (an empty grid is not launched).
fn no_rows(p: &Pass<'_>, dev: &Device, dt: DType) -> Result<DeviceOut> {
    let (n, c, v) = (p.n, p.c, p.v);
    let dx = p.need[0]
        .then(|| Tensor::zeros((n, c), dt, dev))
        .transpose()?;
    let dw = p.need[1]
        .then(|| Tensor::zeros((v, c), dt, dev))
        .transpose()?;
    let none = Tensor::zeros(0, DType::F32, dev)?;
    Ok(DeviceOut {
        nll_sum: Tensor::zeros((), DType::F64, dev)?,
        nll: none.clone(),
        lse: none,
        dx,
        dw,
    })
}

/// The counted rows' targets on the device, chunk `k`'s from row `k` of `[K, stride]` (16-byte
/// aligned: `stride` is `chunk` rounded up to a multiple of 4); with the stride.
fn chunk_targets(p: &Pass<'_>, chunk: usize, dev: &Device) -> Result<(Tensor, usize)> {
    let m = p.rows.len();
    let stride = chunk.next_multiple_of(4);
    let mut tg = vec![0u32; m.div_ceil(chunk) * stride];
    for (i, &r) in p.rows.iter().enumerate() {
        tg[i / chunk * stride + i % chunk] = p.targets[r];
    }
    Ok((
        Tensor::from_vec(tg, m.div_ceil(chunk) * stride, dev)?,
        stride,
    ))
}

/// Which kernel a chunk runs.
enum Kind {
    /// `ce_fwd`: the logits only read.
    Fwd,
    /// `ce_fwd_bwd`: the logits become their gradient.
    FwdBwd,
    /// `ce_bwd` from the saved `lse` (`[R]` f32): the logits become their gradient.
    Bwd(Tensor),
}

/// One chunk's kernel over its logits `[R, V]`, in place ([`Kind`]; the gradient for
/// `scale` times the row's weight). Every row counts (the loop gathered the counted ones):
/// no ignore index; weight 1, or the rows' upstream gradients (`Kind::Bwd`). The per-row
/// `nll` and `lse` ([R], f32) land in `nll` and `lse` (not for `Kind::Bwd`).
struct ChunkCe {
    targets: Tensor,
    weight: Tensor,
    scale: f32,
    pass: Kind,
    nll: Saved,
    lse: Saved,
}

impl InplaceOp1 for ChunkCe {
    fn name(&self) -> &'static str {
        "candle-fused-linear-cross-entropy-chunk"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("{}: CUDA only", self.name())
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let (r, _) = l.shape().dims2()?;
        let (dt, dev) = (s.dtype(), s.device().clone());
        let mut nll = Output::new(&dev, r, DType::F32)?;
        let mut lse = Output::new(&dev, r, DType::F32)?;
        let (gt, lt) = self.targets.storage_and_layout();
        let (gw, lw) = self.weight.storage_and_layout();
        let (targets, weight) = (Buf::read(cuda_of(&gt)?, lt), Buf::read(cuda_of(&gw)?, lw));
        let none = Scalar::I32(-1);
        let scale = self.scale;
        match &self.pass {
            Kind::Bwd(saved) => {
                let (gs, ls) = saved.storage_and_layout();
                let tensors = vec![
                    Buf::update(s, l),
                    targets,
                    weight,
                    Buf::read(cuda_of(&gs)?, ls),
                    Buf::same_as(0),
                ];
                launch("ce_bwd", dt, tensors, &[none, Scalar::F32(scale)])?;
                return Ok(());
            }
            Kind::FwdBwd => {
                let tensors = vec![
                    Buf::update(s, l),
                    targets,
                    weight,
                    Buf::write(&mut nll),
                    Buf::write(&mut lse),
                    Buf::same_as(0),
                ];
                launch("ce_fwd_bwd", dt, tensors, &[none, Scalar::F32(scale)])?;
            }
            Kind::Fwd => {
                let tensors = vec![
                    Buf::read(s, l),
                    targets,
                    weight,
                    Buf::write(&mut nll),
                    Buf::write(&mut lse),
                ];
                launch("ce_fwd", dt, tensors, &[none])?;
            }
        }
        self.nll.set(nll.into_tensor());
        self.lse.set(lse.into_tensor());
        Ok(())
    }
}
