//! Gemma 3's hyper-parameters ([`Gemma3Config`], named as in its `config.json`) and what the
//! trainer derives from them before building anything. Their `config.json` form is in
//! `hf_json.rs`.

use candle_core::DType;
use candle_remat::ChainCosts;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use super::super::layers::{hf_decoder, BlockOptions, GateAct, RopeScaling};
use super::super::params::init_values;
use super::super::{Builder, CheckpointTensor, Dims, Kernels, Model, ModelConfig, SpecialTokens};
use super::Gemma3;
use crate::{Error, Result};

/// The attention of one layer (`layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// `sliding_attention`: within `sliding_window` tokens, the local RoPE base.
    Sliding,
    /// `full_attention`: causal over the whole context, the global RoPE base and scaling.
    Full,
}

/// The shape and options of a `Gemma3ForCausalLM` (text), named as in its `config.json`.
///
/// ```
/// use candle_models::model::gemma3::Gemma3Config;
/// let cfg = Gemma3Config::new(300, 3, 32, 4, 2, 48);
/// cfg.validate().unwrap();
/// assert_eq!(cfg.head_dim, 8);
/// assert!(Gemma3Config { sliding_window: 0, ..cfg }.validate().is_err());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    /// Rows of the token embedding.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the gated MLP.
    pub intermediate_size: usize,
    /// Number of blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Width of a head (256 in the released models).
    pub head_dim: usize,
    /// Longest context the rotary tables are meant for.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// The MLP gate's activation (`hidden_activation`: `gelu_pytorch_tanh`).
    pub hidden_activation: GateAct,
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: usize,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// Each layer's attention.
    pub layer_types: Vec<LayerType>,
    /// RoPE base of the full layers.
    pub rope_theta: f64,
    /// RoPE scaling of the full layers.
    pub rope_scaling: RopeScaling,
    /// RoPE base of the sliding layers.
    pub rope_local_base_freq: f64,
    /// RoPE scaling of the sliding layers (`rope_parameters.sliding_attention`).
    pub local_rope_scaling: RopeScaling,
    /// Biases on q, k, v and o.
    pub attention_bias: bool,
    /// Soft-cap of the attention scores: read and written back, but not applied, as
    /// transformers' `Gemma3Attention` does not apply it (Gemma 3 replaced Gemma 2's soft-cap
    /// by the q/k norms; `None` in the released configs).
    pub attn_logit_softcapping: Option<f64>,
    /// Soft-cap of the logits (`None` in Gemma 3's released configs).
    pub final_logit_softcapping: Option<f64>,
    /// Whether the head reads the token embedding.
    pub tie_word_embeddings: bool,
    /// Dropout on the attention probabilities.
    pub attention_dropout: f32,
    /// Std of the initial weights.
    pub initializer_range: f64,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (one or a list).
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id` (its embedding row starts at zero).
    pub pad_token_id: Option<u32>,
    /// The dtype the source stored its weights in, for export.
    pub torch_dtype: Option<String>,
}

impl Gemma3Config {
    /// A config with transformers' defaults for everything but the shape (`head_dim = hidden
    /// / heads`, every 6th layer full, window 512, RoPE bases 1e6 / 1e4, tied, scores scaled by
    /// `head_dim^-0.5`).
    pub fn new(
        vocab_size: usize,
        num_hidden_layers: usize,
        hidden_size: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
        intermediate_size: usize,
    ) -> Self {
        let head_dim = hidden_size / num_attention_heads.max(1);
        Gemma3Config {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            hidden_activation: GateAct::GeluTanh,
            query_pre_attn_scalar: head_dim,
            sliding_window: 512,
            layer_types: Self::pattern(num_hidden_layers, 6),
            rope_theta: 1e6,
            rope_scaling: RopeScaling::None,
            rope_local_base_freq: 1e4,
            local_rope_scaling: RopeScaling::None,
            attention_bias: false,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            tie_word_embeddings: true,
            attention_dropout: 0.0,
            initializer_range: 0.02,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            pad_token_id: None,
            torch_dtype: None,
        }
    }

    /// transformers' layer types from `sliding_window_pattern`: layer `i` is full iff `(i + 1)`
    /// is a multiple of `pattern`.
    pub(crate) fn pattern(layers: usize, pattern: usize) -> Vec<LayerType> {
        (0..layers)
            .map(|i| match (i + 1) % pattern.max(1) {
                0 => LayerType::Full,
                _ => LayerType::Sliding,
            })
            .collect()
    }

    /// A fresh config shaped by a run's settings (see `Architecture::fresh`): `dims.mlp` 0
    /// means `8 C / 3` rounded up to 64, `dims.kv_heads` 0 one per head, `dims.head_dim` 0
    /// `C / heads`; the run's RoPE base is the full layers'.
    pub(crate) fn fresh(dims: &Dims, dropout: f32, rope_theta: f64) -> Self {
        let (kv, mlp) = hf_decoder::fresh_widths(dims);
        let mut cfg = Gemma3Config::new(dims.vocab, dims.layers, dims.hidden, dims.heads, kv, mlp);
        if dims.head_dim != 0 {
            cfg.head_dim = dims.head_dim;
            cfg.query_pre_attn_scalar = dims.head_dim;
        }
        cfg.max_position_embeddings = dims.positions;
        cfg.rope_theta = rope_theta;
        cfg.tie_word_embeddings = dims.tied;
        cfg.attention_bias = dims.bias;
        cfg.attention_dropout = dropout;
        cfg
    }

    /// The shared layers' options for block `i`: its window and RoPE by its layer type.
    pub(crate) fn block_options(&self, i: usize) -> BlockOptions {
        let (window, theta, scaling) = match self.layer_types[i] {
            LayerType::Sliding => (
                Some(self.sliding_window),
                self.rope_local_base_freq,
                &self.local_rope_scaling,
            ),
            LayerType::Full => (None, self.rope_theta, &self.rope_scaling),
        };
        let b = self.attention_bias;
        BlockOptions {
            dims: self.dims(),
            biases: (b, b, false),
            qk_norm: true,
            window,
            norm_eps: self.rms_norm_eps,
            inv_freq: scaling.inv_freq(theta, self.head_dim),
            dropout: self.attention_dropout,
            norm_unit_offset: true,
            sandwich_norms: true,
            act: self.hidden_activation,
            attn_scale: Some((self.query_pre_attn_scalar as f64).powf(-0.5)),
        }
    }

    /// Checks that the values describe a model that can be built.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        let tokens = self.bos_token_id.iter().chain(&self.eos_token_ids);
        hf_decoder::check_dims(&ModelConfig::dims(self), tokens.chain(&self.pad_token_id))?;
        if self.layer_types.len() != self.num_hidden_layers {
            return bad(format!(
                "{} layer types for {} layers",
                self.layer_types.len(),
                self.num_hidden_layers
            ));
        }
        let sizes = [
            ("sliding_window", self.sliding_window),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} must be at least 1"));
        }
        let positive = [
            ("rope_theta", Some(self.rope_theta)),
            ("rope_local_base_freq", Some(self.rope_local_base_freq)),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ];
        for (name, v) in positive {
            if v.is_some_and(|v| v.is_nan() || v <= 0.0) {
                return bad(format!("{name} ({v:?}) must be > 0"));
            }
        }
        if !(self.rms_norm_eps >= 0.0 && (0.0..1.0).contains(&self.attention_dropout)) {
            return bad(format!(
                "rms_norm_eps ({}) must be >= 0 and attention_dropout ({}) in [0, 1)",
                self.rms_norm_eps, self.attention_dropout
            ));
        }
        self.rope_scaling.validate()?;
        self.local_rope_scaling.validate()
    }
}

impl ModelConfig for Gemma3Config {
    fn architecture(&self) -> &'static str {
        super::MODEL_TYPE
    }

    fn validate(&self) -> Result<()> {
        Gemma3Config::validate(self)
    }

    fn dims(&self) -> Dims {
        let (layers, hidden, mlp) = (
            self.num_hidden_layers,
            self.hidden_size,
            self.intermediate_size,
        );
        let (heads, kv_heads) = (self.num_attention_heads, self.num_key_value_heads);
        let (vocab, positions) = (self.vocab_size, self.max_position_embeddings);
        let (tied, bias) = (self.tie_word_embeddings, self.attention_bias);
        let head_dim = self.head_dim;
        Dims {
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            mlp,
            vocab,
            positions,
            tied,
            bias,
        }
    }

    fn special_tokens(&self) -> SpecialTokens {
        hf_decoder::special_tokens(self.bos_token_id, &self.eos_token_ids)
    }

    fn build(&self, b: &Builder) -> Result<Box<dyn Model>> {
        Ok(Box::new(Gemma3::build(self, b)?))
    }

    fn with_run_settings(&self, dropout: f32, tokens: SpecialTokens) -> Box<dyn ModelConfig> {
        Box::new(Gemma3Config {
            attention_dropout: dropout,
            bos_token_id: tokens.bos,
            eos_token_ids: hf_decoder::run_eos_ids(&self.eos_token_ids, tokens),
            ..self.clone()
        })
    }

    /// transformers' initialisation: weights ~ N(0, initializer_range), biases 0, norm
    /// weights 0 (they scale by `1 + w`), the padding token's embedding row 0.
    fn init(&self, name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> Result<Vec<f32>> {
        let n: usize = shape.iter().product();
        if name.ends_with("norm.weight") {
            return Ok(vec![0.0; n]);
        }
        let mut v = init_values(name, shape, false, self.initializer_range as f32, rng)?;
        if let (Some(pad), "model.embed_tokens.weight") = (self.pad_token_id, name) {
            let c = self.hidden_size;
            let row = pad as usize * c;
            v[row..row + c].fill(0.0);
        }
        Ok(v)
    }

    /// As for the Llama family: `lm_head.weight` a copy of the embedding when tied.
    fn checkpoint_tensor(&self, name: &str) -> CheckpointTensor {
        hf_decoder::checkpoint_tensor(name, self.tie_word_embeddings)
    }

    fn to_hf_json(&self) -> Value {
        Gemma3Config::to_hf_json(self)
    }

    /// `6 N + 12 L H D T` as for the Llama family, the context of a sliding layer being its
    /// window.
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let context = |t: &LayerType| match t {
            LayerType::Sliding => self.sliding_window.min(seq_len),
            LayerType::Full => seq_len,
        };
        let contexts: Vec<usize> = self.layer_types.iter().map(context).collect();
        hf_decoder::flops_per_token(self.num_params(), &self.dims(), &contexts)
    }

    /// The Llama family's count with Gemma's two extra norms' outputs (8 `[B, T, C]`) and the
    /// GeGLU's composite intermediate (4 `[B, T, I]`).
    fn chain_costs(&self, batch: usize, seq: usize, dtype: DType, kernels: Kernels) -> ChainCosts {
        hf_decoder::chain_costs(&self.dims(), (batch, seq), (8, 4), dtype, kernels)
    }

    fn describe(&self) -> String {
        let full = self
            .layer_types
            .iter()
            .filter(|t| **t == LayerType::Full)
            .count();
        format!(
            "{}, {} layers x {} wide ({full} full, window {}), {} heads / {} kv heads of {}, \
             mlp {}{}",
            super::MODEL_TYPE,
            self.num_hidden_layers,
            self.hidden_size,
            self.sliding_window,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
            if self.tie_word_embeddings {
                ", tied"
            } else {
                ""
            },
        )
    }
}
