//! What the transformers-style decoders over these layers (the Llama family, Gemma 3) derive
//! alike from their dimensions: the checks of a `config.json`'s shape, the run's end-of-text
//! ids, FLOPs, activation memory and the reading of checkpoint tensor names.

use candle_core::DType;
use candle_remat::{BlockCost, ChainCosts};

use super::super::{CheckpointTensor, Dims, Kernels, SpecialTokens};
use crate::{Error, Result};

/// Checks a decoder's dimensions, naming its `config.json` keys: every size at least 1, query
/// heads a multiple of key/value heads, an even head width (rotary embeddings), and the
/// special token ids `tokens` within the vocabulary.
pub(crate) fn check_dims<'a>(d: &Dims, tokens: impl IntoIterator<Item = &'a u32>) -> Result<()> {
    let bad = |msg: String| Err(Error::Config(msg));
    for (name, v) in [
        ("vocab_size", d.vocab),
        ("hidden_size", d.hidden),
        ("intermediate_size", d.mlp),
        ("num_hidden_layers", d.layers),
        ("num_attention_heads", d.heads),
        ("num_key_value_heads", d.kv_heads),
        ("head_dim", d.head_dim),
        ("max_position_embeddings", d.positions),
    ] {
        if v == 0 {
            return bad(format!("{name} must be at least 1"));
        }
    }
    if !d.heads.is_multiple_of(d.kv_heads) {
        return bad(format!(
            "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
            d.heads, d.kv_heads
        ));
    }
    if !d.head_dim.is_multiple_of(2) {
        return bad(format!(
            "head_dim ({}) must be even for rotary embeddings",
            d.head_dim
        ));
    }
    for id in tokens {
        if *id as usize >= d.vocab {
            return bad(format!(
                "special token id {id} is outside the vocabulary of {} ids",
                d.vocab
            ));
        }
    }
    Ok(())
}

/// A fresh model's key/value heads and MLP width from a run's `dims`: 0 key/value heads means
/// one per head, an MLP width of 0 the SwiGLU default `8 C / 3` rounded up to a multiple of 64.
pub(crate) fn fresh_widths(dims: &Dims) -> (usize, usize) {
    let kv = match dims.kv_heads {
        0 => dims.heads,
        n => n,
    };
    let mlp = match dims.mlp {
        0 => (8 * dims.hidden / 3).div_ceil(64) * 64,
        n => n,
    };
    (kv, mlp)
}

/// The end-of-text ids after a run's settings: the config's list when it holds the run's
/// `eos`, else that one id (none without one).
pub(crate) fn run_eos_ids(ids: &[u32], tokens: SpecialTokens) -> Vec<u32> {
    match tokens.eos {
        Some(e) if ids.contains(&e) => ids.to_vec(),
        Some(e) => vec![e],
        None => Vec::new(),
    }
}

/// The special tokens of `bos` and the first of `eos`.
pub(crate) fn special_tokens(bos: Option<u32>, eos: &[u32]) -> SpecialTokens {
    SpecialTokens {
        bos,
        eos: eos.first().copied(),
    }
}

/// `6 N + 12 L H D T`: `n_params` the parameters that multiply (the embedding lookup excluded
/// unless it is also the head), plus the attention's `Q Kᵀ` and `P V`, each layer over its
/// own context (`contexts`, one per layer: the sequence, or a sliding window within it; PaLM
/// appendix B).
pub(crate) fn flops_per_token(n_params: usize, d: &Dims, contexts: &[usize]) -> f64 {
    let mut n = n_params as f64;
    if !d.tied {
        n -= (d.vocab * d.hidden) as f64;
    }
    let (l, h, hd) = (d.layers as f64, d.heads as f64, d.head_dim as f64);
    let ctx = contexts.iter().map(|&c| c as f64).sum::<f64>() / l.max(1.0);
    6.0 * n + 12.0 * l * h * hd * ctx
}

/// Activation memory and compute of `d.layers` uniform blocks for `batch` rows of `seq`
/// tokens: with the fused kernels `btc` tensors `[B, T, C]` and `bti` `[B, T, I]` per block,
/// the projections q, k, v and their rotated copies, the attention output and its
/// log-sum-exp; the reference kernels add the `[B, H, T, T]` scores, mask and probabilities
/// in f32 and the unrotated q, k, v.
pub(crate) fn chain_costs(
    d: &Dims,
    (batch, seq): (usize, usize),
    (btc, bti): (u64, u64),
    dtype: DType,
    kernels: Kernels,
) -> ChainCosts {
    let (b, t) = (batch as u64, seq as u64);
    let (c, i) = (d.hidden as u64, d.mlp as u64);
    let (h, kv, hd) = (d.heads as u64, d.kv_heads as u64, d.head_dim as u64);
    let size = dtype.size_in_bytes() as u64;
    let one_btc = b * t * c * size;
    let qkv = b * t * (h + 2 * kv) * hd * size;
    let fused =
        btc * one_btc + 2 * qkv + b * t * h * hd * size + bti * b * t * i * size + b * h * t * 4;
    let act = match kernels {
        Kernels::Fused => fused,
        Kernels::Reference => fused + qkv + 4 * b * h * t * t * 4,
    };
    let flops =
        2 * b * t * (c * (h + 2 * kv) * hd + h * hd * c + 3 * c * i) + 4 * b * t * t * h * hd;
    ChainCosts::uniform(
        d.layers,
        BlockCost {
            act_bytes: act,
            out_bytes: one_btc,
            fwd_ns: flops / 1000 + 1,
        },
    )
}

/// A checkpoint tensor of a transformers decoder: rotary buffers skipped; with a tied head
/// `lm_head.weight` is a copy of the embedding (accepted if equal).
pub(crate) fn checkpoint_tensor(name: &str, tied: bool) -> CheckpointTensor {
    if name.contains("rotary_emb.") && name.ends_with("inv_freq") {
        return CheckpointTensor::Buffer;
    }
    if tied && name == "lm_head.weight" {
        return CheckpointTensor::TiedCopy("model.embed_tokens.weight".into());
    }
    CheckpointTensor::Param(name.to_string())
}
