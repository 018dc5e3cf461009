//! The two ends of a decoder chain: the token embedding, and the head (a final norm, then the
//! projection to the vocabulary, its own or the embedding's) with a cross-entropy that never
//! holds the whole `[B, T, vocab]` logits.

use std::sync::Arc;

use candle_core::Tensor;

use super::super::chain::token_losses_of_logits;
use super::super::{Builder, Ctx, KvCache, Layout, Linear, LinkOps, Loss, WeightMap, IGNORE};
use super::{stat_dtype, Cached, LayerNorm, RmsNorm, Weights};
use crate::Result;

/// The token embedding (`model.embed_tokens`): token ids `[B, T]` to the residual stream.
#[derive(Clone, Debug)]
pub struct Embed {
    weight: Tensor,
    scale: Option<f64>,
}

impl Embed {
    /// `b.weight [vocab, hidden]`.
    pub fn build(b: &Builder, vocab: usize, hidden: usize) -> Result<Self> {
        Ok(Embed {
            weight: b.get(&[vocab, hidden], "weight")?,
            scale: None,
        })
    }

    /// The same embedding with its rows multiplied by `scale` (Gemma's `sqrt(hidden)`), the
    /// factor rounded to the compute dtype first, as transformers'
    /// `Gemma3TextScaledWordEmbedding` does (`sqrt(3072)` is 55.5 in bf16).
    pub fn with_scale(self, scale: Option<f64>) -> Self {
        Embed { scale, ..self }
    }

    /// The table `[vocab, hidden]` (a tied head reads it too).
    pub(crate) fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl Weights for Embed {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Embed {
            weight: f(&self.weight)?,
            scale: self.scale,
        })
    }
}

impl LinkOps for Embed {
    fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        idx.dims2()?;
        let w = self.weight.to_dtype(ctx.dtype)?;
        let x = ctx.kernels.embedding(&w, idx, ctx.rows.host_tokens(idx))?;
        match self.scale {
            // `x * s` with `s` rounded to f32 and then to x's dtype, as transformers' normalizer
            // tensor; no host-to-device copy (`affine`'s scale travels as a kernel argument).
            Some(s) => x.affine(f64::from(s as f32), 0.0),
            None => Ok(x),
        }
    }

    own_weights!();
}

impl Cached for Embed {
    /// The embedding alone: the rotary attention places new tokens after the cached ones.
    fn cached(&self, idx: &Tensor, _: &mut KvCache, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.forward(idx, ctx)
    }
}

/// The norm before the head: GPT-2's LayerNorm or the Llama family's RMSNorm.
#[derive(Clone, Debug)]
pub(crate) enum Norm {
    /// LayerNorm (`transformer.ln_f`).
    Layer(LayerNorm),
    /// RMSNorm (`model.norm`).
    Rms(RmsNorm),
}

impl Norm {
    /// Normalises `x` in its own dtype.
    pub(crate) fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        match self {
            Norm::Layer(n) => n.forward_ctx(x, ctx),
            Norm::Rms(n) => n.forward(x, ctx),
        }
    }
}

impl Weights for Norm {
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(match self {
            Norm::Layer(n) => Norm::Layer(n.map(f)?),
            Norm::Rms(n) => Norm::Rms(Weights::map(n, f)?),
        })
    }
}

/// The head's projection: its own `lm_head`, or the token embedding (tied).
#[derive(Clone, Debug)]
pub(crate) enum LmHead {
    /// `lm_head` `[V, C]`, owned by the head.
    Own(Linear),
    /// The token embedding `[V, C]`, owned by the embedding link.
    Tied(Tensor),
}

impl LmHead {
    /// `b.lm_head` `[V, C]` (no bias), or the embedding when `tied`.
    pub(crate) fn build(b: &Builder, embed: &Embed, tied: bool) -> Result<Self> {
        if tied {
            return Ok(LmHead::Tied(embed.weight().clone()));
        }
        let (v, c) = embed.weight().dims2()?;
        let l = Linear::build(&b.pp("lm_head"), c, v, false, Layout::OutIn)?;
        Ok(LmHead::Own(l))
    }
}

/// The final norm and the projection to the vocabulary: the last link of a chain.
#[derive(Clone, Debug)]
pub(crate) struct Head {
    norm: Norm,
    lm_head: LmHead,
    softcap: Option<f64>,
}

impl Head {
    /// The head `lm_head(norm(x))`.
    pub(crate) fn new(norm: Norm, lm_head: LmHead) -> Self {
        Head {
            norm,
            lm_head,
            softcap: None,
        }
    }

    /// The same head with its logits soft-capped, `c tanh(logits / c)` in f32 (Gemma's
    /// `final_logit_softcapping`). The loss then takes the whole logits: the chunked
    /// cross-entropy has no soft-cap (Gemma 3's released configs set none).
    pub(crate) fn with_softcap(self, softcap: Option<f64>) -> Self {
        Head { softcap, ..self }
    }

    /// The projection's weight when the loss is chunked: no adapter on the projection, no
    /// soft-cap, and the context does not ask for whole logits.
    fn chunked_weight(&self, ctx: &Ctx) -> Option<Tensor> {
        if self.softcap.is_some() {
            return None;
        }
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

    /// The chunked loss's inputs: `norm(x)` flat (`[B T, C]`) and the projection's weight
    /// `[V, C]` in the compute dtype, with the targets flat.
    fn chunk_inputs(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        ctx: &Ctx,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let h = self.norm.forward(x, ctx)?;
        let c = h.dim(2)?;
        let t = targets.flatten_all()?;
        Ok((h.reshape(((), c))?, w.to_dtype(ctx.dtype)?, t))
    }
}

impl Weights for Head {
    /// The norm, then the projection (its own, or the tied embedding).
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Head {
            norm: Weights::map(&self.norm, f)?,
            lm_head: match &self.lm_head {
                LmHead::Own(l) => LmHead::Own(l.map(f)?),
                LmHead::Tied(w) => LmHead::Tied(f(w)?),
            },
            softcap: self.softcap,
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
        let logits = logits.to_dtype(stat_dtype(logits.dtype()))?;
        match self.softcap {
            Some(c) => (logits / c)?.tanh()? * c,
            None => Ok(logits),
        }
    }

    /// The cross-entropy of the projection chunk by chunk (no `[B, T, V]` logits), unless
    /// an adapter wraps the head's projection or the context asks for whole logits
    /// ([`Ctx::chunked_loss`]).
    fn loss(&self, x: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Loss> {
        let mean = match self.chunked_weight(ctx) {
            Some(w) => {
                let (h, w, t) = self.chunk_inputs(x, &w, targets, ctx)?;
                let t = ctx.targets(targets, &t);
                ctx.kernels.linear_cross_entropy(&h, &w, t, IGNORE, false)?
            }
            None => {
                let logits = self.forward(x, ctx)?;
                ctx.kernels.cross_entropy_ignoring(
                    &logits,
                    ctx.targets(targets, targets),
                    IGNORE,
                )?
            }
        };
        Ok(Loss {
            mean,
            targets: targets.clone(),
        })
    }

    /// Each target's cross-entropy chunk by chunk when [`LinkOps::loss`] chunks.
    fn token_losses(&self, x: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let Some(w) = self.chunked_weight(ctx) else {
            return token_losses_of_logits(&self.forward(x, ctx)?, targets);
        };
        let (h, w, t) = self.chunk_inputs(x, &w, targets, ctx)?;
        ctx.kernels
            .linear_cross_entropy(&h, &w, ctx.targets(targets, &t), IGNORE, true)?
            .reshape(targets.shape())
    }

    fn params(&self) -> Vec<Tensor> {
        let mut w = Weights::weights(&self.norm);
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
        Ok(Arc::new(Weights::map(self, f)?))
    }
}
