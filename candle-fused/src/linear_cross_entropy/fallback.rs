//! The path of devices without a kernel (and of [`crate::with_composite_fallback`]): the same
//! pass as [`super::kernel`], chunk by chunk, from plain Candle ops on detached tensors, so
//! a GPU never holds more than one chunk's `[R, V]` logits (and their temporaries) either.

use candle_core::{Result, Tensor};

use super::kernel::Pass;
use crate::op::acc_dtype;

/// What a pass on a device gives back: the counted rows' losses stay on the device.
pub(super) struct DeviceOut {
    /// `Σ nll` over the counted rows, a scalar (the accumulation dtype; f64 on CUDA).
    pub nll_sum: Tensor,
    /// `nll` of each counted row, `[M]` (the accumulation dtype; f32 on CUDA).
    pub nll: Tensor,
    /// `lse` of each counted row, `[M]`, as `nll`.
    pub lse: Tensor,
    /// `dx [n, c]`, if asked for.
    pub dx: Option<Tensor>,
    /// `dW [v, c]`, if asked for.
    pub dw: Option<Tensor>,
}

/// The per-token form's recomputing backward on a device: the counted rows' upstream
/// gradients `g` and their `lse` from the forward (`[M]` each, on the device). The pass's
/// `row_scale` / `lse` are the host copies of the same, for the CPU kernel.
pub(super) struct RowGrad<'a> {
    pub g: &'a Tensor,
    pub lse: &'a Tensor,
}

/// The pass over `x2 [n, c]` and `w [v, c]`, both detached.
pub(super) fn run(
    x2: &Tensor,
    w: &Tensor,
    p: &Pass<'_>,
    rg: Option<&RowGrad>,
) -> Result<DeviceOut> {
    let (dev, dt) = (x2.device(), x2.dtype());
    let acc = acc_dtype(dt);
    let (n, c, v) = (p.n, p.c, p.v);
    // Candle's matmul wants row- or column-major operands: a strided view is copied once.
    let w = w.contiguous()?;
    let wt = w.t()?;
    let cols = Tensor::arange(0u32, v as u32, dev)?.reshape((1, v))?;
    let mut nll_sum = Tensor::zeros((), acc, dev)?;
    let (mut nlls, mut lses) = (Vec::new(), Vec::new());
    let mut dxs = Vec::new();
    let mut dw: Option<Tensor> = None;
    for (k, idx) in p.rows.chunks(p.chunk).enumerate() {
        let r = idx.len();
        let rows: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
        let tc: Vec<u32> = idx.iter().map(|&i| p.targets[i]).collect();
        let it = Tensor::from_vec(rows, r, dev)?;
        let tc = Tensor::from_vec(tc, (r, 1), dev)?;
        let xc = x2.index_select(&it, 0)?;
        // The logits in the input dtype (rounded there, as the composite's matmul), then widened.
        let l = xc.matmul(&wt)?.to_dtype(acc)?;
        let lse = match rg {
            Some(rg) => rg.lse.narrow(0, k * p.chunk, r)?.reshape((r, 1))?,
            None => {
                let mx = l.max_keepdim(1)?;
                (l.broadcast_sub(&mx)?.exp()?.sum_keepdim(1)?.log()? + mx)?
            }
        };
        let nll = (&lse - l.gather(&tc, 1)?)?;
        nll_sum = (nll_sum + nll.sum_all()?)?;
        nlls.push(nll.flatten_all()?);
        lses.push(lse.flatten_all()?);
        if !(p.need[0] || p.need[1]) {
            continue;
        }
        let onehot = cols.broadcast_eq(&tc)?.to_dtype(acc)?;
        let g = (l.broadcast_sub(&lse)?.exp()? - onehot)?;
        let g = match rg {
            // one coefficient `s g_i` per row, as the CPU kernel's
            Some(rg) => {
                let coef = rg.g.narrow(0, k * p.chunk, r)?.affine(p.scale, 0.0)?;
                g.broadcast_mul(&coef.reshape((r, 1))?)?
            }
            None => g.affine(p.scale, 0.0)?,
        };
        // Rounded to the input dtype, as the composite's cast rounds the logits' gradient.
        let g16 = g.to_dtype(dt)?;
        if p.need[0] {
            dxs.push(g16.matmul(&w)?);
        }
        if p.need[1] {
            let d = g16.to_dtype(acc)?.t()?.matmul(&xc.to_dtype(acc)?)?;
            dw = Some(match dw {
                Some(s) => (s + d)?,
                None => d,
            });
        }
    }
    let dx = if p.need[0] {
        let zeros = Tensor::zeros((n, c), dt, dev)?;
        Some(if dxs.is_empty() {
            zeros
        } else {
            let rows: Vec<u32> = p.rows.iter().map(|&i| i as u32).collect();
            let it = Tensor::from_vec(rows, p.rows.len(), dev)?;
            zeros.index_add(&it, &Tensor::cat(&dxs, 0)?, 0)?
        })
    } else {
        None
    };
    let dw = if p.need[1] {
        Some(match dw {
            Some(d) => d.to_dtype(dt)?,
            None => Tensor::zeros((v, c), dt, dev)?,
        })
    } else {
        None
    };
    let cat = |t: Vec<Tensor>| match t.is_empty() {
        true => Tensor::zeros(0, acc, dev),
        false => Tensor::cat(&t, 0),
    };
    Ok(DeviceOut {
        nll_sum,
        nll: cat(nlls)?,
        lse: cat(lses)?,
        dx,
        dw,
    })
}
