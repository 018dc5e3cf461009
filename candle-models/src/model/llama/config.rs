//! The Llama family's hyper-parameters: one [`LlamaConfig`] for `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`, which differ only in
//! flags (biases, q/k norms, sliding windows), and what the trainer derives from them before
//! building anything (parameter count, initialisation, activation memory, FLOPs). Their
//! `config.json` form is in `hf_json.rs`.

use candle_core::DType;
use candle_remat::ChainCosts;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use super::super::layers::{hf_decoder, BlockOptions, GateAct};
use super::super::params::init_values;
use super::super::{Builder, CheckpointTensor, Dims, Kernels, Model, ModelConfig, SpecialTokens};
use super::{Llama, RopeScaling};
use crate::{Error, Result};

/// Which member of the family a config describes (its `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `llama` (Llama 2/3.x, SmolLM2, TinyLlama): optional `attention_bias` (q, k, v, o) and
    /// `mlp_bias`.
    Llama,
    /// `mistral`: no biases; sliding-window attention when `sliding_window` is set.
    Mistral,
    /// `qwen2` (Qwen2, Qwen2.5): q, k, v biases always (no o bias).
    Qwen2,
    /// `qwen3`: RMSNorm of q and k per head before RoPE; `head_dim` defaults to 128.
    Qwen3,
}

impl Family {
    /// Every member, in `model_type` order of the trainer's registry.
    pub const ALL: [Family; 4] = [Family::Llama, Family::Mistral, Family::Qwen2, Family::Qwen3];

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    /// The transformers class (`architectures[0]`).
    pub fn class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// Which projections have biases, `(q/k/v, o, mlp)`, given `attention_bias` and `mlp_bias`
    /// (`mlp_bias` is Llama's alone): Qwen2 has q/k/v biases always, Mistral none.
    pub(crate) fn biases(self, attention_bias: bool, mlp_bias: bool) -> (bool, bool, bool) {
        match self {
            Family::Llama => (attention_bias, attention_bias, mlp_bias),
            Family::Qwen3 => (attention_bias, attention_bias, false),
            Family::Qwen2 => (true, false, false),
            Family::Mistral => (false, false, false),
        }
    }

    /// The member whose `model_type` or class is `name`.
    pub fn from_name(name: &str) -> Option<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.model_type() == name || f.class() == name)
    }
}

/// The shape and options of a Llama-family model, named as in its `config.json`.
///
/// ```
/// use candle_models::model::llama::{Family, LlamaConfig};
/// let cfg = LlamaConfig::new(Family::Llama, 300, 2, 32, 4, 2, 48);
/// cfg.validate().unwrap();
/// assert_eq!(cfg.head_dim, 8);
/// assert!(LlamaConfig { num_key_value_heads: 3, ..cfg }.validate().is_err()); // 4 % 3 != 0
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which member of the family (biases, q/k norm, windows follow from it and the flags).
    pub family: Family,
    /// Rows of the token embedding.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; each serves `num_attention_heads / num_key_value_heads` consecutive
    /// query heads.
    pub num_key_value_heads: usize,
    /// Width of a head (`hidden_size / num_attention_heads` unless given).
    pub head_dim: usize,
    /// Longest context the rotary tables are meant for.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Biases on the MLP's projections.
    pub mlp_bias: bool,
    /// RMSNorm of q and k per head (Qwen3).
    pub qk_norm: bool,
    /// Whether the head reads the token embedding (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Sliding-window size of each layer's attention (`None`: full causal).
    pub layer_windows: Vec<Option<usize>>,
    /// Dropout on the attention probabilities (`attention_dropout`).
    pub attention_dropout: f32,
    /// Std of the initial weights.
    pub initializer_range: f64,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (a list for instruction-tuned Llama 3).
    pub eos_token_ids: Vec<u32>,
    /// The dtype the source stored its weights in (`torch_dtype` / `dtype`), for export.
    pub torch_dtype: Option<String>,
}

impl LlamaConfig {
    /// A config of `family` with transformers' defaults for everything but the shape
    /// (`head_dim = hidden / heads`, RoPE base 10000, eps 1e-5, untied, 2048 positions).
    pub fn new(
        family: Family,
        vocab_size: usize,
        num_hidden_layers: usize,
        hidden_size: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
        intermediate_size: usize,
    ) -> Self {
        LlamaConfig {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: hidden_size / num_attention_heads.max(1),
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            qkv_bias: family == Family::Qwen2,
            o_bias: false,
            mlp_bias: false,
            qk_norm: family == Family::Qwen3,
            tie_word_embeddings: false,
            layer_windows: vec![None; num_hidden_layers],
            attention_dropout: 0.0,
            initializer_range: 0.02,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            torch_dtype: None,
        }
    }

    /// A fresh config of `family` shaped by a run's settings (see [`Architecture::fresh`]):
    /// `dims.kv_heads` 0 means one per head, `dims.mlp` 0 the SwiGLU width `8 C / 3` rounded
    /// up to a multiple of 64, `dims.head_dim` 0 `C / heads`; `dims.bias` sets the biases the
    /// member has options for.
    ///
    /// [`Architecture::fresh`]: crate::model::Architecture::fresh
    pub(crate) fn fresh(family: Family, dims: &Dims, dropout: f32, rope_theta: f64) -> Self {
        let (kv, mlp) = hf_decoder::fresh_widths(dims);
        let (l, c, h) = (dims.layers, dims.hidden, dims.heads);
        let mut cfg = LlamaConfig::new(family, dims.vocab, l, c, h, kv, mlp);
        if dims.head_dim != 0 {
            cfg.head_dim = dims.head_dim;
        }
        cfg.max_position_embeddings = dims.positions;
        cfg.rope_theta = rope_theta;
        cfg.tie_word_embeddings = dims.tied;
        cfg.attention_dropout = dropout;
        (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) = family.biases(dims.bias, dims.bias);
        cfg
    }

    /// The shared layers' options for block `i` (its attention window is the layer's).
    pub(crate) fn block_options(&self, i: usize) -> BlockOptions {
        BlockOptions {
            dims: self.dims(),
            biases: (self.qkv_bias, self.o_bias, self.mlp_bias),
            qk_norm: self.qk_norm,
            window: self.layer_windows[i],
            norm_eps: self.rms_norm_eps,
            inv_freq: self.rope_scaling.inv_freq(self.rope_theta, self.head_dim),
            dropout: self.attention_dropout,
            norm_unit_offset: false,
            sandwich_norms: false,
            act: GateAct::Silu,
            attn_scale: None,
        }
    }

    /// Query heads per key/value head.
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads.max(1)
    }

    /// Checks that the values describe a model that can be built.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        let tokens = self.bos_token_id.iter().chain(&self.eos_token_ids);
        hf_decoder::check_dims(&ModelConfig::dims(self), tokens)?;
        if self.layer_windows.len() != self.num_hidden_layers {
            return bad(format!(
                "{} layer windows for {} layers",
                self.layer_windows.len(),
                self.num_hidden_layers
            ));
        }
        if self.layer_windows.contains(&Some(0)) {
            return bad("sliding_window must be at least 1".into());
        }
        if !(self.rms_norm_eps >= 0.0 && self.rope_theta > 0.0) {
            return bad(format!(
                "rms_norm_eps ({}) must be >= 0 and rope_theta ({}) > 0",
                self.rms_norm_eps, self.rope_theta
            ));
        }
        if !(0.0..1.0).contains(&self.attention_dropout) {
            return bad(format!(
                "attention_dropout ({}) must be in [0, 1)",
                self.attention_dropout
            ));
        }
        self.rope_scaling.validate()
    }
}

impl ModelConfig for LlamaConfig {
    fn architecture(&self) -> &'static str {
        self.family.model_type()
    }

    fn validate(&self) -> Result<()> {
        LlamaConfig::validate(self)
    }

    /// The run records `bias` as the q/k/v projections' biases.
    fn dims(&self) -> Dims {
        Dims {
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            mlp: self.intermediate_size,
            vocab: self.vocab_size,
            positions: self.max_position_embeddings,
            tied: self.tie_word_embeddings,
            bias: self.qkv_bias,
        }
    }

    fn special_tokens(&self) -> SpecialTokens {
        hf_decoder::special_tokens(self.bos_token_id, &self.eos_token_ids)
    }

    fn with_run_settings(&self, dropout: f32, tokens: SpecialTokens) -> Box<dyn ModelConfig> {
        Box::new(LlamaConfig {
            attention_dropout: dropout,
            bos_token_id: tokens.bos,
            eos_token_ids: hf_decoder::run_eos_ids(&self.eos_token_ids, tokens),
            ..self.clone()
        })
    }

    fn build(&self, b: &Builder) -> Result<Box<dyn Model>> {
        Ok(Box::new(Llama::build(self, b)?))
    }

    /// transformers' initialisation: weights and embeddings ~ N(0, initializer_range),
    /// biases 0, norm scales 1.
    fn init(&self, name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> Result<Vec<f32>> {
        let scale = name.ends_with("norm.weight");
        init_values(name, shape, scale, self.initializer_range as f32, rng)
    }

    /// `6 N + 12 L H D T`: `N` the parameters that multiply (the embedding lookup excluded
    /// unless it is also the head), plus the attention's `Q Kᵀ` and `P V` over a context of
    /// `T` (PaLM appendix B).
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let window = |w: &Option<usize>| w.map_or(seq_len, |w| w.min(seq_len));
        let contexts: Vec<usize> = self.layer_windows.iter().map(window).collect();
        hf_decoder::flops_per_token(self.num_params(), &self.dims(), &contexts)
    }

    /// Counted from the ops of a [`Block`](crate::model::layers::Block): the tensors its backward keeps. Fused kernels:
    /// about 6 `[B, T, C]` (the input, two norms' outputs, the residual, the attention and
    /// MLP outputs), the projections q, k, v and their rotated copies, the attention output,
    /// 3 `[B, T, I]` (gate, up, their SwiGLU) and the attention's `[B, H, T]` log-sum-exp.
    /// Reference kernels add the `[B, H, T, T]` scores, mask and probabilities in f32.
    fn chain_costs(&self, batch: usize, seq: usize, dtype: DType, kernels: Kernels) -> ChainCosts {
        hf_decoder::chain_costs(&self.dims(), (batch, seq), (6, 3), dtype, kernels)
    }

    /// A tied checkpoint has no `lm_head.weight` (one equal to the embedding is accepted as a
    /// copy); rotary `inv_freq` buffers are skipped.
    fn checkpoint_tensor(&self, name: &str) -> CheckpointTensor {
        hf_decoder::checkpoint_tensor(name, self.tie_word_embeddings)
    }

    fn to_hf_json(&self) -> Value {
        LlamaConfig::to_hf_json(self)
    }

    fn describe(&self) -> String {
        let window = match self.layer_windows.iter().flatten().next() {
            Some(w) => format!(", window {w}"),
            None => String::new(),
        };
        format!(
            "{}, {} layers x {} wide, {} heads / {} kv heads of {}, mlp {}{}{window}",
            self.family.model_type(),
            self.num_hidden_layers,
            self.hidden_size,
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
