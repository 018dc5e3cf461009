//! Which implementation of the model's ops runs: `candle-fused`'s kernels (the default) or
//! their composite Candle expressions, `candle-fused`'s `*_composite` references
//! (`--kernels reference`, for debugging and comparison).
//!
//! The model calls these methods and never branches on the choice itself; both paths compute
//! the same function with the same dropout masks (the fused kernels are checked against the
//! composite expressions in `candle-fused`'s tests, and the whole model in
//! `trainer/tests/kernels.rs`).

use candle_core::Tensor;
use candle_fused::attention::{self, AttentionConfig};
use candle_fused::{cross_entropy, dropout, linear, linear_gelu, norm, RngKey};
use serde::{Deserialize, Serialize};

use super::Ctx;

/// The implementation of the model's ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// `candle-fused`: flash-style attention, one-pass LayerNorm, bias+GELU, fused
    /// cross-entropy and Philox dropout, each with its own backward kernel.
    #[default]
    Fused,
    /// `candle-fused`'s composite Candle expressions (primitive softmax, LayerNorm from ~8
    /// ops, the same Philox dropout masks drawn on the host): slower and heavier, kept as the
    /// reference.
    Reference,
}

named_enum!(Kernels, "kernels must be fused or reference", {
    Fused => "fused",
    Reference => "reference",
});

type R = candle_core::Result<Tensor>;

impl Kernels {
    /// GPT-2's Conv1D: `x W + b` with `W: [in, out]`.
    pub fn linear(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => linear::linear(x, w, b),
            Kernels::Reference => linear::linear_composite(x, w, b),
        }
    }

    /// `gelu(x W + b)` (tanh GELU): the MLP's first layer, bias and activation in one kernel.
    pub fn linear_gelu(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => linear_gelu::linear_gelu(x, w, b),
            Kernels::Reference => linear_gelu::linear_gelu_composite(x, w, b),
        }
    }

    /// LayerNorm over the last dimension; statistics in at least f32.
    pub fn layer_norm(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> R {
        match self {
            Kernels::Fused => norm::layer_norm(x, w, b, eps),
            Kernels::Reference => norm::layer_norm_composite(x, w, b, eps),
        }
    }

    /// Causal self-attention of GPT-2's fused projection `qkv [B, T, 3C]` with `n_head` heads,
    /// dropout `p` on the attention probabilities (at dropout site `site`): `[B, T, C]`.
    pub fn causal_attention(self, qkv: &Tensor, n_head: usize, p: f32, ctx: &Ctx, site: u64) -> R {
        let t = qkv.dim(1)?;
        let p = if ctx.train { p } else { 0.0 };
        let mut cfg = AttentionConfig::causal();
        if p > 0.0 {
            // Keyed by the global row, like `dropout` (probabilities are [B, H, T, T]).
            let offset = (ctx.row * n_head * t * t) as u64;
            cfg = cfg.with_dropout(p, RngKey::new(ctx.seed, site).with_offset(offset));
        }
        match self {
            Kernels::Fused => attention::attention_qkv(qkv, n_head, &cfg),
            Kernels::Reference => attention::attention_qkv_composite(qkv, n_head, &cfg),
        }
    }

    /// Inverted dropout with a mask that is a pure function of `(ctx.seed, site)` and the
    /// element's index in the whole batch (`x`'s rows are rows `ctx.row..` of it, see
    /// [`Ctx::row`]): the same Philox mask on both kernels; `x` itself when not training or
    /// `p == 0`.
    pub fn dropout(self, x: &Tensor, p: f32, ctx: &Ctx, site: u64) -> R {
        if !ctx.train || p == 0.0 {
            return Ok(x.clone());
        }
        let row_len = x.elem_count() / x.dim(0)?.max(1);
        let key = RngKey::new(ctx.seed, site).with_offset((ctx.row * row_len) as u64);
        match self {
            Kernels::Fused => dropout::dropout(x, p, key),
            Kernels::Reference => dropout::dropout_composite(x, p, key),
        }
    }

    /// Mean cross-entropy of `logits [.., V]` against `targets` (u32), over the positions where
    /// `mask` is 1 (all positions without a mask); computed in at least f32.
    pub fn cross_entropy(self, logits: &Tensor, targets: &Tensor, mask: Option<&Tensor>) -> R {
        match self {
            Kernels::Fused => cross_entropy::cross_entropy(logits, targets, mask, None),
            Kernels::Reference => {
                cross_entropy::cross_entropy_composite(logits, targets, mask, None)
            }
        }
    }

    /// [`Kernels::cross_entropy`] over the targets that are not `ignore` (the loss mask folded
    /// into the targets, as PyTorch's `ignore_index`).
    pub fn cross_entropy_ignoring(self, logits: &Tensor, targets: &Tensor, ignore: u32) -> R {
        match self {
            Kernels::Fused => cross_entropy::cross_entropy(logits, targets, None, Some(ignore)),
            Kernels::Reference => {
                cross_entropy::cross_entropy_composite(logits, targets, None, Some(ignore))
            }
        }
    }
}

// Llama-family ops. TEMPORARY composite shims until candle-fused's rope / swiglu / GQA
// attention / linear cross-entropy land (replaced at merge).
impl Kernels {
    /// RMSNorm over the last dimension; statistics in at least f32.
    pub fn rms_norm(self, x: &Tensor, w: &Tensor, eps: f64) -> R {
        match self {
            Kernels::Fused => norm::rms_norm(x, w, eps),
            Kernels::Reference => norm::rms_norm_composite(x, w, eps),
        }
    }

    /// RoPE tables `cos`, `sin` `[B, T, D/2]` (f32) of `positions [B, T]` and `inv_freq [D/2]`.
    pub fn rope_tables(
        self,
        positions: &Tensor,
        inv_freq: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let f = positions
            .to_dtype(candle_core::DType::F32)?
            .unsqueeze(2)?
            .broadcast_mul(&inv_freq.reshape((1, 1, ()))?)?;
        Ok((f.cos()?, f.sin()?))
    }

    /// RoPE (split halves) of `x [B, T, H, D]`: `[B, H, T, D]`.
    pub fn rope(self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> R {
        let dt = x.dtype();
        let x = x.to_dtype(super::stat_dtype(dt))?;
        let d = x.dim(3)? / 2;
        let (cos, sin) = (
            cos.unsqueeze(2)?.to_dtype(x.dtype())?,
            sin.unsqueeze(2)?.to_dtype(x.dtype())?,
        );
        let x1 = x.narrow(3, 0, d)?;
        let x2 = x.narrow(3, d, d)?;
        let y1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let y2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Tensor::cat(&[y1, y2], 3)?
            .transpose(1, 2)?
            .contiguous()?
            .to_dtype(dt)
    }

    /// `silu(gate) * up`.
    pub fn swiglu(self, gate: &Tensor, up: &Tensor) -> R {
        candle_nn::ops::silu(gate)? * up
    }

    /// Grouped-query causal attention of `q [B, H, T, D]` over `k`, `v` `[B, KV, Tk, D]`,
    /// within `window` and the documents of `doc_ids [B, Tk]`: `[B, T, H * D]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_attention(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
        doc_ids: Option<&Tensor>,
        p: f32,
        _ctx: &Ctx,
        _site: u64,
    ) -> R {
        use candle_core::DType;
        let (b, h, tq, d) = q.dims4()?;
        let (_, kv, tk, _) = k.dims4()?;
        let rep = h / kv;
        let expand = |t: &Tensor| -> R {
            t.unsqueeze(2)?
                .broadcast_as((b, kv, rep, tk, d))?
                .reshape((b, h, tk, d))
        };
        let dt = q.dtype();
        let acc = super::stat_dtype(dt);
        let (k, v) = (expand(k)?, expand(v)?);
        let s = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?
            .to_dtype(acc)?;
        let mut mask = vec![0f32; b * tq * tk];
        let ids: Option<Vec<Vec<u32>>> = doc_ids.map(|d| d.to_vec2()).transpose()?;
        for bi in 0..b {
            for i in 0..tq {
                let ia = i + tk - tq;
                for j in 0..tk {
                    let mut ok = j <= ia;
                    if let Some(w) = window {
                        ok &= ia - j.min(ia) < w;
                    }
                    if let Some(ids) = &ids {
                        ok &= ids[bi][ia] == ids[bi][j];
                    }
                    if !ok {
                        mask[(bi * tq + i) * tk + j] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, 1, tq, tk), q.device())?.to_dtype(acc)?;
        let s = s.broadcast_add(&mask)?;
        let pr = candle_nn::ops::softmax(&s, candle_core::D::Minus1)?;
        let _ = (p, DType::F32);
        let y = pr.to_dtype(dt)?.matmul(&v.contiguous()?)?;
        y.transpose(1, 2)?.reshape((b, tq, h * d))
    }

    /// Mean cross-entropy of `x [N, C] wᵀ` (`w [V, C]`) against `targets [N]`, ignoring
    /// `ignore`.
    pub fn linear_cross_entropy(self, x: &Tensor, w: &Tensor, targets: &Tensor, ignore: u32) -> R {
        let logits = self.linear(x, &w.t()?, None)?;
        let logits = logits.to_dtype(super::stat_dtype(logits.dtype()))?;
        self.cross_entropy_ignoring(&logits, targets, ignore)
    }
}
