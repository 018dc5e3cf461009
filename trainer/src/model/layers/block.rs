//! The gated MLP and the pre-norm decoder block of the Llama family:
//!
//! ```text
//! h = x + attention(rms(x))
//! y = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
//! ```

use candle_core::Tensor;

use super::super::{Builder, Ctx, KvCache, Layout, Linear, LinkOps, WeightMap};
use super::{Attention, BlockOptions, Cached, RmsNorm, Weights};
use crate::Result;

/// The SwiGLU feed-forward network (`mlp`): `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#[derive(Clone, Debug)]
pub struct GatedMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl GatedMlp {
    /// `b.{gate,up,down}_proj`, `hidden -> intermediate -> hidden`.
    pub fn build(b: &Builder, o: &BlockOptions) -> Result<Self> {
        let (c, m) = (o.dims.hidden, o.dims.mlp);
        let lin = |name: &str, fan_in, fan_out| {
            Linear::build(&b.pp(name), fan_in, fan_out, o.biases.2, Layout::OutIn)
        };
        Ok(GatedMlp {
            gate_proj: lin("gate_proj", c, m)?,
            up_proj: lin("up_proj", c, m)?,
            down_proj: lin("down_proj", m, c)?,
        })
    }

    /// `[.., C] -> [.., C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let g = self.gate_proj.forward(x, ctx)?;
        let u = self.up_proj.forward(x, ctx)?;
        self.down_proj.forward(&ctx.kernels.swiglu(&g, &u)?, ctx)
    }
}

impl Weights for GatedMlp {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(GatedMlp {
            gate_proj: self.gate_proj.map(f)?,
            up_proj: self.up_proj.map(f)?,
            down_proj: self.down_proj.map(f)?,
        })
    }
}

/// A pre-norm decoder block (`model.layers.{i}`): RMSNorm, rotary attention, RMSNorm, gated
/// MLP, each with its residual.
#[derive(Clone, Debug)]
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
    index: usize,
}

impl Block {
    /// Block `index` of a model (`b` is its path); its attention's dropout site is
    /// `1 + index` (site 0 is the embedding's).
    pub fn build(b: &Builder, o: &BlockOptions, index: usize) -> Result<Self> {
        let (c, eps) = (o.dims.hidden, o.norm_eps);
        Ok(Block {
            input_layernorm: RmsNorm::build(&b.pp("input_layernorm"), c, eps)?,
            self_attn: Attention::build(&b.pp("self_attn"), o, 1 + index as u64)?,
            post_attention_layernorm: RmsNorm::build(&b.pp("post_attention_layernorm"), c, eps)?,
            mlp: GatedMlp::build(&b.pp("mlp"), o)?,
            index,
        })
    }

    fn mlp_residual(&self, h: Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let y = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h, ctx)?, ctx)?;
        h + y
    }
}

impl Cached for Block {
    /// The block over new tokens, its attention reading and extending `cache`.
    fn cached(&self, x: &Tensor, cache: &mut KvCache, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let a = self.self_attn.forward_cached(
            &self.input_layernorm.forward(x, ctx)?,
            cache,
            self.index,
            ctx,
        )?;
        self.mlp_residual((x + a)?, ctx)
    }
}

impl Weights for Block {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Block {
            input_layernorm: Weights::map(&self.input_layernorm, f)?,
            self_attn: Weights::map(&self.self_attn, f)?,
            post_attention_layernorm: Weights::map(&self.post_attention_layernorm, f)?,
            mlp: Weights::map(&self.mlp, f)?,
            index: self.index,
        })
    }
}

impl LinkOps for Block {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let a = self
            .self_attn
            .forward(&self.input_layernorm.forward(x, ctx)?, ctx)?;
        self.mlp_residual((x + a)?, ctx)
    }

    own_weights!();
}
