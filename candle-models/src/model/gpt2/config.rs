//! GPT-2's hyper-parameters, validated, their Hugging Face `config.json` form, and what the
//! trainer derives from them before building anything (parameter count, initialisation,
//! activation memory, FLOPs).

use std::path::Path;

use super::super::params::init_values;
use candle_core::DType;
use candle_remat::{BlockCost, ChainCosts};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::super::{Builder, CheckpointTensor, Dims, Kernels, Model, ModelConfig, SpecialTokens};
use super::{Gpt, LN_EPS};
use crate::{Error, Result};

/// GPT-2's `<|endoftext|>`, its `bos_token_id` and `eos_token_id` (and `transformers`' default
/// for both when a GPT-2 `config.json` omits them).
pub(crate) const GPT2_ENDOFTEXT: u32 = 50256;

/// The shape of a GPT-2 style model.
///
/// Field names follow nanoGPT's `GPTConfig`; [`GptConfig::to_hf_json`] writes the same values
/// under Hugging Face's GPT-2 names (`n_positions`, `n_ctx`, `resid_pdrop`, ...).
///
/// ```
/// use candle_models::model::gpt2::GptConfig;
/// let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 32, block_size: 16, vocab_size: 50, ..GptConfig::default() };
/// cfg.validate().unwrap();
/// assert!(GptConfig { n_head: 3, ..cfg }.validate().is_err()); // 32 is not divisible by 3
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; must divide `n_embd`.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Maximum sequence length (number of learned positions).
    pub block_size: usize,
    /// Vocabulary size (rows of the token embedding, which the head shares).
    pub vocab_size: usize,
    /// Dropout probability used after embeddings, attention probabilities and residual branches.
    pub dropout: f32,
    /// Whether linear layers and LayerNorms have biases (GPT-2: true).
    pub bias: bool,
    /// Id of the vocabulary's beginning-of-text token, if it has one (GPT-2: 50256,
    /// `<|endoftext|>`); `bos_token_id` in `config.json`.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// Id of the vocabulary's end-of-text token, if it has one (GPT-2: 50256);
    /// `eos_token_id` in `config.json`.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
}

impl Default for GptConfig {
    /// A small model that learns the embedded addition task in a couple of minutes on a CPU.
    fn default() -> Self {
        GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            vocab_size: 16,
            dropout: 0.0,
            bias: true,
            bos_token_id: None,
            eos_token_id: None,
        }
    }
}

impl GptConfig {
    /// GPT-2 small (124M) as published by OpenAI.
    pub fn gpt2() -> Self {
        GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50257,
            dropout: 0.0,
            bias: true,
            bos_token_id: Some(GPT2_ENDOFTEXT),
            eos_token_id: Some(GPT2_ENDOFTEXT),
        }
    }

    /// A fresh config shaped by a run's settings (see [`Architecture::fresh`]): layers,
    /// heads, width, positions, vocabulary and biases from `dims` (GPT-2's MLP is always
    /// `4 C` and its head always tied), and `dropout`.
    ///
    /// [`Architecture::fresh`]: crate::model::Architecture::fresh
    pub fn fresh(dims: &Dims, dropout: f32) -> Self {
        GptConfig {
            n_layer: dims.layers,
            n_head: dims.heads,
            n_embd: dims.hidden,
            block_size: dims.positions,
            vocab_size: dims.vocab,
            dropout,
            bias: dims.bias,
            ..GptConfig::default()
        }
    }

    /// Checks that the values describe a model that can be built.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        if self.n_layer == 0 {
            return bad("n_layer must be at least 1".into());
        }
        if self.n_head == 0 || self.n_embd == 0 {
            return bad(format!(
                "n_head ({}) and n_embd ({}) must be positive",
                self.n_head, self.n_embd
            ));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "n_embd ({}) must be divisible by n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if self.block_size == 0 {
            return bad("block_size must be at least 1".into());
        }
        if self.vocab_size == 0 {
            return bad("vocab_size must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout ({}) must be in [0, 1)", self.dropout));
        }
        for (name, id) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= self.vocab_size) {
                return bad(format!(
                    "{name} {id} is outside the vocabulary of {} ids",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// Number of parameters (the tied head counted once).
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        let b = usize::from(self.bias);
        let ln = c + b * c;
        let block = 2 * ln + (c * 3 * c + b * 3 * c) + (c * c + b * c) // attention
            + (c * 4 * c + b * 4 * c) + (4 * c * c + b * c); // mlp
        self.vocab_size * c + self.block_size * c + l * block + ln
    }

    /// The Hugging Face GPT-2 `config.json` for this model.
    ///
    /// `bos_token_id` and `eos_token_id` are always written, as `null` when the vocabulary has
    /// no such token: `transformers`' `GPT2Config` defaults a missing one to GPT-2's 50256,
    /// which would name an arbitrary token (or none at all) of another vocabulary.
    pub fn to_hf_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "n_positions": self.block_size,
            "n_ctx": self.block_size,
            "n_inner": null,
            "vocab_size": self.vocab_size,
            "embd_pdrop": self.dropout,
            "attn_pdrop": self.dropout,
            "resid_pdrop": self.dropout,
            "layer_norm_epsilon": LN_EPS,
            "initializer_range": 0.02,
            "tie_word_embeddings": true,
            "scale_attn_weights": true,
            "bias": self.bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        })
    }

    /// Reads a Hugging Face GPT-2 `config.json` file (see [`GptConfig::from_hf_json`]).
    pub fn from_hf_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))?;
        Self::from_hf_json(&v, path)
    }

    /// Reads a Hugging Face GPT-2 `config.json` (as written by [`GptConfig::to_hf_json`] or by
    /// `transformers`; `path` names it in errors). Unsupported variants (other activations,
    /// `n_inner` != 4 * n_embd) are rejected with an error naming the file. A missing
    /// `bos_token_id` / `eos_token_id` means GPT-2's 50256 (as in `transformers`) when the
    /// vocabulary has that id; `null`, a list or an id outside the vocabulary is read as no
    /// such token.
    pub fn from_hf_json(v: &serde_json::Value, path: &Path) -> Result<Self> {
        let get = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| Error::checkpoint(path, format!("missing integer field `{k}`")))
        };
        if let Some(mt) = v.get("model_type").and_then(|x| x.as_str()) {
            if mt != "gpt2" {
                return Err(Error::checkpoint(
                    path,
                    format!("model_type is `{mt}`, only `gpt2` is supported"),
                ));
            }
        }
        if let Some(act) = v.get("activation_function").and_then(|x| x.as_str()) {
            if act != "gelu_new" && act != "gelu_pytorch_tanh" {
                return Err(Error::checkpoint(
                    path,
                    format!("activation_function `{act}` is not supported (gelu_new only)"),
                ));
            }
        }
        let n_embd = get("n_embd")?;
        if let Some(inner) = v.get("n_inner").and_then(|x| x.as_u64()) {
            if inner as usize != 4 * n_embd {
                return Err(Error::checkpoint(
                    path,
                    format!("n_inner {inner} != 4 * n_embd is not supported"),
                ));
            }
        }
        let dropout = v.get("resid_pdrop").and_then(|x| x.as_f64()).unwrap_or(0.0) as f32;
        let vocab_size = get("vocab_size")?;
        let token = |k: &str| -> Option<u32> {
            let id = match v.get(k) {
                None => Some(GPT2_ENDOFTEXT),
                Some(x) => x.as_u64().and_then(|x| u32::try_from(x).ok()),
            };
            id.filter(|&id| (id as usize) < vocab_size)
        };
        let cfg = GptConfig {
            n_layer: get("n_layer")?,
            n_head: get("n_head")?,
            n_embd,
            block_size: get("n_positions")?,
            vocab_size,
            dropout,
            bias: v.get("bias").and_then(|x| x.as_bool()).unwrap_or(true),
            bos_token_id: token("bos_token_id"),
            eos_token_id: token("eos_token_id"),
        };
        cfg.validate()
            .map_err(|e| Error::checkpoint(path, e.to_string()))?;
        Ok(cfg)
    }
}

impl ModelConfig for GptConfig {
    fn architecture(&self) -> &'static str {
        "gpt2"
    }

    fn validate(&self) -> Result<()> {
        GptConfig::validate(self)
    }

    fn dims(&self) -> Dims {
        Dims {
            layers: self.n_layer,
            hidden: self.n_embd,
            heads: self.n_head,
            kv_heads: self.n_head,
            head_dim: self.n_embd / self.n_head.max(1),
            mlp: 4 * self.n_embd,
            vocab: self.vocab_size,
            positions: self.block_size,
            tied: true,
            bias: self.bias,
        }
    }

    fn special_tokens(&self) -> SpecialTokens {
        SpecialTokens {
            bos: self.bos_token_id,
            eos: self.eos_token_id,
        }
    }

    fn with_run_settings(&self, dropout: f32, tokens: SpecialTokens) -> Box<dyn ModelConfig> {
        Box::new(GptConfig {
            dropout,
            bos_token_id: tokens.bos,
            eos_token_id: tokens.eos,
            ..self.clone()
        })
    }

    fn build(&self, b: &Builder) -> Result<Box<dyn Model>> {
        Ok(Box::new(Gpt::build(self, b)?))
    }

    /// GPT-2 initialisation: weights ~ N(0, 0.02), residual projections (`c_proj`) scaled by
    /// `1/sqrt(2 n_layer)`, biases 0, LayerNorm scales 1.
    fn init(&self, name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> Result<Vec<f32>> {
        let std = if name.ends_with("c_proj.weight") {
            0.02 / (2.0 * self.n_layer as f64).sqrt()
        } else {
            0.02
        };
        init_values(name, shape, name.contains(".ln_"), std as f32, rng)
    }

    fn num_params(&self) -> usize {
        GptConfig::num_params(self)
    }

    /// `6 N + 12 L H Q T` (PaLM appendix B; nanoGPT's `estimate_mfu`): `N` parameters
    /// excluding the position embeddings, plus the attention's `Q Kᵀ` and `P V` products over
    /// a context of `T`, with `L` layers, `H` heads of size `Q`.
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let (l, c, v) = (
            self.n_layer as f64,
            self.n_embd as f64,
            self.vocab_size as f64,
        );
        let per_block = 12.0 * c * c + if self.bias { 13.0 * c } else { 4.0 * c };
        let n = v * c + l * per_block + if self.bias { 2.0 * c } else { c };
        let (h, q, t) = (self.n_head as f64, c / self.n_head as f64, seq_len as f64);
        6.0 * n + 12.0 * l * h * q * t
    }

    /// Counted from the ops of a [`super::Block`]. Reference kernels: about 16 `[B, T, C]`
    /// tensors incl. the 4x MLP, and 3-4 `[B, H, T, T]` attention tensors (scores, mask-add
    /// and softmax in f32, a dropout mask). Fused kernels: about 14 `[B, T, C]` tensors
    /// (LayerNorm inputs and outputs, qkv, attention output, the MLP's pre- and post-GELU
    /// activations, residuals) plus the attention's log-sum-exp, `[B, H, T]` f32; dropout
    /// masks are regenerated, not stored. Compute is proportional to the block's FLOPs.
    fn chain_costs(&self, batch: usize, seq: usize, dtype: DType, kernels: Kernels) -> ChainCosts {
        let (b, t, c, h) = (
            batch as u64,
            seq as u64,
            self.n_embd as u64,
            self.n_head as u64,
        );
        let size = dtype.size_in_bytes() as u64;
        let btc = b * t * c * size;
        let act = match kernels {
            Kernels::Reference => {
                let att = b * h * t * t * 4; // scores, mask-add and softmax run in f32
                let dropout_att = if self.dropout > 0.0 {
                    b * h * t * t * size
                } else {
                    0
                };
                16 * btc + 3 * att + dropout_att
            }
            Kernels::Fused => 14 * btc + b * h * t * 4,
        };
        let flops = 24 * b * t * c * c + 4 * b * t * t * c;
        let block = BlockCost {
            act_bytes: act,
            out_bytes: btc,
            fwd_ns: flops / 1000 + 1,
        };
        ChainCosts::uniform(self.n_layer, block)
    }

    /// Names without the `transformer.` prefix (`GPT2Model` checkpoints, e.g.
    /// `openai-community/gpt2`) are accepted, the `attn.bias` / `attn.masked_bias` causal-mask
    /// buffers are skipped, and `lm_head.weight` is a copy of the tied embedding.
    fn checkpoint_tensor(&self, name: &str) -> CheckpointTensor {
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
            return CheckpointTensor::Buffer;
        }
        if name == "lm_head.weight" {
            return CheckpointTensor::TiedCopy("transformer.wte.weight".into());
        }
        match name.starts_with("transformer.") {
            true => CheckpointTensor::Param(name.to_string()),
            false => CheckpointTensor::Param(format!("transformer.{name}")),
        }
    }

    fn to_hf_json(&self) -> serde_json::Value {
        GptConfig::to_hf_json(self)
    }

    fn describe(&self) -> String {
        format!(
            "gpt2, {} layers x {} wide, {} heads",
            self.n_layer, self.n_embd, self.n_head
        )
    }
}
