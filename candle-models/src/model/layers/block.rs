//! The gated MLP and the pre-norm decoder block of the Llama family:
//!
//! ```text
//! h = x + attention(rms(x))
//! y = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
//! ```
//!
//! or, with [`BlockOptions::sandwich_norms`] (Gemma 2/3), the attention's and the MLP's
//! outputs normalised as well: `h = x + rms(attention(rms(x)))`, `y = h + rms(mlp(rms(h)))`.
//!
//! Without sandwich norms each residual add runs inside the projection before it (`o_proj`,
//! `down_proj`: [`Linear::forward_add`]), one graph node fewer per add, the same bits.

use candle_core::Tensor;

use super::super::{Builder, Ctx, KvCache, Layout, Linear, LinkOps, WeightMap};
use super::{Attention, BlockOptions, Cached, GateAct, RmsNorm, Weights};
use crate::Result;

/// The gated feed-forward network (`mlp`): `down_proj(act(gate_proj(x)) * up_proj(x))`, SwiGLU
/// or GeGLU.
#[derive(Clone, Debug)]
pub struct GatedMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: GateAct,
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
            act: o.act,
        })
    }

    /// `[.., C] -> [.., C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.down_proj.forward(&self.gated(x, ctx)?, ctx)
    }

    /// `r + forward(x)`, the add fused into `down_proj` ([`Linear::forward_add`]).
    fn forward_add(&self, x: &Tensor, r: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.down_proj.forward_add(&self.gated(x, ctx)?, r, ctx)
    }

    /// `act(gate_proj(x)) * up_proj(x)`: `down_proj`'s input.
    fn gated(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let g = self.gate_proj.forward(x, ctx)?;
        let u = self.up_proj.forward(x, ctx)?;
        match self.act {
            GateAct::Silu => ctx.kernels.swiglu(&g, &u),
            GateAct::GeluTanh => ctx.kernels.geglu(&g, &u),
        }
    }
}

impl Weights for GatedMlp {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(GatedMlp {
            gate_proj: self.gate_proj.map(f)?,
            up_proj: self.up_proj.map(f)?,
            down_proj: self.down_proj.map(f)?,
            act: self.act,
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
    /// Gemma's `pre_feedforward_layernorm` and `post_feedforward_layernorm`.
    feedforward_norms: Option<(RmsNorm, RmsNorm)>,
    mlp: GatedMlp,
    index: usize,
}

impl Block {
    /// Block `index` of a model (`b` is its path); its attention's dropout site is
    /// `1 + index` (site 0 is the embedding's).
    pub fn build(b: &Builder, o: &BlockOptions, index: usize) -> Result<Self> {
        let (c, eps) = (o.dims.hidden, o.norm_eps);
        let norm = |name: &str| {
            Ok::<_, crate::Error>(
                RmsNorm::build(&b.pp(name), c, eps)?.with_unit_offset(o.norm_unit_offset),
            )
        };
        // transformers' order: input, self_attn, post_attention, pre/post feed-forward, mlp.
        let input_layernorm = norm("input_layernorm")?;
        let self_attn = Attention::build(&b.pp("self_attn"), o, 1 + index as u64)?;
        let post_attention_layernorm = norm("post_attention_layernorm")?;
        let feedforward_norms = match o.sandwich_norms {
            true => Some((
                norm("pre_feedforward_layernorm")?,
                norm("post_feedforward_layernorm")?,
            )),
            false => None,
        };
        Ok(Block {
            input_layernorm,
            self_attn,
            post_attention_layernorm,
            feedforward_norms,
            mlp: GatedMlp::build(&b.pp("mlp"), o)?,
            index,
        })
    }

    /// The `n` blocks `b.layers.{i}`, block `i` with `options(i)`.
    pub(crate) fn stack(
        b: &Builder,
        n: usize,
        options: impl Fn(usize) -> BlockOptions,
    ) -> Result<Vec<Self>> {
        let layers = b.pp("layers");
        (0..n)
            .map(|i| Block::build(&layers.pp(i), &options(i), i))
            .collect()
    }

    /// `x + a`, `a` the attention's output (normalised first with sandwich norms).
    fn attn_residual(&self, x: &Tensor, a: Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        match self.feedforward_norms {
            Some(_) => x + self.post_attention_layernorm.forward(&a, ctx)?,
            None => x + a,
        }
    }

    /// `h + mlp(rms(h))`, the add fused into `down_proj`; with sandwich norms (the MLP's
    /// output normalised before the add) two ops.
    fn mlp_residual(&self, h: Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        match &self.feedforward_norms {
            Some((pre, post)) => {
                &h + post.forward(&self.mlp.forward(&pre.forward(&h, ctx)?, ctx)?, ctx)?
            }
            None => {
                let n = self.post_attention_layernorm.forward(&h, ctx)?;
                self.mlp.forward_add(&n, &h, ctx)
            }
        }
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
        self.mlp_residual(self.attn_residual(x, a, ctx)?, ctx)
    }
}

impl Weights for Block {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Block {
            input_layernorm: Weights::map(&self.input_layernorm, f)?,
            self_attn: Weights::map(&self.self_attn, f)?,
            post_attention_layernorm: Weights::map(&self.post_attention_layernorm, f)?,
            feedforward_norms: match &self.feedforward_norms {
                Some((pre, post)) => Some((Weights::map(pre, f)?, Weights::map(post, f)?)),
                None => None,
            },
            mlp: Weights::map(&self.mlp, f)?,
            index: self.index,
        })
    }
}

impl LinkOps for Block {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let n = self.input_layernorm.forward(x, ctx)?;
        let h = match self.feedforward_norms {
            Some(_) => self.attn_residual(x, self.self_attn.forward(&n, ctx)?, ctx)?,
            // `x + attention(..)` fused into `o_proj`
            None => self.self_attn.forward_add(&n, x, ctx)?,
        };
        self.mlp_residual(h, ctx)
    }

    own_weights!();
}
