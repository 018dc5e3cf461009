//! QLoRA bases: linear layers frozen in 4 bits ([`candle_fused::nf4`], bitsandbytes' NF4),
//! quantized on load ([`nf4_on_load`]) or read as transformers saved them
//! ([`read_bnb_4bit`]), and run by [`candle_fused::qlora`] a tile at a time.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use candle_fused::nf4::{Nf4Weight, QUANT_STATE_SUFFIX};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Nf4Layers;
use crate::load::{Streamed, WeightFiles};
use crate::model::{config_from_hf_json_file, Builder, ModelConfig, Params};
use crate::Result as ModelResult;
use crate::{Error, Result};

/// The module path of the output head, which `all-linear` leaves out (PEFT: the output
/// embeddings).
pub const OUTPUT_HEAD: &str = "lm_head";

/// How a base's linear layers are quantized on load (`--base-quant nf4`): transformers'
/// `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ..)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nf4Settings {
    /// Double quantization of the absmaxes (`bnb_4bit_use_double_quant`).
    pub double: bool,
    /// Modules kept in full precision (`llm_int8_skip_modules`): a layer whose module path
    /// has one of these as a component sequence (`lm_head`, `mlp.down_proj`) stays as it is.
    pub skip: Vec<String>,
}

impl Default for Nf4Settings {
    /// transformers' defaults: no double quantization, `lm_head` kept.
    fn default() -> Self {
        Nf4Settings {
            double: false,
            skip: vec![OUTPUT_HEAD.to_string()],
        }
    }
}

impl Nf4Settings {
    /// Whether the layer at `path` stays in full precision.
    pub fn skips(&self, path: &str) -> bool {
        let dotted = format!(".{path}.");
        self.skip.iter().any(|s| dotted.contains(&format!(".{s}.")))
    }
}

/// The quantizer of [`adapt_quantized`](crate::lora::adapt_quantized) that quantizes each
/// linear layer's weight of `base` to NF4 as the model is built, layer by layer (what
/// transformers does when it loads a model with `load_in_4bit`), except the layers
/// `settings` skips.
pub fn nf4_on_load<'a>(
    base: &'a Params,
    settings: &'a Nf4Settings,
) -> impl Fn(&str, usize, usize) -> ModelResult<Option<Nf4Weight>> + 'a {
    move |path: &str, _, _| {
        if settings.skips(path) {
            return Ok(None);
        }
        let w = base.tensor(&format!("{path}.weight"))?;
        Ok(Some(Nf4Weight::quantize(&w, settings.double)?))
    }
}

/// `base` with every linear weight that `settings` quantizes replaced by its NF4 round trip
/// (quantized, then dequantized to f32): the weights a QLoRA run's adapters were trained over.
/// Merging adds the adapters' update to these, as PEFT's `merge_and_unload` adds it to the
/// dequantized weight of a 4-bit base.
pub fn dequantized_base(
    config: &dyn ModelConfig,
    base: &Params,
    settings: &Nf4Settings,
) -> Result<Params> {
    let quantize = nf4_on_load(base, settings);
    let round_trips = std::cell::RefCell::new(BTreeMap::new());
    let quant = |path: &str, fan_in: usize, fan_out: usize| -> ModelResult<Option<Nf4Weight>> {
        let q = quantize(path, fan_in, fan_out)?;
        if let Some(q) = &q {
            let w = q.dequantize(DType::F32)?;
            round_trips.borrow_mut().insert(format!("{path}.weight"), w);
        }
        Ok(q)
    };
    let source = |name: &str, _: &[usize]| base.tensor(name);
    config.build(&crate::model::Builder::root(&source).with_quant(&quant))?;
    let mut round_trips = round_trips.into_inner();
    let tensors: Vec<(String, Tensor)> = base
        .iter()
        .map(|(n, v)| {
            let t = round_trips
                .remove(n)
                .unwrap_or_else(|| v.as_tensor().clone());
            (n.clone(), t)
        })
        .collect();
    Params::from_tensors(tensors)
}

/// A model saved by transformers in 4 bits: its config, the tensors kept in full precision
/// (as f32 parameters) and the 4-bit layers.
pub struct QuantizedBase {
    /// The model's config.
    pub config: Box<dyn ModelConfig>,
    /// The full-precision tensors (embeddings, norms, skipped layers), as f32.
    pub params: Params,
    /// The 4-bit layers, as saved.
    pub layers: Nf4Layers,
}

impl QuantizedBase {
    /// The 4-bit weight of the layer at `path`, for
    /// [`adapt_quantized`](crate::lora::adapt_quantized) (see [`Nf4Layers::quant`]).
    pub fn quant(
        &self,
        path: &str,
        fan_in: usize,
        fan_out: usize,
    ) -> ModelResult<Option<Nf4Weight>> {
        self.layers.quant(path, fan_in, fan_out)
    }
}

/// Checks a `config.json`'s `quantization_config` (read from `path`): `Ok(None)` without
/// one, `Ok(Some(double))` for bitsandbytes 4-bit NF4 stored in u8
/// (`bnb_4bit_use_double_quant`); any other quantization (GPTQ, AWQ, bitsandbytes 8-bit or
/// fp4, another storage type) is refused by name.
pub fn check_quantization_config(path: &Path, json: &Value) -> Result<Option<bool>> {
    let Some(q) = json.get("quantization_config") else {
        return Ok(None);
    };
    let refuse = |what: String| {
        Err(Error::checkpoint(
            path,
            format!(
                "quantization_config: {what}; only bitsandbytes 4-bit NF4 (load_in_4bit, \
                 bnb_4bit_quant_type nf4, bnb_4bit_quant_storage uint8) is supported"
            ),
        ))
    };
    let text = |k: &str| q.get(k).and_then(Value::as_str);
    let flag = |k: &str| q.get(k).and_then(Value::as_bool).unwrap_or(false);
    match text("quant_method") {
        Some("bitsandbytes") => {}
        Some(m) => return refuse(format!("quant_method `{m}`")),
        None => return refuse("no quant_method".into()),
    }
    if flag("load_in_8bit") || flag("_load_in_8bit") {
        return refuse("bitsandbytes 8-bit (load_in_8bit)".into());
    }
    if !(flag("load_in_4bit") || flag("_load_in_4bit")) {
        return refuse("load_in_4bit is not true".into());
    }
    match text("bnb_4bit_quant_type") {
        Some("nf4") => {}
        Some(t) => return refuse(format!("bnb_4bit_quant_type `{t}`")),
        None => return refuse("no bnb_4bit_quant_type".into()),
    }
    match text("bnb_4bit_quant_storage") {
        None | Some("uint8") => {}
        Some(t) => return refuse(format!("bnb_4bit_quant_storage `{t}`")),
    }
    Ok(Some(flag("bnb_4bit_use_double_quant")))
}

/// The `bnb_4bit_compute_dtype` of a 4-bit model's `config.json` (at `path`): `None` when
/// absent or null (bitsandbytes then computes in the input's dtype).
fn compute_dtype(path: &Path, json: &Value) -> Result<Option<DType>> {
    let key = "bnb_4bit_compute_dtype";
    let name = match json["quantization_config"].get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.trim_start_matches("torch."),
        Some(v) => {
            return Err(Error::checkpoint(
                path,
                format!("quantization_config.{key}: expected a dtype name, got {v}"),
            ))
        }
    };
    match name {
        "float32" => Ok(Some(DType::F32)),
        "bfloat16" => Ok(Some(DType::BF16)),
        "float16" => Ok(Some(DType::F16)),
        other => Err(Error::checkpoint(
            path,
            format!(
                "quantization_config.{key} `{other}`: the 4-bit layers compute in float32, \
                 bfloat16 or float16"
            ),
        )),
    }
}

/// Reads the transformers 4-bit model in `dir` onto `device`: `config.json` (its
/// `quantization_config` checked by [`check_quantization_config`]) and the weights, each
/// `…weight` with a `…weight.quant_state.bitsandbytes__nf4` read as an [`Nf4Weight`] as saved
/// (codes, absmaxes and nested state are not re-derived), every other tensor as an f32
/// parameter. Errors name the file and the tensor: a weight quantized as fp4, a quant state
/// that does not fit its weight.
pub fn read_bnb_4bit(dir: &Path, device: &Device) -> Result<QuantizedBase> {
    let config_path = dir.join(crate::load::CONFIG_FILE);
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(&config_path, format!("not valid JSON: {e}")))?;
    if check_quantization_config(&config_path, &json)?.is_none() {
        return Err(Error::checkpoint(
            &config_path,
            "has no quantization_config: not a 4-bit model (load it as a plain model)",
        ));
    }
    let config = config_from_hf_json_file(&config_path)?;
    let files = WeightFiles::locate(dir)?;
    let mut tensors: BTreeMap<String, (Tensor, std::path::PathBuf)> = BTreeMap::new();
    for file in files.files() {
        for (name, t) in candle_core::safetensors::load(&file, device)? {
            tensors.insert(name, (t, file.clone()));
        }
    }
    let fp4 = ".quant_state.bitsandbytes__fp4";
    if let Some((name, (_, file))) = tensors.iter().find(|(n, _)| n.ends_with(fp4)) {
        return Err(Error::checkpoint(
            file,
            format!("`{name}`: the weight is quantized as fp4; only nf4 is supported"),
        ));
    }
    let suffix = format!(".{QUANT_STATE_SUFFIX}");
    let prefixes: Vec<String> = tensors
        .keys()
        .filter_map(|n| n.strip_suffix(&suffix).map(str::to_string))
        .collect();
    let get = |n: &str| -> candle_core::Result<Option<Tensor>> {
        Ok(tensors.get(n).map(|(t, _)| t.clone()))
    };
    let mut weights = BTreeMap::new();
    for prefix in &prefixes {
        let file = &tensors[&format!("{prefix}{suffix}")].1;
        let w = Nf4Weight::from_tensors(prefix, &get)
            .map_err(|e| Error::checkpoint(file, e.to_string()))?;
        let path = prefix.strip_suffix(".weight").unwrap_or(prefix).to_string();
        weights.insert(path, w);
    }
    let quantized = |n: &str| {
        prefixes.iter().any(|p| {
            n == p
                || n.strip_prefix(p.as_str())
                    .is_some_and(|r| r.starts_with('.'))
        })
    };
    let mut plain = Vec::new();
    for (name, (t, file)) in &tensors {
        if quantized(name) {
            continue;
        }
        if !t.dtype().is_float() {
            return Err(Error::checkpoint(
                file,
                format!(
                    "`{name}` is {:?}, not a float tensor nor part of a 4-bit weight",
                    t.dtype()
                ),
            ));
        }
        plain.push((name.clone(), t.to_dtype(DType::F32)?));
    }
    Ok(QuantizedBase {
        config,
        params: Params::from_tensors(plain)?,
        layers: Nf4Layers {
            weights,
            file: files.path().to_path_buf(),
            compute_dtype: compute_dtype(&config_path, &json)?,
        },
    })
}

/// Reads the model `config` from `weights` with its linear layers quantized to NF4 as
/// `settings` says (those it skips kept), layer by layer: each weight is read from the mapped
/// file, quantized and dropped before the next is read (the codes are
/// [`Nf4Weight::quantize`]'s, the same as quantizing the whole model read first). Returns the
/// other parameters (f32) and the 4-bit layers.
pub(crate) fn quantize_streamed(
    config: &dyn ModelConfig,
    weights: &Streamed,
    settings: &Nf4Settings,
    device: &Device,
    file: PathBuf,
) -> Result<(Params, Nf4Layers)> {
    let quantized = RefCell::new(BTreeMap::new());
    let plain = RefCell::new(Vec::new());
    let quant = |path: &str, _: usize, _: usize| -> ModelResult<Option<Nf4Weight>> {
        if settings.skips(path) {
            return Ok(None);
        }
        let w = weights.tensor(&format!("{path}.weight"), device)?;
        let q = Nf4Weight::quantize(&w, settings.double)?;
        quantized.borrow_mut().insert(path.to_string(), q.clone());
        Ok(Some(q))
    };
    let source = |name: &str, _: &[usize]| -> ModelResult<Tensor> {
        let v = Var::from_tensor(&weights.tensor(name, device)?)?;
        plain.borrow_mut().push((name.to_string(), v.clone()));
        Ok(v.as_tensor().clone())
    };
    config.build(&Builder::root(&source).with_quant(&quant))?;
    let params = Params::from_vars(plain.into_inner());
    weights.check_copies(device, |of| weights.tensor(of, device))?;
    let layers = Nf4Layers {
        weights: quantized.into_inner(),
        file,
        compute_dtype: None,
    };
    Ok((params, layers))
}
