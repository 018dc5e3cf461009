//! A Llama-family `config.json`: read in the transformers 4.x layout (top-level `rope_theta`
//! / `rope_scaling`, `torch_dtype`) or the 5.x one (`rope_parameters`, `dtype`), written in the
//! 4.x layout, which both read.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::{Family, LlamaConfig, RopeScaling};
use crate::{Error, Result};

impl LlamaConfig {
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
