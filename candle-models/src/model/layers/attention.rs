//! Grouped-query self-attention with rotary embeddings and its options (biases, per-head
//! q/k RMSNorm, a sliding window), as the Llama family's `self_attn` runs it.

use std::sync::Arc;

use candle_core::Tensor;

use super::super::{Builder, Ctx, Dims, KvCache, Layout, Linear, WeightMap};
use super::rope::RopeConsts;
use super::{RmsNorm, Weights};
use crate::Result;

/// The activation of a [`GatedMlp`](super::GatedMlp)'s gate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GateAct {
    /// SiLU (SwiGLU: the Llama family's `silu`).
    #[default]
    Silu,
    /// Tanh-approximated GELU (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// The shape and options of one decoder block ([`super::Block`]): its attention and its
/// gated MLP. An architecture's config says how its `config.json` sets them.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockOptions {
    /// The model's dimensions: width `C`, query heads `H`, key/value heads `KV` (each serves
    /// `H / KV` consecutive query heads), head width `D`, MLP width `I`.
    pub dims: Dims,
    /// Biases of the projections `(q/k/v, o, MLP)`.
    pub biases: (bool, bool, bool),
    /// RMSNorm of q and k per head before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Sliding-window size of the attention (`None`: full causal).
    pub window: Option<usize>,
    /// Epsilon of every RMSNorm of the block.
    pub norm_eps: f64,
    /// RoPE inverse frequencies `[D / 2]` ([`super::RopeScaling::inv_freq`]).
    pub inv_freq: Vec<f32>,
    /// Dropout on the attention probabilities.
    pub dropout: f32,
    /// Every RMSNorm of the block scales by `1 + w` in f32 (Gemma's).
    pub norm_unit_offset: bool,
    /// Gemma 2/3's four norms: the attention's and the MLP's outputs are normalised too
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`) and the MLP's input by
    /// `pre_feedforward_layernorm` (`post_attention_layernorm` is then no longer the MLP's).
    pub sandwich_norms: bool,
    /// The gated MLP's activation.
    pub act: GateAct,
    /// Score scale (`None`: `1 / sqrt(D)`; Gemma: `query_pre_attn_scalar^-0.5`).
    pub attn_scale: Option<f64>,
}

/// Grouped-query self-attention with rotary embeddings (`self_attn`): causal, optionally
/// within a sliding window and within each token's document (packed rows); key/value heads
/// are never repeated in memory.
#[derive(Clone, Debug)]
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    n_head: usize,
    n_kv: usize,
    head_dim: usize,
    window: Option<usize>,
    scale: Option<f64>,
    /// `inv_freq` and positions, copied to the device once (shared by the layer's copies).
    rope: Arc<RopeConsts>,
    dropout: f32,
    site: u64,
}

impl Attention {
    /// `b.{q,k,v,o}_proj` (and `b.{q,k}_norm` with `qk_norm`), its dropout at `site`.
    pub fn build(b: &Builder, o: &BlockOptions, site: u64) -> Result<Self> {
        let (c, d) = (o.dims.hidden, o.dims.head_dim);
        let (h, kv) = (o.dims.heads, o.dims.kv_heads);
        let lin = |name: &str, fan_in, fan_out, bias| {
            Linear::build(&b.pp(name), fan_in, fan_out, bias, Layout::OutIn)
        };
        let (qkv_bias, o_bias, _) = o.biases;
        let qk_norm = match o.qk_norm {
            true => Some((
                RmsNorm::build(&b.pp("q_norm"), d, o.norm_eps)?
                    .with_unit_offset(o.norm_unit_offset),
                RmsNorm::build(&b.pp("k_norm"), d, o.norm_eps)?
                    .with_unit_offset(o.norm_unit_offset),
            )),
            false => None,
        };
        Ok(Attention {
            q_proj: lin("q_proj", c, h * d, qkv_bias)?,
            k_proj: lin("k_proj", c, kv * d, qkv_bias)?,
            v_proj: lin("v_proj", c, kv * d, qkv_bias)?,
            o_proj: lin("o_proj", h * d, c, o_bias)?,
            qk_norm,
            n_head: h,
            n_kv: kv,
            head_dim: d,
            window: o.window,
            scale: o.attn_scale,
            rope: Arc::new(RopeConsts::new(o.inv_freq.clone())),
            dropout: o.dropout,
            site,
        })
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

    /// `[B, T, C] -> [B, T, C]` at the rows' positions (`0..T` unless the context gives them).
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.o_proj.forward(&self.heads(x, ctx)?, ctx)
    }

    /// `r + forward(x)`, the add fused into `o_proj` ([`Linear::forward_add`]).
    pub(crate) fn forward_add(
        &self,
        x: &Tensor,
        r: &Tensor,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        self.o_proj.forward_add(&self.heads(x, ctx)?, r, ctx)
    }

    /// The attention's heads, merged: `o_proj`'s input.
    fn heads(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let pos = match &ctx.rows.positions {
            Some(p) => p.clone(),
            None => self.rope.positions(b, t, 0, x.device())?,
        };
        let (q, k, v) = self.qkv(x, &pos, ctx)?;
        let p = if ctx.train { self.dropout } else { 0.0 };
        self.attend(&q, &k, &v, ctx.rows.doc_ids.as_ref(), p, ctx)
    }

    /// The attention of rotated `q` over `k`, `v`, heads merged: flash-style for any head
    /// size (on CUDA the Triton kernels take `D <= 128`; larger heads, such as Gemma's 256,
    /// run `candle_fused::attention`'s composite fallback there).
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        doc_ids: Option<&Tensor>,
        p: f32,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let (window, scale) = (self.window, self.scale);
        ctx.kernels
            .gqa_attention(q, k, v, window, scale, doc_ids, p, ctx, self.site)
    }

    /// Attention of new tokens over the cached ones (block `i`'s entries) and themselves
    /// (evaluation).
    pub(crate) fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        i: usize,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let pos = self.rope.positions(b, t, cache.len, x.device())?;
        let (q, k, v) = self.qkv(x, &pos, ctx)?;
        let (k, v) = match self.window {
            Some(w) => cache.append_window(i, &k, &v, w)?,
            None => cache.append(i, &k, &v)?,
        };
        let y = self.attend(&q, &k, &v, None, 0.0, ctx)?;
        self.o_proj.forward(&y, ctx)
    }
}

impl Weights for Attention {
    /// The projections q, k, v, o, then the q/k norms.
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        let (q_proj, k_proj) = (self.q_proj.map(f)?, self.k_proj.map(f)?);
        let (v_proj, o_proj) = (self.v_proj.map(f)?, self.o_proj.map(f)?);
        let qk_norm = match &self.qk_norm {
            Some((q, k)) => Some((Weights::map(q, f)?, Weights::map(k, f)?)),
            None => None,
        };
        Ok(Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            qk_norm,
            ..self.clone()
        })
    }
}
