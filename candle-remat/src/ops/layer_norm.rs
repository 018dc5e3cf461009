//! LayerNorm over the last dimension that saves the per-row mean and reciprocal standard
//! deviation instead of the composite expression's intermediates.

use super::{tracks, Precomputed};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Layout, MetalStorage, Shape, Tensor, D};

struct LayerNormOp {
    out: Precomputed,
    /// `[.., 1]` row means.
    mean: Tensor,
    /// `[.., 1]` `1 / sqrt(var + eps)`.
    rstd: Tensor,
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "candle-remat-layer-norm"
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
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, w) = (x.detach(), w.detach());
        let c = x.dim(D::Minus1)?;
        let xhat = x.broadcast_sub(&self.mean)?.broadcast_mul(&self.rstd)?;
        let rows = x.elem_count() / c;
        let dw = (dy * &xhat)?.reshape((rows, c))?.sum(0)?;
        let db = dy.reshape((rows, c))?.sum(0)?;
        let g = dy.broadcast_mul(&w)?;
        let mean_g = g.mean_keepdim(D::Minus1)?;
        let mean_gx = (&g * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = g
            .broadcast_sub(&mean_g)?
            .sub(&xhat.broadcast_mul(&mean_gx)?)?
            .broadcast_mul(&self.rstd)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `(x - mean) / sqrt(var + eps) * w + b` over the last dimension (`w`, `b`: `[C]`).
///
/// Memory-lean: the graph keeps `x`, `w`, `b`, the output and the per-row mean and rstd, not
/// the centred/squared/normalised intermediates of the composite expression (Candle's fused
/// `candle_nn::ops::layer_norm` has no backward at all). Checked against
/// [`layer_norm_composite`].
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (3, 8), &dev)?;
/// let w = Tensor::ones(8, candle_core::DType::F32, &dev)?;
/// let b = Tensor::zeros(8, candle_core::DType::F32, &dev)?;
/// let y = candle_remat::ops::layer_norm::layer_norm(x.as_tensor(), &w, &b, 1e-5)?;
/// let g = y.sqr()?.sum_all()?.backward()?;
/// assert!(g.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let (xd, wd, bd) = (x.detach(), w.detach(), b.detach());
    let mean = xd.mean_keepdim(D::Minus1)?;
    let xc = xd.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    let y = xc
        .broadcast_mul(&rstd)?
        .broadcast_mul(&wd)?
        .broadcast_add(&bd)?;
    drop(xc);
    if !tracks(&[x, w, b]) {
        return Ok(y);
    }
    let op = LayerNormOp {
        out: Precomputed::new(y)?,
        mean,
        rstd,
    };
    x.apply_op3(w, b, op)
}

/// The composite reference: the same formula with plain differentiable Candle ops.
pub fn layer_norm_composite(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    xc.broadcast_mul(&rstd)?.broadcast_mul(w)?.broadcast_add(b)
}
