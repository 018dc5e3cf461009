//! RMSNorm, as transformers' `LlamaRMSNorm` computes it, or `Gemma3RMSNorm` (scale `1 + w`, in
//! f32).

use candle_core::Tensor;

use super::super::{Builder, Ctx, WeightMap};
use super::{stat_dtype, Weights};
use crate::Result;

/// RMSNorm over the last dimension (`weight * x / sqrt(mean(x²) + eps)`, statistics in f32).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_models::model::{layers::RmsNorm, Builder, Ctx};
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
    unit_offset: bool,
}

impl RmsNorm {
    /// The RMSNorm `b.weight [c]` with epsilon `eps`.
    pub fn build(b: &Builder, c: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: b.get(&[c], "weight")?,
            eps,
            unit_offset: false,
        })
    }

    /// The same norm scaling by `1 + weight` when `unit_offset` (Gemma's, whose weights start
    /// at 0), computed as transformers' `Gemma3RMSNorm` does: normalised and scaled in f32 (at
    /// least), then cast back to the input's dtype.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_models::model::{layers::RmsNorm, Builder, Ctx};
    /// let zeros = |_: &str, s: &[usize]| Ok(Tensor::zeros(s, candle_core::DType::F32, &Device::Cpu)?);
    /// let norm = RmsNorm::build(&Builder::root(&zeros).pp("norm"), 2, 0.0)?.with_unit_offset(true);
    /// let y = norm.forward(&Tensor::new(&[[3f32, 4.0]], &Device::Cpu)?, &Ctx::eval())?;
    /// assert!((y.to_vec2::<f32>()?[0][1] - 4.0 / 12.5f32.sqrt()).abs() < 1e-6);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_unit_offset(self, unit_offset: bool) -> Self {
        RmsNorm {
            unit_offset,
            ..self
        }
    }

    /// Normalises `x` (any leading dims) in its own dtype.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        if self.unit_offset {
            let f = stat_dtype(x.dtype());
            let w = (self.weight.to_dtype(f)? + 1.0)?;
            let y = ctx.kernels.rms_norm(&x.to_dtype(f)?, &w, self.eps)?;
            return y.to_dtype(x.dtype());
        }
        let w = self.weight.to_dtype(x.dtype())?;
        ctx.kernels.rms_norm(x, &w, self.eps)
    }
}

impl Weights for RmsNorm {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(RmsNorm {
            weight: f(&self.weight)?,
            ..self.clone()
        })
    }
}
