//! Gemma 3, text only (`Gemma3ForCausalLM`, `model_type` `gemma3_text`: Gemma 3 270M and 1B),
//! written over the shared layers ([`super::layers`]) with Gemma's options:
//!
//! ```text
//! x = embed(ids) * sqrt(hidden)                      (the factor in the compute dtype)
//! h = x + rms(o_proj(attention(rope(rms(q_proj(rms(x)))), rope(rms(k_proj(rms(x)))), v_proj(rms(x)))))
//! y = h + rms(down_proj(gelu_tanh(gate_proj(rms(h))) * up_proj(rms(h))))
//! ```
//!
//! Every RMSNorm scales by `1 + w` in f32; scores are scaled by `query_pre_attn_scalar^-0.5`;
//! each layer is sliding (within `sliding_window`, the local RoPE base) or full (the global
//! base and scaling) by `layer_types`; the head is tied by default and its loss chunked.
//! `final_logit_softcapping`, where a config sets it, makes the loss take the whole logits
//! (the chunked cross-entropy has no soft-cap; Gemma 3's released configs set none);
//! `attn_logit_softcapping` is read and kept but not applied, as transformers'
//! `Gemma3Attention` does not apply it. Head size 256: on CUDA the
//! Triton attention kernels cover `D <= 128`, so Gemma's attention runs `candle_fused`'s
//! composite fallback there (the CPU kernel takes any size). `use_bidirectional_attention` is
//! refused. Parameter names are transformers', so checkpoints load as they are and LoRA
//! targets the same projections as in the Llama family.

mod config;
mod hf_json;

use std::path::Path;

use serde_json::Value;

pub use config::{Gemma3Config, LayerType};

use super::layers::head::{Head, LmHead, Norm};
use super::layers::{Block, Decoder, Embed, RmsNorm};
use super::{Architecture, Builder, Dims, ModelConfig};
use crate::Result;

/// `config.json`'s `model_type`.
pub(crate) const MODEL_TYPE: &str = "gemma3_text";
/// The transformers class.
pub(crate) const CLASS: &str = "Gemma3ForCausalLM";

/// Gemma 3 (text) as an [`Architecture`].
pub(crate) struct Gemma3Arch;

impl Architecture for Gemma3Arch {
    fn name(&self) -> &'static str {
        MODEL_TYPE
    }

    fn class(&self) -> &'static str {
        CLASS
    }

    fn config_from_hf_json(&self, json: &Value, path: &Path) -> Result<Box<dyn ModelConfig>> {
        Ok(Box::new(Gemma3Config::from_hf_json(json, path)?))
    }

    fn fresh(&self, dims: &Dims, dropout: f32, rope_theta: f64) -> Result<Box<dyn ModelConfig>> {
        Ok(Box::new(Gemma3Config::fresh(dims, dropout, rope_theta)))
    }
}

/// A Gemma 3 causal language model (text).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_models::model::gemma3::Gemma3Config;
/// use candle_models::model::{self, Ctx};
/// let cfg = Gemma3Config::new(50, 2, 16, 4, 2, 24);
/// let (model, params) = model::init(&cfg, 42, &Device::Cpu)?;
/// let idx = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
/// let loss = model.loss(&idx, &idx, &Ctx::train(7))?;
/// let grads = loss.mean.backward()?;
/// assert!(params.iter().all(|(_, v)| grads.get(v).is_some()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type Gemma3 = Decoder<Gemma3Config, Embed, Block>;

impl Gemma3 {
    /// The structure over tensors taken from `b` by their transformers names.
    pub fn build(config: &Gemma3Config, b: &Builder) -> Result<Self> {
        let (v, c) = (config.vocab_size, config.hidden_size);
        let m = b.pp("model");
        let embed = Embed::build(&m.pp("embed_tokens"), v, c)?.with_scale(Some((c as f64).sqrt()));
        let blocks = Block::stack(&m, config.num_hidden_layers, |i| config.block_options(i))?;
        let lm_head = LmHead::build(b, &embed, config.tie_word_embeddings)?;
        let norm = RmsNorm::build(&m.pp("norm"), c, config.rms_norm_eps)?.with_unit_offset(true);
        let head = Head::new(Norm::Rms(norm), lm_head).with_softcap(config.final_logit_softcapping);
        Ok(Decoder {
            config: config.clone(),
            embed,
            blocks,
            head,
        })
    }
}
