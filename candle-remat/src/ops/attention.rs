//! Causal self-attention that saves q, k, v, the output and per-row softmax statistics instead
//! of the `T x T` probabilities, and recomputes the probabilities in backward.

use super::{tracks, Precomputed};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Layout, MetalStorage, Shape, Tensor, D};

/// Additive mask: 0 on and below the diagonal, `-inf` above (for causal attention).
fn causal_mask(t_q: usize, t_k: usize, like: &Tensor) -> candle_core::Result<Tensor> {
    let off = t_k.saturating_sub(t_q);
    let v: Vec<f32> = (0..t_q)
        .flat_map(|i| (0..t_k).map(move |j| if j <= i + off { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(v, (t_q, t_k), like.device())?.to_dtype(like.dtype())
}

struct Stats {
    scale: f64,
    causal: bool,
    /// Row maximum of the (scaled, masked) scores, `[.., T, 1]`.
    max: Tensor,
    /// Row sum of `exp(scores - max)`, `[.., T, 1]`.
    sum: Tensor,
}

impl Stats {
    /// Softmax probabilities from the saved statistics: bit-identical to the forward ones.
    fn probs(&self, q: &Tensor, k: &Tensor) -> candle_core::Result<Tensor> {
        let s = scores(q, k, self.scale, self.causal)?;
        s.broadcast_sub(&self.max)?.exp()?.broadcast_div(&self.sum)
    }
}

fn scores(q: &Tensor, k: &Tensor, scale: f64, causal: bool) -> candle_core::Result<Tensor> {
    let s = (q.matmul(&k.t()?)? * scale)?;
    if causal {
        let (tq, tk) = (s.dim(D::Minus2)?, s.dim(D::Minus1)?);
        s.broadcast_add(&causal_mask(tq, tk, &s)?)
    } else {
        Ok(s)
    }
}

struct AttentionOp {
    out: Precomputed,
    stats: Stats,
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "candle-remat-attention"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.out.cuda()
    }
    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        self.out.metal()
    }

    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v, o) = (q.detach(), k.detach(), v.detach(), o.detach());
        let p = self.stats.probs(&q, &k)?;
        let dv = p.t()?.matmul(d_o)?;
        let dp = d_o.matmul(&v.t()?)?;
        // Softmax backward: dS = P * (dP - rowsum(dO * O)), since rowsum(P * dP) = rowsum(dO * O).
        let delta = (d_o * &o)?.sum_keepdim(D::Minus1)?;
        let ds = (p * dp.broadcast_sub(&delta)?)?;
        drop(dp);
        let ds = (ds * self.stats.scale)?;
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Scaled dot-product attention `softmax(q kᵀ · scale + mask) v` over the last two dims
/// (`q: [.., Tq, Dh]`, `k: [.., Tk, Dh]`, `v: [.., Tk, Dv]`, e.g. `[B, H, T, Dh]`), with an
/// optional causal mask (query `i` sees keys `0..=i + Tk - Tq`).
///
/// Memory-lean: the autodiff graph keeps `q`, `k`, `v`, the output and two floats per query
/// row (softmax max and sum), not the `Tq x Tk` scores/probabilities; backward recomputes the
/// probabilities from those (the FlashAttention backward, written with ordinary tensor ops, so
/// any device works). Values are bit-identical to the composite
/// `candle_nn::ops::softmax(scores + mask) @ v`; gradients agree with the composite's to float
/// rounding (a different but equivalent formula).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let q = Var::randn(0f32, 1.0, (1, 2, 5, 4), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 2, 5, 4), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 2, 5, 4), &dev)?;
/// let y = candle_remat::ops::attention::attention(q.as_tensor(), &k, &v, 0.5, true)?;
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&q).unwrap().dims(), &[1, 2, 5, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let s = scores(&qd, &kd, scale, causal)?;
    let max = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&max)?.exp()?;
    drop(s);
    let sum = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_div(&sum)?;
    drop(e);
    let o = p.matmul(&vd)?;
    drop(p);
    if !tracks(&[q, k, v]) {
        return Ok(o);
    }
    let op = AttentionOp {
        out: Precomputed::new(o)?,
        stats: Stats {
            scale,
            causal,
            max,
            sum,
        },
    };
    q.apply_op3(k, v, op)
}

/// The composite reference the lean op is checked against: the same math with plain Candle ops
/// (`candle_nn::ops::softmax`, differentiable), keeping the `T x T` tensors in the graph.
pub fn attention_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let s = scores(q, k, scale, causal)?;
    candle_nn::ops::softmax(&s, D::Minus1)?.matmul(v)
}
