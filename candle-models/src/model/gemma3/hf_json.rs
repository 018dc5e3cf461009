//! Gemma 3's `config.json`: read in both layouts transformers reads (5.x: `rope_parameters`
//! per layer type and `layer_types`; older: `rope_theta`, `rope_local_base_freq`,
//! `rope_scaling` for the full layers only, `sliding_window_pattern`), written as transformers
//! 5.x writes it.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::super::layers::{GateAct, RopeScaling};
use super::super::llama::hf_json::Keys;
use super::{Gemma3Config, LayerType};
use crate::{Error, Result};

/// `sliding_attention` / `full_attention`.
fn layer_type_name(t: LayerType) -> &'static str {
    match t {
        LayerType::Sliding => "sliding_attention",
        LayerType::Full => "full_attention",
    }
}

/// Errors for the options the trainer does not implement, naming the key.
fn check_supported(k: &Keys) -> Result<GateAct> {
    if k.bool_of("use_bidirectional_attention", false)? {
        return Err(k.err(
            "use_bidirectional_attention",
            "`true` (EmbeddingGemma's bidirectional attention) is not supported: causal only"
                .into(),
        ));
    }
    if k.f64_of("partial_rotary_factor", 1.0)? != 1.0 {
        return Err(k.err("partial_rotary_factor", "only 1.0 is supported".into()));
    }
    match k.v.get("hidden_activation").and_then(Value::as_str) {
        None | Some("gelu_pytorch_tanh") => Ok(GateAct::GeluTanh),
        Some("silu") => Ok(GateAct::Silu),
        Some(other) => Err(k.err(
            "hidden_activation",
            format!("`{other}` is not supported (gelu_pytorch_tanh and silu are)"),
        )),
    }
}

/// Each layer's type: `layer_types`, or `sliding_window_pattern` (default 6: every 6th layer
/// full), as transformers derives them.
fn layer_types(k: &Keys, layers: usize) -> Result<Vec<LayerType>> {
    let Some(types) = k.v.get("layer_types").filter(|t| !t.is_null()) else {
        let pattern = k.usize_of("sliding_window_pattern")?.unwrap_or(6);
        if pattern == 0 {
            return Err(k.err("sliding_window_pattern", "must be at least 1".into()));
        }
        return Ok(Gemma3Config::pattern(layers, pattern));
    };
    let types = types
        .as_array()
        .ok_or_else(|| k.err("layer_types", format!("must be a list, got {types}")))?;
    if types.len() != layers {
        let msg = format!("{} entries for {layers} layers", types.len());
        return Err(k.err("layer_types", msg));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(LayerType::Sliding),
            Some("full_attention") => Ok(LayerType::Full),
            _ => Err(k.err("layer_types", format!("unsupported layer type {t}"))),
        })
        .collect()
}

/// The RoPE `(theta, scaling)` of each layer type `(full, sliding)`, as transformers'
/// `convert_rope_params_to_dict` folds the two layouts: `rope_parameters.<type>`, the full
/// layers' updated by `rope_scaling`, their `rope_theta` defaulting to the top-level
/// `rope_theta` (full, else 1e6) and `rope_local_base_freq` (sliding, else 1e4).
fn ropes(k: &Keys) -> Result<[(f64, RopeScaling); 2]> {
    let params = match k.v.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m),
        Some(x) => return Err(k.err("rope_parameters", format!("must be an object, got {x}"))),
    };
    let mut out = Vec::new();
    for (kind, theta_key, theta) in [
        ("full_attention", "rope_theta", 1e6),
        ("sliding_attention", "rope_local_base_freq", 1e4),
    ] {
        let mut p = match params.and_then(|m| m.get(kind)) {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(x) => {
                let msg = format!("must be an object, got {x}");
                return Err(k.err(&format!("rope_parameters.{kind}"), msg));
            }
        };
        if let (Some(Value::Object(s)), "full_attention") = (k.v.get("rope_scaling"), kind) {
            p.extend(s.clone());
        }
        if !p.contains_key("rope_theta") {
            p.insert("rope_theta".into(), json!(k.f64_of(theta_key, theta)?));
        }
        let one = json!({
            "rope_parameters": p,
            "max_position_embeddings": k.v.get("max_position_embeddings"),
        });
        let read = RopeScaling::from_hf_json(&one, k.path).map_err(|e| {
            let key = format!("rope_parameters.{kind}");
            k.err(&key, e.to_string())
        })?;
        out.push(read);
    }
    let full = out.remove(0);
    Ok([full, out.remove(0)])
}

/// `key`'s token id: the class default when the key is absent, none when it is null.
fn token(k: &Keys, key: &str, default: u32) -> Result<Option<u32>> {
    match k.v.get(key) {
        None => Ok(Some(default)),
        Some(_) => Ok(k.tokens(key)?.first().copied()),
    }
}

/// A soft-cap (`null` or absent: none).
fn softcap(k: &Keys, key: &str) -> Result<Option<f64>> {
    k.typed(key, None, |x| x.as_f64().map(Some), "a number or null")
}

impl Gemma3Config {
    /// Reads a Hugging Face `Gemma3ForCausalLM` `config.json` (`model_type` `gemma3_text`) in
    /// either layout (`path` names it in errors). Unsupported options
    /// (`use_bidirectional_attention`, another activation, RoPE types other than default,
    /// linear and llama3) are errors naming the key.
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<Self> {
        let k = Keys { v, path };
        let hidden_activation = check_supported(&k)?;
        let layers = k.need("num_hidden_layers")?;
        let [(rope_theta, rope_scaling), (rope_local_base_freq, local_rope_scaling)] = ropes(&k)?;
        let eos_token_ids = match v.get("eos_token_id") {
            None => vec![1],
            Some(_) => k.tokens("eos_token_id")?,
        };
        let sliding_window = k.usize_of("sliding_window")?;
        let layer_types = layer_types(&k, layers)?;
        if sliding_window.is_none() && layer_types.contains(&LayerType::Sliding) {
            return Err(k.err("sliding_window", "null with sliding layers".into()));
        }
        let cfg = Gemma3Config {
            vocab_size: k.need("vocab_size")?,
            hidden_size: k.need("hidden_size")?,
            intermediate_size: k.need("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: k.need("num_attention_heads")?,
            num_key_value_heads: k.need("num_key_value_heads")?,
            head_dim: k.usize_of("head_dim")?.unwrap_or(256),
            max_position_embeddings: k.usize_of("max_position_embeddings")?.unwrap_or(131_072),
            rms_norm_eps: k.f64_of("rms_norm_eps", 1e-6)?,
            hidden_activation,
            query_pre_attn_scalar: k.usize_of("query_pre_attn_scalar")?.unwrap_or(256),
            sliding_window: sliding_window.unwrap_or(4096),
            layer_types,
            rope_theta,
            rope_scaling,
            rope_local_base_freq,
            local_rope_scaling,
            attention_bias: k.bool_of("attention_bias", false)?,
            attn_logit_softcapping: softcap(&k, "attn_logit_softcapping")?,
            final_logit_softcapping: softcap(&k, "final_logit_softcapping")?,
            tie_word_embeddings: k.bool_of("tie_word_embeddings", true)?,
            attention_dropout: k.f64_of("attention_dropout", 0.0)? as f32,
            initializer_range: k.f64_of("initializer_range", 0.02)?,
            bos_token_id: token(&k, "bos_token_id", 2)?,
            eos_token_ids,
            pad_token_id: token(&k, "pad_token_id", 0)?,
            torch_dtype: v
                .get("dtype")
                .or_else(|| v.get("torch_dtype"))
                .and_then(Value::as_str)
                .map(str::to_string),
        };
        cfg.validate()
            .map_err(|e| Error::checkpoint(path, e.to_string()))?;
        Ok(cfg)
    }

    /// The Hugging Face `config.json` as transformers 5.x writes it (`rope_parameters` per
    /// layer type, `layer_types`, `dtype`); transformers reads it back to the same model.
    pub fn to_hf_json(&self) -> Value {
        let rope = |theta: f64, scaling: &RopeScaling| {
            let mut m = match scaling.to_hf_json() {
                Value::Object(m) => m,
                _ => Map::from_iter([("rope_type".to_string(), json!("default"))]),
            };
            m.insert("rope_theta".into(), json!(theta));
            Value::Object(m)
        };
        let act = match self.hidden_activation {
            GateAct::GeluTanh => "gelu_pytorch_tanh",
            GateAct::Silu => "silu",
        };
        let types: Vec<&str> = self
            .layer_types
            .iter()
            .map(|t| layer_type_name(*t))
            .collect();
        json!({
            "architectures": [super::CLASS],
            "model_type": super::MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_activation": act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window,
            "layer_types": types,
            "rope_parameters": {
                "full_attention": rope(self.rope_theta, &self.rope_scaling),
                "sliding_attention": rope(self.rope_local_base_freq, &self.local_rope_scaling),
            },
            "attention_bias": self.attention_bias,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "use_bidirectional_attention": false,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": self.attention_dropout,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => json!(one),
                many => json!(many),
            },
            "pad_token_id": self.pad_token_id,
            "dtype": self.torch_dtype.as_deref().unwrap_or("float32"),
        })
    }
}
