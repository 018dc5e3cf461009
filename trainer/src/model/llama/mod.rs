//! The Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM`), written as a chain `embed -> blocks -> head` of plain structs.
//!
//! Parameter names are transformers' (`model.layers.{i}.self_attn.q_proj.weight`, ...), so
//! real checkpoints load without renaming and ours load in transformers. A block is
//!
//! ```text
//! h = x + o_proj(attention(rope(q_norm?(q_proj(rms(x)))), rope(k_norm?(k_proj(rms(x)))), v_proj(rms(x))))
//! y = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
//! ```
//!
//! with grouped-query attention (each key/value head serves consecutive query heads, never
//! repeated in memory), causal, optionally within a sliding window and within each token's
//! document (packed rows). Every op has a backward ([`super::Kernels`]): RMSNorm with f32
//! statistics, RoPE in transformers' split-halves convention with f32 tables, SwiGLU, the
//! flash-style attention and, on the head, a cross-entropy that never holds the whole
//! `[B, T, vocab]` logits.

mod config;
mod hf_json;
mod rope;

use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;
use serde_json::Value;

pub use config::{Family, LlamaConfig};
pub use rope::RopeScaling;

use super::{
    stat_dtype, Architecture, Builder, Ctx, KvCache, Layout, Linear, Link, LinkOps, Loss, Model,
    ModelConfig, WeightMap, IGNORE,
};
use crate::Result;

/// A member of the family as an [`Architecture`] (recognised by its `model_type`).
pub struct LlamaArch(pub Family);

/// `llama`.
pub static LLAMA: LlamaArch = LlamaArch(Family::Llama);
/// `mistral`.
pub static MISTRAL: LlamaArch = LlamaArch(Family::Mistral);
/// `qwen2`.
pub static QWEN2: LlamaArch = LlamaArch(Family::Qwen2);
/// `qwen3`.
pub static QWEN3: LlamaArch = LlamaArch(Family::Qwen3);

impl Architecture for LlamaArch {
    fn name(&self) -> &'static str {
        self.0.model_type()
    }

    fn class(&self) -> &'static str {
        self.0.class()
    }

    fn config_from_hf_json(&self, json: &Value, path: &Path) -> Result<Box<dyn ModelConfig>> {
        Ok(Box::new(LlamaConfig::from_hf_json(json, path)?))
    }
}

/// RMSNorm over the last dimension (`weight * x / sqrt(mean(x²) + eps)`, statistics in f32).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// Scale `[C]`.
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn build(b: &Builder, c: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: b.get(&[c], "weight")?,
            eps,
        })
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(RmsNorm {
            weight: f(&self.weight)?,
            eps: self.eps,
        })
    }

    /// Normalises `x` (any leading dims) in its own dtype.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let w = self.weight.to_dtype(x.dtype())?;
        ctx.kernels.rms_norm(x, &w, self.eps)
    }
}

/// The token embedding `model.embed_tokens`.
#[derive(Clone, Debug)]
pub struct Embed {
    /// `[vocab_size, hidden_size]`; the head reads it too when tied.
    pub embed_tokens: Tensor,
}

impl Embed {
    fn embed(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        idx.dims2()?;
        let w = self.embed_tokens.to_dtype(ctx.dtype)?;
        ctx.kernels.embedding(&w, idx, ctx.rows.host_tokens(idx))
    }
}

impl LinkOps for Embed {
    fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.embed(idx, ctx)
    }

    fn params(&self) -> Vec<Tensor> {
        vec![self.embed_tokens.clone()]
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(Embed {
            embed_tokens: f(&self.embed_tokens)?,
        }))
    }
}

/// Grouped-query self-attention with rotary embeddings (`self_attn`).
#[derive(Clone, Debug)]
pub struct Attention {
    /// `[H * D, C]`.
    pub q_proj: Linear,
    /// `[KV * D, C]`.
    pub k_proj: Linear,
    /// `[KV * D, C]`.
    pub v_proj: Linear,
    /// `[C, H * D]`.
    pub o_proj: Linear,
    /// Per-head RMSNorm of q and k (Qwen3).
    pub qk_norm: Option<(RmsNorm, RmsNorm)>,
    n_head: usize,
    n_kv: usize,
    head_dim: usize,
    window: Option<usize>,
    /// `inv_freq` and positions, copied to the device once (shared by the layer's copies).
    rope: Arc<rope::RopeConsts>,
    dropout: f32,
    site: u64,
}

impl Attention {
    fn build(b: &Builder, cfg: &LlamaConfig, i: usize) -> Result<Self> {
        let (c, d) = (cfg.hidden_size, cfg.head_dim);
        let (h, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let lin = |name: &str, fan_in, fan_out, bias| {
            Linear::build(&b.pp(name), fan_in, fan_out, bias, Layout::OutIn)
        };
        let qk_norm = match cfg.qk_norm {
            true => Some((
                RmsNorm::build(&b.pp("q_norm"), d, cfg.rms_norm_eps)?,
                RmsNorm::build(&b.pp("k_norm"), d, cfg.rms_norm_eps)?,
            )),
            false => None,
        };
        Ok(Attention {
            q_proj: lin("q_proj", c, h * d, cfg.qkv_bias)?,
            k_proj: lin("k_proj", c, kv * d, cfg.qkv_bias)?,
            v_proj: lin("v_proj", c, kv * d, cfg.qkv_bias)?,
            o_proj: lin("o_proj", h * d, c, cfg.o_bias)?,
            qk_norm,
            n_head: h,
            n_kv: kv,
            head_dim: d,
            window: cfg.layer_windows[i],
            rope: Arc::new(rope::RopeConsts::new(
                cfg.rope_scaling.inv_freq(cfg.rope_theta, d),
            )),
            dropout: cfg.attention_dropout,
            site: 1 + i as u64,
        })
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        let qk_norm = match &self.qk_norm {
            Some((q, k)) => Some((q.map(f)?, k.map(f)?)),
            None => None,
        };
        Ok(Attention {
            q_proj: self.q_proj.map(f)?,
            k_proj: self.k_proj.map(f)?,
            v_proj: self.v_proj.map(f)?,
            o_proj: self.o_proj.map(f)?,
            qk_norm,
            ..self.clone()
        })
    }

    fn weights(&self) -> Vec<Tensor> {
        let mut w: Vec<Tensor> = [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .iter()
            .flat_map(|l| l.weights())
            .collect();
        if let Some((q, k)) = &self.qk_norm {
            w.extend([q.weight.clone(), k.weight.clone()]);
        }
        w
    }

    /// Rotated q `[B, H, T, D]`, rotated k `[B, KV, T, D]` and v `[B, KV, T, D]` of `x` at
    /// positions `pos` (`[B, T]` u32).
    fn qkv(
        &self,
        x: &Tensor,
        pos: &Tensor,
        ctx: &Ctx,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        let q = self
            .q_proj
            .forward(x, ctx)?
            .reshape((b, t, self.n_head, d))?;
        let k = self.k_proj.forward(x, ctx)?.reshape((b, t, self.n_kv, d))?;
        let v = self.v_proj.forward(x, ctx)?.reshape((b, t, self.n_kv, d))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q, ctx)?, kn.forward(&k, ctx)?),
            None => (q, k),
        };
        let inv_freq = self.rope.inv_freq(x.device())?;
        let (cos, sin) = ctx.kernels.rope_tables(pos, &inv_freq)?;
        let q = ctx.kernels.rope(&q, &cos, &sin)?;
        let k = ctx.kernels.rope(&k, &cos, &sin)?;
        Ok((q, k, v.transpose(1, 2)?))
    }

    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let pos = match &ctx.rows.positions {
            Some(p) => p.clone(),
            None => self.rope.positions(b, t, 0, x.device())?,
        };
        let (q, k, v) = self.qkv(x, &pos, ctx)?;
        let p = if ctx.train { self.dropout } else { 0.0 };
        let y = ctx.kernels.gqa_attention(
            &q,
            &k,
            &v,
            self.window,
            ctx.rows.doc_ids.as_ref(),
            p,
            ctx,
            self.site,
        )?;
        self.o_proj.forward(&y, ctx)
    }

    /// Attention of new tokens over the cached ones and themselves (evaluation).
    fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        i: usize,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let pos = self.rope.positions(b, t, cache.len, x.device())?;
        let (q, k, v) = self.qkv(x, &pos, ctx)?;
        let (k, v) = cache.append(i, &k, &v)?;
        let y = ctx
            .kernels
            .gqa_attention(&q, &k, &v, self.window, None, 0.0, ctx, self.site)?;
        self.o_proj.forward(&y, ctx)
    }
}

/// The SwiGLU feed-forward network (`mlp`): `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[I, C]`.
    pub gate_proj: Linear,
    /// `[I, C]`.
    pub up_proj: Linear,
    /// `[C, I]`.
    pub down_proj: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let g = self.gate_proj.forward(x, ctx)?;
        let u = self.up_proj.forward(x, ctx)?;
        self.down_proj.forward(&ctx.kernels.swiglu(&g, &u)?, ctx)
    }
}

/// A pre-norm block `model.layers.{i}`.
#[derive(Clone, Debug)]
pub struct Block {
    /// RMSNorm before attention.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// Feed-forward network.
    pub mlp: Mlp,
    index: usize,
}

impl Block {
    fn build(b: &Builder, cfg: &LlamaConfig, i: usize) -> Result<Self> {
        let (c, m, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps);
        let mlp = b.pp("mlp");
        let lin = |name: &str, fan_in, fan_out| {
            Linear::build(&mlp.pp(name), fan_in, fan_out, cfg.mlp_bias, Layout::OutIn)
        };
        Ok(Block {
            input_layernorm: RmsNorm::build(&b.pp("input_layernorm"), c, eps)?,
            self_attn: Attention::build(&b.pp("self_attn"), cfg, i)?,
            post_attention_layernorm: RmsNorm::build(&b.pp("post_attention_layernorm"), c, eps)?,
            mlp: Mlp {
                gate_proj: lin("gate_proj", c, m)?,
                up_proj: lin("up_proj", c, m)?,
                down_proj: lin("down_proj", m, c)?,
            },
            index: i,
        })
    }

    fn mapped(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Block {
            input_layernorm: self.input_layernorm.map(f)?,
            self_attn: self.self_attn.map(f)?,
            post_attention_layernorm: self.post_attention_layernorm.map(f)?,
            mlp: Mlp {
                gate_proj: self.mlp.gate_proj.map(f)?,
                up_proj: self.mlp.up_proj.map(f)?,
                down_proj: self.mlp.down_proj.map(f)?,
            },
            index: self.index,
        })
    }

    fn mlp_residual(&self, h: Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let y = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h, ctx)?, ctx)?;
        h + y
    }

    fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let a = self.self_attn.forward_cached(
            &self.input_layernorm.forward(x, ctx)?,
            cache,
            self.index,
            ctx,
        )?;
        self.mlp_residual((x + a)?, ctx)
    }
}

impl LinkOps for Block {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let a = self
            .self_attn
            .forward(&self.input_layernorm.forward(x, ctx)?, ctx)?;
        self.mlp_residual((x + a)?, ctx)
    }

    fn params(&self) -> Vec<Tensor> {
        let mut w = vec![self.input_layernorm.weight.clone()];
        w.extend(self.self_attn.weights());
        w.push(self.post_attention_layernorm.weight.clone());
        for l in [&self.mlp.gate_proj, &self.mlp.up_proj, &self.mlp.down_proj] {
            w.extend(l.weights());
        }
        w
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(self.mapped(f)?))
    }
}

/// The head's projection: its own `lm_head`, or the token embedding (tied).
#[derive(Clone, Debug)]
pub enum LmHead {
    /// `lm_head.weight [V, C]`, owned by the head.
    Own(Linear),
    /// The token embedding `[V, C]`, owned by the embedding link.
    Tied(Tensor),
}

/// The final RMSNorm `model.norm` and the projection to the vocabulary.
#[derive(Clone, Debug)]
pub struct Head {
    /// `model.norm`.
    pub norm: RmsNorm,
    /// The projection.
    pub lm_head: LmHead,
}

impl Head {
    /// The projection's weight when the loss is chunked: no adapter on the projection and
    /// the context does not ask for whole logits.
    fn chunked_weight(&self, ctx: &Ctx) -> Option<Tensor> {
        match &self.lm_head {
            LmHead::Own(l)
                if l.adapter().is_none() && l.quantized().is_none() && ctx.chunked_loss =>
            {
                Some(l.weight.clone())
            }
            LmHead::Tied(w) if ctx.chunked_loss => Some(w.clone()),
            _ => None,
        }
    }

    fn mapped(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Head {
            norm: self.norm.map(f)?,
            lm_head: match &self.lm_head {
                LmHead::Own(l) => LmHead::Own(l.map(f)?),
                LmHead::Tied(w) => LmHead::Tied(f(w)?),
            },
        })
    }
}

impl LinkOps for Head {
    /// `[B, T, C] -> logits [B, T, V]` in f32 (f64 when computing in f64).
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let h = self.norm.forward(x, ctx)?;
        let logits = match &self.lm_head {
            LmHead::Own(l) => l.forward(&h, ctx)?,
            LmHead::Tied(w) => ctx.kernels.linear(&h, &w.to_dtype(ctx.dtype)?.t()?, None)?,
        };
        logits.to_dtype(stat_dtype(logits.dtype()))
    }

    /// The cross-entropy of the projection chunk by chunk (no `[B, T, V]` logits), unless
    /// an adapter wraps the head's projection or the context asks for whole logits.
    fn loss(&self, x: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Loss> {
        let w = match self.chunked_weight(ctx) {
            Some(w) => w,
            None => {
                let logits = self.forward(x, ctx)?;
                let mean = ctx.kernels.cross_entropy_ignoring(
                    &logits,
                    ctx.targets(targets, targets),
                    IGNORE,
                )?;
                return Ok(Loss {
                    mean,
                    targets: targets.clone(),
                });
            }
        };
        let h = self.norm.forward(x, ctx)?;
        let c = h.dim(2)?;
        let t = targets.flatten_all()?;
        let mean = ctx.kernels.linear_cross_entropy(
            &h.reshape(((), c))?,
            &w.to_dtype(ctx.dtype)?,
            ctx.targets(targets, &t),
            IGNORE,
        )?;
        Ok(Loss {
            mean,
            targets: targets.clone(),
        })
    }

    /// Each target's cross-entropy chunk by chunk when [`LinkOps::loss`] chunks.
    fn token_losses(&self, x: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let Some(w) = self.chunked_weight(ctx) else {
            return super::chain::token_losses_of_logits(&self.forward(x, ctx)?, targets);
        };
        let h = self.norm.forward(x, ctx)?;
        let c = h.dim(2)?;
        let t = targets.flatten_all()?;
        ctx.kernels
            .linear_cross_entropy_per_token(
                &h.reshape(((), c))?,
                &w.to_dtype(ctx.dtype)?,
                ctx.targets(targets, &t),
                IGNORE,
            )?
            .reshape(targets.shape())
    }

    fn params(&self) -> Vec<Tensor> {
        let mut w = vec![self.norm.weight.clone()];
        if let LmHead::Own(l) = &self.lm_head {
            w.extend(l.weights());
        }
        w
    }

    fn tied(&self) -> Vec<Tensor> {
        match &self.lm_head {
            LmHead::Tied(w) => vec![w.clone()],
            LmHead::Own(_) => Vec::new(),
        }
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(self.mapped(f)?))
    }
}

/// A Llama-family causal language model.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use trainer::model::llama::{Family, LlamaConfig};
/// use trainer::model::{self, Ctx};
/// let cfg = LlamaConfig::new(Family::Llama, 50, 2, 16, 4, 2, 24);
/// let (model, params) = model::init(&cfg, 42, &Device::Cpu)?;
/// let idx = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
/// let loss = model.loss(&idx, &idx, &Ctx::train(7))?;
/// let grads = loss.mean.backward()?;
/// assert!(params.iter().all(|(_, v)| grads.get(v).is_some()));
/// assert_eq!(model.links().len(), 4); // embedding, 2 blocks, head
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Llama {
    /// The model's hyper-parameters.
    pub config: LlamaConfig,
    /// `model.embed_tokens`.
    pub embed: Embed,
    /// `model.layers.{i}`.
    pub blocks: Vec<Block>,
    /// `model.norm` and `lm_head`.
    pub head: Head,
}

impl Llama {
    /// The structure over tensors taken from `b` by their transformers names.
    pub fn build(config: &LlamaConfig, b: &Builder) -> Result<Self> {
        let m = b.pp("model");
        let embed = Embed {
            embed_tokens: m
                .pp("embed_tokens")
                .get(&[config.vocab_size, config.hidden_size], "weight")?,
        };
        let blocks = (0..config.num_hidden_layers)
            .map(|i| Block::build(&m.pp("layers").pp(i), config, i))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = match config.tie_word_embeddings {
            true => LmHead::Tied(embed.embed_tokens.clone()),
            false => LmHead::Own(Linear::build(
                &b.pp("lm_head"),
                config.hidden_size,
                config.vocab_size,
                false,
                Layout::OutIn,
            )?),
        };
        let head = Head {
            norm: RmsNorm::build(&m.pp("norm"), config.hidden_size, config.rms_norm_eps)?,
            lm_head,
        };
        Ok(Llama {
            config: config.clone(),
            embed,
            blocks,
            head,
        })
    }
}

impl Model for Llama {
    fn config(&self) -> &dyn ModelConfig {
        &self.config
    }

    fn links(&self) -> Vec<Link> {
        super::chain(&self.embed, &self.blocks, &self.head)
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Box<dyn Model>> {
        Ok(Box::new(Llama {
            config: self.config.clone(),
            embed: Embed {
                embed_tokens: f(&self.embed.embed_tokens)?,
            },
            blocks: self
                .blocks
                .iter()
                .map(|b| b.mapped(f))
                .collect::<candle_core::Result<_>>()?,
            head: self.head.mapped(f)?,
        }))
    }

    fn forward_cached(&self, idx: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let ctx = Ctx::eval().with_kernels(cache.kernels);
        let t = idx.dim(1)?;
        let mut x = self.embed.embed(idx, &ctx)?;
        for b in &self.blocks {
            x = b.forward_cached(&x, cache, &ctx)?;
        }
        cache.len += t;
        self.head.forward(&x, &ctx)
    }
}

#[cfg(test)]
mod tests;
