//! A Llama-family `config.json`: read in the transformers 4.x layout (top-level `rope_theta`
//! / `rope_scaling`, `torch_dtype`) or the 5.x one (`rope_parameters`, `dtype`), written in the
//! 4.x layout, which both read.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::{Family, LlamaConfig, RopeScaling};
use crate::{Error, Result};

/// The keys of one `config.json`, read with errors naming the file and the key (shared with
/// the other architectures that read transformers' configs).
pub(crate) struct Keys<'a> {
    pub(crate) v: &'a Value,
    pub(crate) path: &'a Path,
}

impl Keys<'_> {
    pub(crate) fn err(&self, key: &str, msg: String) -> Error {
        Error::checkpoint(self.path, format!("`{key}`: {msg}"))
    }

    /// `key` read by `read` (`default` when absent or null); a value it cannot read is an
    /// error saying it must be `what`.
    pub(crate) fn typed<T>(
        &self,
        key: &str,
        default: T,
        read: impl Fn(&Value) -> Option<T>,
        what: &str,
    ) -> Result<T> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => read(x).ok_or_else(|| self.err(key, format!("must be {what}, got {x}"))),
        }
    }

    pub(crate) fn usize_of(&self, key: &str) -> Result<Option<usize>> {
        let read = |x: &Value| x.as_u64().map(|x| Some(x as usize));
        self.typed(key, None, read, "a non-negative integer")
    }

    pub(crate) fn need(&self, key: &str) -> Result<usize> {
        self.usize_of(key)?
            .ok_or_else(|| self.err(key, "missing".into()))
    }

    pub(crate) fn f64_of(&self, key: &str, default: f64) -> Result<f64> {
        self.typed(key, default, Value::as_f64, "a number")
    }

    pub(crate) fn bool_of(&self, key: &str, default: bool) -> Result<bool> {
        self.typed(key, default, Value::as_bool, "true or false")
    }

    /// Token ids: one, a list (instruction-tuned Llama 3's `eos_token_id`) or none.
    pub(crate) fn tokens(&self, key: &str) -> Result<Vec<u32>> {
        let one = |x: &Value| {
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| self.err(key, format!("must be a token id, got {x}")))
        };
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(x) => Ok(vec![one(x)?]),
        }
    }

    /// The member of the family named by `model_type` (or `architectures[0]`).
    fn family(&self) -> Result<Family> {
        let name = self
            .v
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| {
                self.v
                    .get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(Value::as_str)
            })
            .unwrap_or("");
        Family::from_name(name).ok_or_else(|| {
            self.err(
                "model_type",
                format!("`{name}` is not a Llama-family model"),
            )
        })
    }

    /// Errors for the options the trainer does not implement: another activation, a partial
    /// rotary factor, tensor-parallel slices.
    fn check_supported(&self) -> Result<()> {
        for key in ["hidden_act", "hidden_activation"] {
            if let Some(act) = self.v.get(key).and_then(Value::as_str) {
                if act != "silu" && act != "swish" {
                    return Err(self.err(key, format!("`{act}` is not supported (silu only)")));
                }
            }
        }
        if self.f64_of("partial_rotary_factor", 1.0)? != 1.0 {
            return Err(self.err("partial_rotary_factor", "only 1.0 is supported".into()));
        }
        if self.bool_of("pretraining_tp_slices", false)? {
            return Err(self.err("pretraining_tp_slices", "not supported".into()));
        }
        Ok(())
    }
}

impl LlamaConfig {
    /// Reads a Hugging Face `config.json` of the family (`path` names it in errors): the 4.x
    /// and 5.x layouts alike. Unsupported options (another activation, a RoPE scaling other
    /// than `linear` / `llama3`, a partial rotary factor) are errors naming the key.
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<Self> {
        let k = Keys { v, path };
        let family = k.family()?;
        k.check_supported()?;
        let hidden_size = k.need("hidden_size")?;
        let heads = k.need("num_attention_heads")?;
        let layers = k.need("num_hidden_layers")?;
        let default_head_dim = match family {
            Family::Qwen3 => 128,
            _ => hidden_size / heads.max(1),
        };
        let (rope_theta, rope_scaling) = RopeScaling::from_hf_json(v, path)?;
        let attention_bias = k.bool_of("attention_bias", false)?;
        let mlp_bias = family == Family::Llama && k.bool_of("mlp_bias", false)?;
        let (qkv_bias, o_bias, mlp_bias) = family.biases(attention_bias, mlp_bias);
        let layer_windows = Self::windows_from_hf_json(&k, family, layers)?;
        let dtype = v
            .get("dtype")
            .or_else(|| v.get("torch_dtype"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let cfg = LlamaConfig {
            family,
            vocab_size: k.need("vocab_size")?,
            hidden_size,
            intermediate_size: k.need("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: k.usize_of("num_key_value_heads")?.unwrap_or(heads),
            head_dim: k.usize_of("head_dim")?.unwrap_or(default_head_dim),
            max_position_embeddings: k.usize_of("max_position_embeddings")?.unwrap_or(2048),
            rms_norm_eps: k.f64_of("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: family == Family::Qwen3,
            tie_word_embeddings: k.bool_of("tie_word_embeddings", false)?,
            layer_windows,
            attention_dropout: k.f64_of("attention_dropout", 0.0)? as f32,
            initializer_range: k.f64_of("initializer_range", 0.02)?,
            bos_token_id: k.tokens("bos_token_id")?.first().copied(),
            eos_token_ids: k.tokens("eos_token_id")?,
            torch_dtype: dtype,
        };
        cfg.validate()
            .map_err(|e| Error::checkpoint(path, e.to_string()))?;
        Ok(cfg)
    }

    /// Per-layer sliding windows: `layer_types` when given (transformers 5.x), else Mistral's
    /// `sliding_window` on every layer, or Qwen's on layers `>= max_window_layers` when
    /// `use_sliding_window`.
    fn windows_from_hf_json(k: &Keys, family: Family, layers: usize) -> Result<Vec<Option<usize>>> {
        let (v, err) = (k.v, |key: &str, msg: String| k.err(key, msg));
        let read = |x: &Value| x.as_u64().map(|w| Some(w as usize));
        let window = k.typed("sliding_window", None, read, "an integer or null")?;
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
