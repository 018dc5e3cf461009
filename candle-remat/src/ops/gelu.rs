//! GELU (tanh approximation) whose backward recomputes the derivative from the input.

use super::{tracks, Precomputed};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Shape, Tensor};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const C: f64 = 0.044_715;

struct GeluOp {
    out: Precomputed,
}

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "candle-remat-gelu"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.out.cuda()
    }
    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        self.out.metal()
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let x = x.detach();
        // d/dx [0.5 x (1 + tanh(u))], u = sqrt(2/pi) (x + c x^3)
        //   = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2)
        let x2 = x.sqr()?;
        let u = ((&x2 * C)? + 1.0)?.mul(&x)?.affine(SQRT_2_OVER_PI, 0.0)?;
        let t = u.tanh()?;
        drop(u);
        let du = ((x2 * (3.0 * C))? + 1.0)?.affine(SQRT_2_OVER_PI, 0.0)?;
        let one_m_t2 = (1.0 - t.sqr()?)?;
        let d = (((t + 1.0)? * 0.5)? + ((x * 0.5)? * one_m_t2)?.mul(&du)?)?;
        Ok(Some(dy.mul(&d)?))
    }
}

/// GELU with the tanh approximation, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
///
/// The graph keeps only `x` and the output; backward recomputes the derivative from `x` with the
/// exact constants. (Candle's built-in `Tensor::gelu` also keeps only its input, but its backward
/// uses 6-digit constants; the composite formula keeps ~6 tensors of `x`'s size.) Checked
/// against [`gelu_composite`].
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::randn(0f64, 1.0, 16, &Device::Cpu)?;
/// let y = candle_remat::ops::gelu::gelu(x.as_tensor())?;
/// let g = y.sum_all()?.backward()?;
/// assert!(g.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    let y = gelu_composite(&x.detach())?;
    if !tracks(&[x]) {
        return Ok(y);
    }
    x.apply_op1(GeluOp {
        out: Precomputed::new(y)?,
    })
}

/// The composite reference: the tanh-GELU formula with plain differentiable Candle ops.
pub fn gelu_composite(x: &Tensor) -> candle_core::Result<Tensor> {
    let inner = ((x.sqr()? * C)? + 1.0)?
        .mul(x)?
        .affine(SQRT_2_OVER_PI, 0.0)?;
    ((inner.tanh()? + 1.0)? * 0.5)?.mul(x)
}
