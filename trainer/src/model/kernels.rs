//! Which implementation of the model's ops runs: `candle-fused`'s kernels (the default) or the
//! composite Candle expressions the model was first written with (`--kernels reference`, for
//! debugging and comparison).
//!
//! The model calls these methods and never branches on the choice itself; both paths compute
//! the same function (the fused kernels are checked against the composite expressions in
//! `candle-fused`'s tests, and the whole model in `trainer/tests/kernels.rs`).

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Tensor, D};
use candle_fused::attention::{attention_qkv, AttentionConfig};
use candle_fused::RngKey;
use serde::{Deserialize, Serialize};

use super::layers::{causal_mask, chacha_dropout, stat_dtype};
use super::Ctx;

/// The implementation of the model's ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// `candle-fused`: flash-style attention, one-pass LayerNorm, bias+GELU, fused
    /// cross-entropy and Philox dropout, each with its own backward kernel.
    #[default]
    Fused,
    /// Composite Candle ops (primitive softmax, LayerNorm from ~8 ops, host ChaCha dropout
    /// masks): slower and heavier, kept as the reference.
    Reference,
}

impl FromStr for Kernels {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fused" => Ok(Kernels::Fused),
            "reference" => Ok(Kernels::Reference),
            other => Err(format!("kernels must be fused or reference, not `{other}`")),
        }
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kernels::Fused => "fused",
            Kernels::Reference => "reference",
        })
    }
}

type R = candle_core::Result<Tensor>;

impl Kernels {
    /// GPT-2's Conv1D: `x W + b` with `W: [in, out]`.
    pub fn linear(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => candle_fused::linear::linear(x, w, b),
            Kernels::Reference => {
                let y = x.broadcast_matmul(w)?;
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }

    /// `gelu(x W + b)` (tanh GELU): the MLP's first layer, bias and activation in one kernel.
    pub fn linear_gelu(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => candle_fused::linear_gelu::linear_gelu(x, w, b),
            Kernels::Reference => self.linear(x, w, b)?.gelu(),
        }
    }

    /// LayerNorm over the last dimension; statistics in at least f32.
    pub fn layer_norm(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> R {
        match self {
            Kernels::Fused => candle_fused::norm::layer_norm(x, w, b, eps),
            Kernels::Reference => {
                let dtype = x.dtype();
                let x = x.to_dtype(stat_dtype(dtype))?;
                let mean = x.mean_keepdim(D::Minus1)?;
                let xc = x.broadcast_sub(&mean)?;
                let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
                let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
                let y = xhat.broadcast_mul(w)?;
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }

    /// Causal self-attention of GPT-2's fused projection `qkv [B, T, 3C]` with `n_head` heads,
    /// dropout `p` on the attention probabilities (at dropout site `site`): `[B, T, C]`.
    pub fn causal_attention(self, qkv: &Tensor, n_head: usize, p: f32, ctx: &Ctx, site: u64) -> R {
        let (b, t, c3) = qkv.dims3()?;
        let c = c3 / 3;
        let p = if ctx.train { p } else { 0.0 };
        match self {
            Kernels::Fused => {
                let mut cfg = AttentionConfig::causal();
                if p > 0.0 {
                    // Keyed by the global row, like `dropout` (probabilities are [B, H, T, T]).
                    let offset = (ctx.row * n_head * t * t) as u64;
                    cfg = cfg.with_dropout(p, RngKey::new(ctx.seed, site).with_offset(offset));
                }
                attention_qkv(qkv, n_head, &cfg)
            }
            Kernels::Reference => {
                let hd = c / n_head;
                let heads = |i: usize| -> R {
                    qkv.narrow(D::Minus1, i * c, c)?
                        .reshape((b, t, n_head, hd))?
                        .transpose(1, 2)?
                        .contiguous()
                };
                let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
                let att = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
                let sd = stat_dtype(att.dtype());
                let att = att
                    .to_dtype(sd)?
                    .broadcast_add(&causal_mask(t, qkv.device())?.to_dtype(sd)?)?;
                let att = candle_nn::ops::softmax(&att, D::Minus1)?.to_dtype(qkv.dtype())?;
                let att = self.dropout(&att, p, ctx, site)?;
                att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))
            }
        }
    }

    /// Inverted dropout with a mask that is a pure function of `(ctx.seed, site)` and the
    /// element's index in the whole batch (`x`'s rows are rows `ctx.row..` of it, see
    /// [`Ctx::row`]); `x` itself when not training or `p == 0`.
    pub fn dropout(self, x: &Tensor, p: f32, ctx: &Ctx, site: u64) -> R {
        if !ctx.train || p == 0.0 {
            return Ok(x.clone());
        }
        let row_len = x.elem_count() / x.dim(0)?.max(1);
        let offset = (ctx.row * row_len) as u64;
        match self {
            Kernels::Fused => candle_fused::dropout::dropout(
                x,
                p,
                RngKey::new(ctx.seed, site).with_offset(offset),
            ),
            Kernels::Reference => chacha_dropout(x, p, ctx.seed, site, offset),
        }
    }

    /// Mean cross-entropy of `logits [.., V]` against `targets` (u32), over the positions where
    /// `mask` is 1 (all positions without a mask); computed in at least f32.
    pub fn cross_entropy(self, logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => {
                candle_fused::cross_entropy::cross_entropy(logits, targets, mask, None)
            }
            Kernels::Reference => {
                let v = logits.dim(D::Minus1)?;
                let logits = logits
                    .to_dtype(stat_dtype(logits.dtype()))?
                    .reshape(((), v))?;
                let targets = targets.flatten_all()?;
                let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                let nll = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
                match mask {
                    None => nll.mean_all(),
                    Some(mask) => {
                        let mask = mask.flatten_all()?.to_dtype(logp.dtype())?;
                        // An all-zero mask gives loss 0 (and zero gradients), not 0/0.
                        let count = mask.sum_all()?.maximum(1.0)?;
                        (nll * &mask)?.sum_all()?.broadcast_div(&count)
                    }
                }
            }
        }
    }

    /// [`Kernels::cross_entropy`] over the targets that are not `ignore` (the loss mask folded
    /// into the targets, as PyTorch's `ignore_index`).
    pub fn cross_entropy_ignoring(self, logits: &Tensor, targets: &Tensor, ignore: u32) -> R {
        match self {
            Kernels::Fused => {
                candle_fused::cross_entropy::cross_entropy(logits, targets, None, Some(ignore))
            }
            Kernels::Reference => {
                let keep = targets.ne(ignore)?;
                let safe = keep.where_cond(targets, &targets.zeros_like()?)?;
                self.cross_entropy(logits, &safe, Some(&keep.to_dtype(DType::F32)?))
            }
        }
    }
}
