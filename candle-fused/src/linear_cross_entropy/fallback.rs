//! The path of devices without a kernel (and of [`crate::with_composite_fallback`]): the same
//! pass as [`super::kernel`], chunk by chunk, from plain Candle ops on detached tensors, so
//! a GPU never holds more than one chunk's `[R, V]` logits (and their temporaries) either.

use candle_core::{Result, Tensor};

use super::acc_dtype;
use super::kernel::Pass;

/// `(Σ nll as a scalar of the accumulation dtype, dx [n, c], dW [v, c])` for `x2 [n, c]` and
/// `w [v, c]`, both detached.
pub(super) fn run(
    x2: &Tensor,
    w: &Tensor,
    p: &Pass<'_>,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let (dev, dt) = (x2.device(), x2.dtype());
    let acc = acc_dtype(dt);
    let (n, c, v) = (p.n, p.c, p.v);
    // Candle's matmul wants row- or column-major operands: a strided view is copied once.
    let w = w.contiguous()?;
    let wt = w.t()?;
    let cols = Tensor::arange(0u32, v as u32, dev)?.reshape((1, v))?;
    let mut nll_sum = Tensor::zeros((), acc, dev)?;
    let mut dxs = Vec::new();
    let mut dw: Option<Tensor> = None;
    for idx in p.rows.chunks(p.chunk) {
        let r = idx.len();
        let rows: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
        let tc: Vec<u32> = idx.iter().map(|&i| p.targets[i]).collect();
        let it = Tensor::from_vec(rows, r, dev)?;
        let tc = Tensor::from_vec(tc, (r, 1), dev)?;
        let xc = x2.index_select(&it, 0)?;
        // The logits in the input dtype (rounded there, as the composite's matmul), then widened.
        let l = xc.matmul(&wt)?.to_dtype(acc)?;
        let mx = l.max_keepdim(1)?;
        let lse = (l.broadcast_sub(&mx)?.exp()?.sum_keepdim(1)?.log()? + mx)?;
        let nll = (&lse - l.gather(&tc, 1)?)?;
        nll_sum = (nll_sum + nll.sum_all()?)?;
        if !(p.need[0] || p.need[1]) {
            continue;
        }
        let onehot = cols.broadcast_eq(&tc)?.to_dtype(acc)?;
        let g = (l.broadcast_sub(&lse)?.exp()? - onehot)?.affine(p.scale, 0.0)?;
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
    Ok((nll_sum, dx, dw))
}
