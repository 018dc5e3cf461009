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
//! built from the shared layers ([`super::layers`]): the members differ only in their config
//! (biases, q/k norms, sliding windows), which this module reads and writes.

mod config;
pub(crate) mod hf_json;

use std::path::Path;

use serde_json::Value;

pub use super::layers::RopeScaling;
pub use config::{Family, LlamaConfig};

use super::layers::head::{Head, LmHead, Norm};
use super::layers::{Block, Decoder, Embed, RmsNorm};
use super::{Architecture, Builder, Dims, ModelConfig};
use crate::Result;

/// A member of the family as an [`Architecture`] (recognised by its `model_type`).
pub(crate) struct LlamaArch(pub(crate) Family);

/// `llama`.
pub(crate) static LLAMA: LlamaArch = LlamaArch(Family::Llama);
/// `mistral`.
pub(crate) static MISTRAL: LlamaArch = LlamaArch(Family::Mistral);
/// `qwen2`.
pub(crate) static QWEN2: LlamaArch = LlamaArch(Family::Qwen2);
/// `qwen3`.
pub(crate) static QWEN3: LlamaArch = LlamaArch(Family::Qwen3);

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

    fn fresh(&self, dims: &Dims, dropout: f32, rope_theta: f64) -> Result<Box<dyn ModelConfig>> {
        Ok(Box::new(LlamaConfig::fresh(
            self.0, dims, dropout, rope_theta,
        )))
    }
}

/// A Llama-family causal language model.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_models::model::llama::{Family, LlamaConfig};
/// use candle_models::model::{self, Ctx};
/// let cfg = LlamaConfig::new(Family::Llama, 50, 2, 16, 4, 2, 24);
/// let (model, params) = model::init(&cfg, 42, &Device::Cpu)?;
/// let idx = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
/// let loss = model.loss(&idx, &idx, &Ctx::train(7))?;
/// let grads = loss.mean.backward()?;
/// assert!(params.iter().all(|(_, v)| grads.get(v).is_some()));
/// assert_eq!(model.links().len(), 4); // embedding, 2 blocks, head
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type Llama = Decoder<LlamaConfig, Embed, Block>;

impl Llama {
    /// The structure over tensors taken from `b` by their transformers names.
    pub fn build(config: &LlamaConfig, b: &Builder) -> Result<Self> {
        let (v, c) = (config.vocab_size, config.hidden_size);
        let m = b.pp("model");
        let embed = Embed::build(&m.pp("embed_tokens"), v, c)?;
        let blocks = Block::stack(&m, config.num_hidden_layers, |i| config.block_options(i))?;
        let lm_head = LmHead::build(b, &embed, config.tie_word_embeddings)?;
        let norm = RmsNorm::build(&m.pp("norm"), c, config.rms_norm_eps)?;
        Ok(Decoder {
            config: config.clone(),
            embed,
            blocks,
            head: Head::new(Norm::Rms(norm), lm_head),
        })
    }
}

#[cfg(test)]
mod tests;
