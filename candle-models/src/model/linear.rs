//! The one linear type every projection goes through, addressed by its Hugging Face module
//! path (`transformer.h.0.attn.c_attn`), so that tools (an adapter, a report) can find and
//! wrap any projection of any architecture by name.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_fused::nf4::Nf4Weight;

use super::{Builder, Ctx, Layout, LinearAdapter, WeightMap};
use crate::Result;

/// A linear layer `[.., in] -> [.., out]` with an optional bias, computing in the context's
/// dtype with the context's kernels.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_models::model::{Builder, Ctx, Layout, Linear};
/// let w = Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu)?; // [in 3, out 2]
/// let lin = Linear::build(&Builder::root(&|_, _| Ok(w.clone())).pp("proj"), 3, 2, false, Layout::InOut)?;
/// assert_eq!(lin.path(), "proj");
/// let y = lin.forward(&Tensor::new(&[[1f32, 0.0, 1.0]], &Device::Cpu)?, &Ctx::eval())?;
/// assert_eq!(y.to_vec2::<f32>()?, [[6.0, 8.0]]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Linear {
    path: String,
    /// The weight, `[in, out]` or `[out, in]` as [`Linear::layout`] says; empty (`[0]`) when
    /// the layer is 4-bit ([`Linear::quantized`]).
    pub weight: Tensor,
    /// `[out]`, if the layer has a bias.
    pub bias: Option<Tensor>,
    layout: Layout,
    adapter: Option<Arc<dyn LinearAdapter>>,
    /// The frozen 4-bit weight `[out, in]`, in place of `weight` (QLoRA).
    quant: Option<Nf4Weight>,
    /// The dtype a 4-bit weight computes in, if not the context's.
    compute: Option<DType>,
}

impl Linear {
    /// The layer at `b`'s path: `b.weight` (shaped as `layout` says) and `b.bias [fan_out]`
    /// if `bias`, run by the adapter `b` has for this path, if any ([`Builder::with_wrap`]).
    /// A layer the builder holds in 4 bits ([`Builder::with_quant`]; `[out, in]` layers only)
    /// reads no `weight`.
    pub fn build(
        b: &Builder,
        fan_in: usize,
        fan_out: usize,
        bias: bool,
        layout: Layout,
    ) -> Result<Self> {
        let shape = match layout {
            Layout::InOut => [fan_in, fan_out],
            Layout::OutIn => [fan_out, fan_in],
        };
        let quant = b.quant(fan_in, fan_out)?;
        let weight = match &quant {
            None => b.get(&shape, "weight")?,
            Some(q) if layout == Layout::OutIn && q.shape() == [fan_out, fan_in] => {
                Tensor::zeros(0, q.dtype(), q.device())?
            }
            Some(q) => {
                return Err(crate::Error::Config(format!(
                    "`{}.weight`: a 4-bit weight of shape {:?} for a layer {fan_in} -> \
                     {fan_out} stored {layout:?} (4-bit weights are [out, in])",
                    b.path(),
                    q.shape()
                )))
            }
        };
        Ok(Linear {
            path: b.path().to_string(),
            weight,
            bias: b.get_if(bias, &[fan_out], "bias")?,
            layout,
            adapter: b.wrap(fan_in, fan_out, layout)?,
            quant,
            compute: b.quant_compute(),
        })
    }

    /// The frozen 4-bit weight, when the layer has one (QLoRA).
    pub fn quantized(&self) -> Option<&Nf4Weight> {
        self.quant.as_ref()
    }

    /// The Hugging Face module path (`transformer.h.0.attn.c_attn`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// How the weight is stored.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The same layer with its tensors mapped by `f` (e.g. cast to a dtype).
    /// A 4-bit weight keeps its codes and moves to the device `f` puts the (empty) weight on.
    pub fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        let weight = f(&self.weight)?;
        let quant = match &self.quant {
            Some(q) => Some(q.to_device(weight.device())?),
            None => None,
        };
        Ok(Linear {
            path: self.path.clone(),
            weight,
            bias: self.bias.as_ref().map(f).transpose()?,
            layout: self.layout,
            adapter: self.adapter.as_ref().map(|d| d.map(f)).transpose()?,
            quant,
            compute: self.compute,
        })
    }

    /// Every tensor the layer reads: the weight, the bias if any, and its adapter's
    /// parameters.
    pub fn weights(&self) -> Vec<Tensor> {
        let mut w: Vec<Tensor> = std::iter::once(&self.weight)
            .chain(&self.bias)
            .cloned()
            .collect();
        if let Some(a) = &self.adapter {
            w.extend(a.params());
        }
        w
    }

    /// The adapter that runs the layer, if it is wrapped.
    pub fn adapter(&self) -> Option<&Arc<dyn LinearAdapter>> {
        self.adapter.as_ref()
    }

    /// `[.., in] -> [.., out]`, computing in `ctx.dtype` (the base layer alone when
    /// `ctx.adapters` is off).
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        if let Some(q) = &self.quant {
            // bitsandbytes' `Linear4bit`: the input and bias cast to the compute dtype, the
            // output back to the input's.
            let compute = self.compute.unwrap_or(ctx.dtype);
            let b = self
                .bias
                .as_ref()
                .map(|b| b.to_dtype(compute))
                .transpose()?;
            return match self.running(ctx) {
                None => candle_fused::qlora::nf4_linear(&x.to_dtype(compute)?, q, b.as_ref())?
                    .to_dtype(x.dtype()),
                Some(a) => a.forward_nf4(x, q, b.as_ref(), compute, ctx),
            };
        }
        let (w, b) = self.cast(ctx)?;
        match self.running(ctx) {
            None => ctx.kernels.linear(x, &w, b.as_ref()),
            Some(a) => a.forward(x, &w, b.as_ref(), ctx),
        }
    }

    /// `r + forward(x)`, `r` of the output's shape: a block's residual add, fused into the
    /// projection where the layer runs plain (no adapter running, not 4-bit; see
    /// `candle_fused::linear_add`). The same bits either way.
    pub fn forward_add(&self, x: &Tensor, r: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        if self.running(ctx).is_some() || self.quant.is_some() {
            return r + self.forward(x, ctx)?;
        }
        let (w, b) = self.cast(ctx)?;
        ctx.kernels.linear_add(x, &w, b.as_ref(), r)
    }

    /// The adapter that runs the layer in `ctx`: none when unwrapped or adapters are off.
    fn running(&self, ctx: &Ctx) -> Option<&Arc<dyn LinearAdapter>> {
        self.adapter.as_ref().filter(|_| ctx.adapters)
    }

    /// `gelu([.., in] W + b)` (tanh GELU), the bias and activation fused (after the delta,
    /// when the layer is wrapped).
    pub fn forward_gelu(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        if self.running(ctx).is_some() || self.quant.is_some() {
            return self.forward(x, ctx)?.gelu();
        }
        let (w, b) = self.cast(ctx)?;
        ctx.kernels.linear_gelu(x, &w, b.as_ref())
    }

    /// The `[in, out]` weight and the bias in the compute dtype (free when they already are:
    /// the trainer casts the whole model once per step).
    fn cast(&self, ctx: &Ctx) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let w = self.weight.to_dtype(ctx.dtype)?;
        let w = match self.layout {
            Layout::InOut => w,
            Layout::OutIn => w.t()?,
        };
        let b = self
            .bias
            .as_ref()
            .map(|b| b.to_dtype(ctx.dtype))
            .transpose()?;
        Ok((w, b))
    }
}
