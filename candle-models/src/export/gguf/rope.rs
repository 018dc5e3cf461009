//! Rotary scaling in GGUF, as llama.cpp's converter writes it: `linear` as two keys
//! (`{arch}.rope.scaling.type`, `.factor`), Llama 3's `llama3` as a tensor of per-frequency
//! divisors (`rope_freqs.weight`, computed in f32 as the converter's
//! `LlamaModel.generate_extra_tensors` computes it), plain rotary as nothing. Other types are
//! refused by name.

use std::path::Path;

use serde_json::Value as Json;

use super::writer::Value;
use crate::{Error, Result};

/// What a config's rotary scaling adds to a file: metadata keys, and the values of
/// `rope_freqs.weight` if it has one.
pub type Scaling = (Vec<(String, Value)>, Option<Vec<f32>>);

/// What the config's `rope_scaling` adds to a file of architecture `arch`.
pub fn scaling(arch: &str, hf: &Json, dir: &Path) -> Result<Scaling> {
    let Some(s) = hf.get("rope_scaling").filter(|v| !v.is_null()) else {
        return Ok((Vec::new(), None));
    };
    let kind = s["rope_type"]
        .as_str()
        .or(s["type"].as_str())
        .unwrap_or("?");
    let num = |k: &str, default: f64| s.get(k).and_then(Json::as_f64).unwrap_or(default);
    match kind {
        "default" => Ok((Vec::new(), None)),
        "linear" => Ok((
            vec![
                (
                    format!("{arch}.rope.scaling.type"),
                    Value::Str("linear".into()),
                ),
                (
                    format!("{arch}.rope.scaling.factor"),
                    Value::F32(num("factor", 1.0) as f32),
                ),
            ],
            None,
        )),
        "llama3" if arch == "llama" => {
            let heads = hf["num_attention_heads"].as_u64().unwrap_or(1) as usize;
            let dim = match hf.get("head_dim").and_then(Json::as_u64) {
                Some(d) => d as usize,
                None => hf["hidden_size"].as_u64().unwrap_or(0) as usize / heads.max(1),
            };
            let base = hf["rope_theta"].as_f64().unwrap_or(10000.0) as f32;
            let factors = llama3_factors(
                base,
                dim,
                num("factor", 8.0) as f32,
                num("low_freq_factor", 1.0) as f32,
                num("high_freq_factor", 4.0) as f32,
                num("original_max_position_embeddings", 8192.0) as f32,
            );
            Ok((Vec::new(), Some(factors)))
        }
        other => Err(Error::Config(format!(
            "{}: rope_scaling type `{other}` cannot be written to GGUF for {arch} (plain, linear \
             and Llama 3's can)",
            dir.display()
        ))),
    }
}

/// Llama 3's divisor of each rotary frequency: 1 for wavelengths shorter than
/// `old_ctx / high`, `factor` for longer than `old_ctx / low`, blended between.
fn llama3_factors(
    base: f32,
    dim: usize,
    factor: f32,
    low: f32,
    high: f32,
    old_ctx: f32,
) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (old_ctx / low, old_ctx / high);
    (0..dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0 / base.powf(i as f32 / dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}
