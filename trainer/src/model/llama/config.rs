//! The Llama family's hyper-parameters: one [`LlamaConfig`] for `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`, which differ only in
//! flags (biases, q/k norms, sliding windows), read from a Hugging Face `config.json` in the
//! transformers 4.x layout (top-level `rope_theta` / `rope_scaling`, `torch_dtype`) or the
//! 5.x one (`rope_parameters`, `dtype`), and written in the 4.x layout, which both read.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::rope::RopeScaling;
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
/// use trainer::model::llama::{Family, LlamaConfig};
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

    /// Query heads per key/value head.
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads.max(1)
    }

    /// Checks that the values describe a model that can be built.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim
            ));
        }
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
        self.rope_scaling.validate()?;
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                return bad(format!(
                    "special token id {id} is outside the vocabulary of {} ids",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json` of the family (`path` names it in errors): the 4.x
    /// and 5.x layouts alike. Unsupported options (another activation, a RoPE scaling other
    /// than `linear` / `llama3`, a partial rotary factor) are errors naming the key.
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<Self> {
        let err = |key: &str, msg: String| Error::checkpoint(path, format!("`{key}`: {msg}"));
        let name = v
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| {
                v.get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(Value::as_str)
            })
            .unwrap_or("");
        let family = Family::from_name(name).ok_or_else(|| {
            err(
                "model_type",
                format!("`{name}` is not a Llama-family model"),
            )
        })?;
        let usize_of = |key: &str| -> Result<Option<usize>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| err(key, format!("must be a non-negative integer, got {x}"))),
            }
        };
        let need = |key: &str| -> Result<usize> {
            usize_of(key)?.ok_or_else(|| err(key, "missing".into()))
        };
        let f64_of = |key: &str, default: f64| -> Result<f64> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| err(key, format!("must be a number, got {x}"))),
            }
        };
        let bool_of = |key: &str, default: bool| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_bool()
                    .ok_or_else(|| err(key, format!("must be true or false, got {x}"))),
            }
        };
        for key in ["hidden_act", "hidden_activation"] {
            if let Some(act) = v.get(key).and_then(Value::as_str) {
                if act != "silu" && act != "swish" {
                    return Err(err(key, format!("`{act}` is not supported (silu only)")));
                }
            }
        }
        if f64_of("partial_rotary_factor", 1.0)? != 1.0 {
            return Err(err("partial_rotary_factor", "only 1.0 is supported".into()));
        }
        if bool_of("pretraining_tp_slices", false)? {
            return Err(err("pretraining_tp_slices", "not supported".into()));
        }
        let hidden_size = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let layers = need("num_hidden_layers")?;
        let default_head_dim = match family {
            Family::Qwen3 => 128,
            _ => hidden_size / heads.max(1),
        };
        let (rope_theta, rope_scaling) = RopeScaling::from_hf_json(v, path)?;
        let attention_bias = bool_of("attention_bias", false)?;
        let (qkv_bias, o_bias) = match family {
            Family::Llama | Family::Qwen3 => (attention_bias, attention_bias),
            Family::Qwen2 => (true, false),
            Family::Mistral => (false, false),
        };
        let mlp_bias = family == Family::Llama && bool_of("mlp_bias", false)?;
        let layer_windows = Self::windows_from_hf_json(v, family, layers, path)?;
        let token = |key: &str| -> Result<Vec<u32>> {
            let one = |x: &Value| {
                x.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| err(key, format!("must be a token id, got {x}")))
            };
            match v.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(a)) => a.iter().map(one).collect(),
                Some(x) => Ok(vec![one(x)?]),
            }
        };
        let dtype = v
            .get("dtype")
            .or_else(|| v.get("torch_dtype"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let cfg = LlamaConfig {
            family,
            vocab_size: need("vocab_size")?,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: usize_of("num_key_value_heads")?.unwrap_or(heads),
            head_dim: usize_of("head_dim")?.unwrap_or(default_head_dim),
            max_position_embeddings: usize_of("max_position_embeddings")?.unwrap_or(2048),
            rms_norm_eps: f64_of("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: family == Family::Qwen3,
            tie_word_embeddings: bool_of("tie_word_embeddings", false)?,
            layer_windows,
            attention_dropout: f64_of("attention_dropout", 0.0)? as f32,
            initializer_range: f64_of("initializer_range", 0.02)?,
            bos_token_id: token("bos_token_id")?.first().copied(),
            eos_token_ids: token("eos_token_id")?,
            torch_dtype: dtype,
        };
        cfg.validate()
            .map_err(|e| Error::checkpoint(path, e.to_string()))?;
        Ok(cfg)
    }

    /// Per-layer sliding windows: `layer_types` when given (transformers 5.x), else Mistral's
    /// `sliding_window` on every layer, or Qwen's on layers `>= max_window_layers` when
    /// `use_sliding_window`.
    fn windows_from_hf_json(
        v: &Value,
        family: Family,
        layers: usize,
        path: &Path,
    ) -> Result<Vec<Option<usize>>> {
        let err = |key: &str, msg: String| Error::checkpoint(path, format!("`{key}`: {msg}"));
        let window = match v.get("sliding_window") {
            None | Some(Value::Null) => None,
            Some(x) => Some(x.as_u64().map(|w| w as usize).ok_or_else(|| {
                err(
                    "sliding_window",
                    format!("must be an integer or null, got {x}"),
                )
            })?),
        };
        let window = match family {
            Family::Llama => None,
            Family::Mistral => window,
            Family::Qwen2 | Family::Qwen3 => match v.get("use_sliding_window") {
                Some(Value::Bool(true)) => window,
                _ => None,
            },
        };
        if let Some(Value::Array(types)) = v.get("layer_types") {
            if types.len() != layers {
                return Err(err(
                    "layer_types",
                    format!("{} entries for {layers} layers", types.len()),
                ));
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(None),
                    Some("sliding_attention") => window.map(Some).ok_or_else(|| {
                        err(
                            "layer_types",
                            "sliding_attention without a sliding_window".into(),
                        )
                    }),
                    _ => Err(err("layer_types", format!("unsupported layer type {t}"))),
                })
                .collect();
        }
        let from = match family {
            Family::Qwen2 | Family::Qwen3 => v
                .get("max_window_layers")
                .and_then(Value::as_u64)
                .unwrap_or(0) as usize,
            _ => 0,
        };
        Ok((0..layers).map(|i| window.filter(|_| i >= from)).collect())
    }

    /// The Hugging Face `config.json`, in the transformers 4.x layout (top-level `rope_theta`
    /// and `rope_scaling`, `torch_dtype`), which transformers 4.x and 5.x both read.
    pub fn to_hf_json(&self) -> Value {
        let f = self.family;
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put("architectures", json!([f.class()]));
        put("model_type", json!(f.model_type()));
        put("vocab_size", json!(self.vocab_size));
        put("hidden_size", json!(self.hidden_size));
        put("intermediate_size", json!(self.intermediate_size));
        put("num_hidden_layers", json!(self.num_hidden_layers));
        put("num_attention_heads", json!(self.num_attention_heads));
        put("num_key_value_heads", json!(self.num_key_value_heads));
        put("head_dim", json!(self.head_dim));
        put("hidden_act", json!("silu"));
        put(
            "max_position_embeddings",
            json!(self.max_position_embeddings),
        );
        put("rms_norm_eps", json!(self.rms_norm_eps));
        put("rope_theta", json!(self.rope_theta));
        put("rope_scaling", self.rope_scaling.to_hf_json());
        put("tie_word_embeddings", json!(self.tie_word_embeddings));
        put("attention_dropout", json!(self.attention_dropout));
        put("initializer_range", json!(self.initializer_range));
        put("bos_token_id", json!(self.bos_token_id));
        put(
            "eos_token_id",
            match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => json!(one),
                many => json!(many),
            },
        );
        put(
            "torch_dtype",
            json!(self.torch_dtype.as_deref().unwrap_or("float32")),
        );
        match f {
            Family::Llama => {
                put("attention_bias", json!(self.qkv_bias));
                put("mlp_bias", json!(self.mlp_bias));
            }
            Family::Qwen3 => put("attention_bias", json!(self.qkv_bias)),
            Family::Qwen2 | Family::Mistral => {}
        }
        let window = self.layer_windows.iter().flatten().next().copied();
        match f {
            Family::Mistral => put("sliding_window", json!(window)),
            Family::Qwen2 | Family::Qwen3 => {
                let first = self.layer_windows.iter().position(Option::is_some);
                put("use_sliding_window", json!(window.is_some()));
                put("sliding_window", json!(window));
                put(
                    "max_window_layers",
                    json!(first.unwrap_or(self.num_hidden_layers)),
                );
            }
            Family::Llama => {}
        }
        Value::Object(m)
    }
}
