//! GPT-2, written as a chain `embed -> blocks -> head` of plain structs.
//!
//! The names and layouts of the parameters are those of Hugging Face's `GPT2LMHeadModel`
//! (`transformer.h.{i}.attn.c_attn.weight` is a Conv1D weight of shape `[in, out]`), so a real
//! GPT-2 `model.safetensors` loads without renaming. The head reads the token embedding, which
//! the embedding link owns (a declared tie).

mod config;

use std::path::Path;

use candle_core::{Tensor, D};
use candle_fused::attention::{attention, AttentionConfig};
use serde_json::Value;

pub use config::GptConfig;

use super::layers::head::{Head, LmHead, Norm};
use super::layers::{Cached, Decoder, Weights};
use super::{
    run_links, Architecture, Builder, Ctx, Dims, KvCache, LayerNorm, Layout, Linear, LinkOps,
    Model, ModelConfig, Params, WeightMap,
};
use crate::Result;

/// LayerNorm epsilon of GPT-2.
pub(crate) const LN_EPS: f64 = 1e-5;

/// The GPT-2 architecture (`model_type` `gpt2`).
pub(crate) struct Gpt2;

impl Architecture for Gpt2 {
    fn name(&self) -> &'static str {
        "gpt2"
    }

    fn class(&self) -> &'static str {
        "GPT2LMHeadModel"
    }

    fn config_from_hf_json(&self, json: &Value, path: &Path) -> Result<Box<dyn ModelConfig>> {
        Ok(Box::new(GptConfig::from_hf_json(json, path)?))
    }

    fn fresh(&self, dims: &Dims, dropout: f32, _rope_theta: f64) -> Result<Box<dyn ModelConfig>> {
        Ok(Box::new(GptConfig::fresh(dims, dropout)))
    }
}

/// Token and position embeddings (`transformer.wte`, `transformer.wpe`) plus embedding dropout.
#[derive(Clone, Debug)]
pub struct Embed {
    /// Token embedding `[vocab_size, n_embd]`, read by the head too.
    pub wte: Tensor,
    /// Position embedding `[block_size, n_embd]`.
    pub wpe: Tensor,
    dropout: f32,
}

impl Embed {
    /// `b.wte.weight` and `b.wpe.weight` (`b` is the `transformer` path).
    pub fn build(b: &Builder, cfg: &GptConfig) -> Result<Self> {
        Ok(Embed {
            wte: b.pp("wte").get(&[cfg.vocab_size, cfg.n_embd], "weight")?,
            wpe: b.pp("wpe").get(&[cfg.block_size, cfg.n_embd], "weight")?,
            dropout: cfg.dropout,
        })
    }

    /// Token ids `[B, T]` at positions `pos` (`[B, T]`, or `None` for `offset..offset + T`)
    /// to the residual stream.
    fn embed(
        &self,
        idx: &Tensor,
        pos: Option<&Tensor>,
        offset: usize,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let t = idx.dim(1)?;
        let block_size = self.wpe.dim(0)?;
        let wte = self.wte.to_dtype(ctx.dtype)?;
        let tok = ctx
            .kernels
            .embedding(&wte, idx, ctx.rows.host_tokens(idx))?;
        let x = match pos {
            None => {
                if offset + t > block_size {
                    candle_core::bail!(
                        "sequence length {} exceeds block_size {block_size}",
                        offset + t
                    );
                }
                let pos = self.wpe.narrow(0, offset, t)?.to_dtype(ctx.dtype)?;
                tok.broadcast_add(&pos)?
            }
            Some(pos) => {
                let pe = self.wpe.to_dtype(ctx.dtype)?;
                let pos = ctx.kernels.embedding(&pe, pos, None)?;
                (tok + pos)?
            }
        };
        ctx.kernels.dropout(&x, self.dropout, ctx, 0)
    }
}

impl Cached for Embed {
    /// The tokens at the positions after the cached ones.
    fn cached(&self, idx: &Tensor, cache: &mut KvCache, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.embed(idx, None, cache.len, ctx)
    }
}

impl Weights for Embed {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Embed {
            wte: f(&self.wte)?,
            wpe: f(&self.wpe)?,
            dropout: self.dropout,
        })
    }
}

impl LinkOps for Embed {
    fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.embed(idx, ctx.rows.positions.as_ref(), 0, ctx)
    }

    own_weights!();
}

/// Causal multi-head self-attention (`attn.c_attn`, `attn.c_proj`).
#[derive(Clone, Debug)]
pub(crate) struct CausalSelfAttention {
    /// Fused q, k, v projection, Conv1D `[n_embd, 3 n_embd]`.
    pub c_attn: Linear,
    /// Output projection, Conv1D `[n_embd, n_embd]`.
    pub c_proj: Linear,
    n_head: usize,
    dropout: f32,
    site: u64,
}

impl CausalSelfAttention {
    /// `[B, T, C] -> [B, T, C]` (the unit tests' reference for the block's fused residual).
    #[cfg(test)]
    pub(crate) fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let y = self.c_proj.forward(&self.heads(x, ctx)?, ctx)?;
        ctx.kernels.dropout(&y, self.dropout, ctx, self.site + 1)
    }

    /// `r + forward(x)` ([`project_add`]).
    fn forward_add(&self, x: &Tensor, r: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let drop = (self.dropout, self.site + 1);
        project_add(&self.c_proj, &self.heads(x, ctx)?, r, drop, ctx)
    }

    /// The attention's heads, merged: `c_proj`'s input.
    fn heads(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        if ctx.rows.doc_ids.is_some() {
            candle_core::bail!("GPT-2's attention does not take per-token document ids yet");
        }
        let qkv = self.c_attn.forward(x, ctx)?;
        ctx.kernels
            .causal_attention(&qkv, self.n_head, self.dropout, ctx, self.site)
    }

    /// Attention of new tokens over the cached ones and themselves (evaluation, f32).
    fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        i: usize,
    ) -> candle_core::Result<Tensor> {
        let ctx = Ctx::eval();
        let (b, t, c) = x.dims3()?;
        let hd = c / self.n_head;
        let qkv = self.c_attn.forward(x, &ctx)?;
        let heads = |j: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(D::Minus1, j * c, c)?
                .reshape((b, t, self.n_head, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let (k, v) = cache.append(i, &k, &v)?;
        // Causal with the queries at the end: query j (at position len + j) sees keys
        // 0..=len + j.
        let y = attention(&q, &k, &v, &AttentionConfig::causal())?
            .transpose(1, 2)?
            .reshape((b, t, c))?;
        self.c_proj.forward(&y, &ctx)
    }
}

/// The 4x feed-forward network with GELU (tanh approximation), `mlp.c_fc`, `mlp.c_proj`.
#[derive(Clone, Debug)]
pub(crate) struct Mlp {
    /// Conv1D `[n_embd, 4 n_embd]`.
    pub c_fc: Linear,
    /// Conv1D `[4 n_embd, n_embd]`.
    pub c_proj: Linear,
    dropout: f32,
    site: u64,
}

impl Mlp {
    /// `[B, T, C] -> [B, T, C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let h = self.c_fc.forward_gelu(x, ctx)?;
        let y = self.c_proj.forward(&h, ctx)?;
        ctx.kernels.dropout(&y, self.dropout, ctx, self.site)
    }

    /// `r + forward(x)` ([`project_add`]).
    fn forward_add(&self, x: &Tensor, r: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let h = self.c_fc.forward_gelu(x, ctx)?;
        project_add(&self.c_proj, &h, r, (self.dropout, self.site), ctx)
    }
}

/// `r + dropout(proj(y))` (dropout `p` at `site`): the add fused into the projection where no
/// dropout runs between them (evaluation, `p = 0`; [`Linear::forward_add`], which fuses only a
/// projection without bias: nanoGPT's `bias = false`, not Hugging Face's GPT-2).
fn project_add(
    proj: &Linear,
    y: &Tensor,
    r: &Tensor,
    (p, site): (f32, u64),
    ctx: &Ctx,
) -> candle_core::Result<Tensor> {
    if ctx.train && p != 0.0 {
        return r + ctx.kernels.dropout(&proj.forward(y, ctx)?, p, ctx, site)?;
    }
    proj.forward_add(y, r, ctx)
}

/// A pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Clone, Debug)]
pub struct Block {
    /// LayerNorm before attention.
    pub(crate) ln_1: LayerNorm,
    /// Causal self-attention.
    pub(crate) attn: CausalSelfAttention,
    /// LayerNorm before the MLP.
    pub(crate) ln_2: LayerNorm,
    /// Feed-forward network.
    pub(crate) mlp: Mlp,
    index: usize,
}

impl Block {
    /// Block `i` (`b` is the `transformer.h.{i}` path). Its dropout sites are `1 + 3i ..= 3 + 3i`
    /// (site 0 is the embedding's).
    pub fn build(b: &Builder, cfg: &GptConfig, i: usize) -> Result<Self> {
        let (c, bias) = (cfg.n_embd, cfg.bias);
        let site = 1 + 3 * i as u64;
        let (attn, mlp) = (b.pp("attn"), b.pp("mlp"));
        let conv1d =
            |b: &Builder, fan_in, fan_out| Linear::build(b, fan_in, fan_out, bias, Layout::InOut);
        Ok(Block {
            ln_1: LayerNorm::build(&b.pp("ln_1"), c, bias, LN_EPS)?,
            attn: CausalSelfAttention {
                c_attn: conv1d(&attn.pp("c_attn"), c, 3 * c)?,
                c_proj: conv1d(&attn.pp("c_proj"), c, c)?,
                n_head: cfg.n_head,
                dropout: cfg.dropout,
                site,
            },
            ln_2: LayerNorm::build(&b.pp("ln_2"), c, bias, LN_EPS)?,
            mlp: Mlp {
                c_fc: conv1d(&mlp.pp("c_fc"), c, 4 * c)?,
                c_proj: conv1d(&mlp.pp("c_proj"), 4 * c, c)?,
                dropout: cfg.dropout,
                site: site + 2,
            },
            index: i,
        })
    }
}

impl Cached for Block {
    fn cached(&self, x: &Tensor, cache: &mut KvCache, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let a = self
            .attn
            .forward_cached(&self.ln_1.forward_ctx(x, ctx)?, cache, self.index)?;
        let x = (x + a)?;
        &x + self.mlp.forward(&self.ln_2.forward_ctx(&x, ctx)?, ctx)?
    }
}

impl Weights for Block {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Block {
            ln_1: self.ln_1.map(f)?,
            attn: CausalSelfAttention {
                c_attn: self.attn.c_attn.map(f)?,
                c_proj: self.attn.c_proj.map(f)?,
                ..self.attn.clone()
            },
            ln_2: self.ln_2.map(f)?,
            mlp: Mlp {
                c_fc: self.mlp.c_fc.map(f)?,
                c_proj: self.mlp.c_proj.map(f)?,
                ..self.mlp.clone()
            },
            index: self.index,
        })
    }
}

impl LinkOps for Block {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let x = self
            .attn
            .forward_add(&self.ln_1.forward_ctx(x, ctx)?, x, ctx)?;
        self.mlp
            .forward_add(&self.ln_2.forward_ctx(&x, ctx)?, &x, ctx)
    }

    own_weights!();
}

/// A GPT-2 language model.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_models::model::gpt2::GptConfig;
/// use candle_models::model::{self, Ctx};
/// let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, dropout: 0.1, ..GptConfig::default() };
/// let (model, params) = model::init(&cfg, 42, &Device::Cpu)?;
/// let idx = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
/// let logits = model.forward(&idx, &Ctx::train(7))?;
/// assert_eq!(logits.dims(), &[2, 3, 11]);
/// let loss = candle_models::model::cross_entropy(&logits, &idx, None)?;
/// let grads = loss.backward()?;
/// assert!(params.iter().all(|(_, v)| grads.get(v).is_some()));
/// // The chain: embedding, 2 blocks, head; each link owns its parameters, the head ties wte.
/// let links = model.links();
/// assert_eq!(links.len(), 4);
/// assert_eq!(params.vars_of(&links[0].params()).len(), 2); // wte, wpe
/// params.check_ownership(&links)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type Gpt = Decoder<GptConfig, Embed, Block>;

impl Gpt {
    /// Builds the model's structure, taking every tensor from `b` by its Hugging Face name
    /// (`transformer.h.{i}.attn.c_attn.weight`, ...), derived from the structure itself.
    pub fn build(config: &GptConfig, b: &Builder) -> Result<Self> {
        let t = b.pp("transformer");
        let embed = Embed::build(&t, config)?;
        let blocks = (0..config.n_layer)
            .map(|i| Block::build(&t.pp("h").pp(i), config, i))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::build(&t.pp("ln_f"), config.n_embd, config.bias, LN_EPS)?;
        let head = Head::new(Norm::Layer(ln_f), LmHead::Tied(embed.wte.clone()));
        Ok(Decoder {
            config: config.clone(),
            embed,
            blocks,
            head,
        })
    }

    /// A freshly initialised model and its parameters ([`crate::model::init`], typed).
    pub fn new(
        config: &GptConfig,
        seed: u64,
        device: &candle_core::Device,
    ) -> Result<(Self, Params)> {
        config.validate()?;
        let params = Params::init(config, seed, device)?;
        Ok((Self::from_params(config, &params)?, params))
    }

    /// Token ids `[B, T]` (u32, `T <= block_size`) to logits `[B, T, vocab_size]` (f32).
    pub fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        run_links(&self.links(), idx, ctx)
    }

    /// The same model with every weight mapped by `f` (see [`Model::map`]).
    pub fn map_weights(&self, f: WeightMap) -> candle_core::Result<Self> {
        Weights::map(self, f)
    }

    /// The model with every weight cast to `dtype`, differentiably (see [`Gpt::map_weights`]).
    pub fn to_dtype(&self, dtype: candle_core::DType) -> candle_core::Result<Self> {
        self.map_weights(&|t: &Tensor| t.to_dtype(dtype))
    }

    /// Builds the model over existing parameters (names and shapes checked).
    pub fn from_params(config: &GptConfig, params: &Params) -> Result<Self> {
        config.validate()?;
        params.check(config)?;
        Self::build(config, &Builder::root(&|name, _| params.tensor(name)))
    }
}

impl candle_core::Module for Gpt {
    fn forward(&self, idx: &Tensor) -> candle_core::Result<Tensor> {
        Gpt::forward(self, idx, &Ctx::eval())
    }
}
