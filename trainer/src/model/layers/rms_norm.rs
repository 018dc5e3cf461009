//! RMSNorm, as transformers' `LlamaRMSNorm` computes it.

use candle_core::Tensor;

use super::super::{Builder, Ctx, WeightMap};
use super::Weights;
use crate::Result;

/// RMSNorm over the last dimension (`weight * x / sqrt(mean(x²) + eps)`, statistics in f32).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use trainer::model::{layers::RmsNorm, Builder, Ctx};
/// let ones = |_: &str, s: &[usize]| Ok(Tensor::ones(s, candle_core::DType::F32, &Device::Cpu)?);
/// let norm = RmsNorm::build(&Builder::root(&ones).pp("norm"), 2, 0.0)?;
/// let y = norm.forward(&Tensor::new(&[[3f32, 4.0]], &Device::Cpu)?, &Ctx::eval())?;
/// let want = [3.0 / 12.5f32.sqrt(), 4.0 / 12.5f32.sqrt()];
/// assert!(y.to_vec2::<f32>()?[0].iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// Scale `[C]`.
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// The RMSNorm `b.weight [c]` with epsilon `eps`.
    pub fn build(b: &Builder, c: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: b.get(&[c], "weight")?,
            eps,
        })
    }

    /// Normalises `x` (any leading dims) in its own dtype.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let w = self.weight.to_dtype(x.dtype())?;
        ctx.kernels.rms_norm(x, &w, self.eps)
    }
}

impl Weights for RmsNorm {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(RmsNorm {
            weight: f(&self.weight)?,
            eps: self.eps,
        })
    }
}
