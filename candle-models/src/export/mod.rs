//! Writing a model as a Hugging Face model directory that `transformers`'
//! `AutoModelForCausalLM.from_pretrained` loads: `config.json`, safetensors weights (one
//! `model.safetensors`, or shards and `model.safetensors.index.json` as `transformers` and
//! `huggingface_hub` write them) and the tokenizer and generation files of the model's origin.
//!
//! The source is anything [`crate::load`] reads, loaded and checked by the same path as every
//! other command. The weights are written in the dtype the source stored them in (its
//! `config.json`'s `torch_dtype`; f32 for a run the trainer started from scratch; a run
//! started `--init-from` a pretrained model keeps that model's) unless another is asked for.
//! The directory is written beside its destination and renamed into place, so a failed export
//! leaves nothing behind.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::load::{Checks, ModelDir, CONFIG_FILE, INDEX_FILE, MODEL_FILE};
use crate::{Error, Result};
use atomic::{check_destination, write_dir};
use candle_data::io;
use candle_data::tokenizer::TOKENIZER_FILE;

mod atomic;
pub mod gguf;

/// huggingface_hub's default largest shard (`MAX_SHARD_SIZE`, 5 GB).
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 5_000_000_000;

/// Files copied from the model's origin when it has them: its tokenizer, the tokenizer's
/// settings, the generation settings and the chat template.
pub(crate) const COPIED_FILES: [&str; 5] = [
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    crate::load::GENERATION_CONFIG_FILE,
    "chat_template.jinja",
];

/// How many `init_from` links are followed to find a run's origin.
const MAX_ORIGINS: usize = 8;

/// The dtype exported weights are stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum WeightDtype {
    /// 32-bit float (`float32`).
    F32,
    /// bfloat16 (`bfloat16`).
    Bf16,
    /// IEEE half (`float16`).
    F16,
}

impl WeightDtype {
    /// The Candle dtype.
    pub fn dtype(self) -> DType {
        match self {
            WeightDtype::F32 => DType::F32,
            WeightDtype::Bf16 => DType::BF16,
            WeightDtype::F16 => DType::F16,
        }
    }

    /// Its name in `config.json`'s `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
            WeightDtype::F16 => "float16",
        }
    }

    /// The dtype a `torch_dtype` (or transformers 5's `dtype`) value names, if one of these.
    pub fn from_torch_name(name: &str) -> Option<Self> {
        match name.trim_start_matches("torch.") {
            "float32" | "float" => Some(WeightDtype::F32),
            "bfloat16" => Some(WeightDtype::Bf16),
            "float16" | "half" => Some(WeightDtype::F16),
            _ => None,
        }
    }

    /// The dtype of a safetensors header (`F32`, `BF16`, `F16`), if one of these.
    fn from_header(name: &str) -> Option<Self> {
        match name {
            "F32" => Some(WeightDtype::F32),
            "BF16" => Some(WeightDtype::Bf16),
            "F16" => Some(WeightDtype::F16),
            _ => None,
        }
    }
}

impl fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::F16 => "f16",
        })
    }
}

/// How to export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// The dtype of the written weights (`None`: the source's stored dtype).
    pub dtype: Option<WeightDtype>,
    /// The largest shard, in bytes of tensor data; more is split into shards with an index.
    pub max_shard_size: u64,
    /// Replace an output directory that holds files.
    pub force: bool,
    /// Adapters (a LoRA run, a PEFT adapter directory) are merged into their base and
    /// written as a whole model; without it they are written as a PEFT adapter directory.
    pub merge: bool,
    /// Adapters are exported even over another base than the one they record (a warning).
    pub other_base: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: None,
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            force: false,
            merge: false,
            other_base: false,
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// The model directory written.
    pub dir: PathBuf,
    /// The dtype of its weights.
    pub dtype: WeightDtype,
    /// Where that dtype came from (`--dtype`, the source's `torch_dtype`, ...).
    pub dtype_from: String,
    /// The weight files written (one `model.safetensors`, or the shards then the index).
    pub weight_files: Vec<String>,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_size: u64,
    /// The files copied besides, with where each came from.
    pub copied: Vec<(String, PathBuf)>,
}

/// Parses a size as huggingface_hub and transformers write them: `5GB`, `500MB`, `2KB`,
/// `1.5GB` (powers of 1000), `2GiB`, `512MiB` (powers of 1024) or plain bytes.
///
/// ```
/// use candle_models::export::parse_size;
/// assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
/// assert_eq!(parse_size("2KiB").unwrap(), 2048);
/// assert_eq!(parse_size("1000").unwrap(), 1000);
/// assert!(parse_size("five").is_err() && parse_size("0").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<u64> {
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim().to_ascii_uppercase();
    let scale: u64 = match unit.as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        _ => 0,
    };
    let bytes = number
        .parse::<f64>()
        .ok()
        .filter(|_| scale > 0)
        .map(|n| (n * scale as f64) as u64)
        .filter(|&b| b > 0);
    bytes.ok_or_else(|| {
        Error::Config(format!(
            "size `{text}`: expected a positive size such as 5GB, 500MB, 2GiB or a number of \
             bytes"
        ))
    })
}

/// Splits tensors (name, bytes), in the order given, into shards as huggingface_hub does
/// (`split_state_dict_into_shards_factory`): a new shard starts when adding a tensor would
/// exceed `max_shard_size`; a tensor larger than the limit gets a shard of its own, placed
/// when it is met (the shard being filled continues after it).
///
/// ```
/// let t = |n: &str, b: u64| (n.to_string(), b);
/// let shards = candle_models::export::plan_shards(&[t("a", 4), t("b", 4), t("c", 30), t("d", 4)], 10);
/// assert_eq!(shards, vec![vec!["c".to_string()], vec!["a".into(), "b".into()], vec!["d".into()]]);
/// ```
pub fn plan_shards(tensors: &[(String, u64)], max_shard_size: u64) -> Vec<Vec<String>> {
    let mut shards = Vec::new();
    let mut current: Vec<String> = Vec::new();
    let mut size = 0u64;
    for (name, bytes) in tensors {
        if *bytes > max_shard_size {
            shards.push(vec![name.clone()]);
            continue;
        }
        if size + bytes > max_shard_size {
            shards.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(name.clone());
        size += bytes;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

/// Exports the model `source` names (see [`crate::load::resolve`]) to `out` (see
/// [`export`]).
pub fn export_spec(source: &str, out: &Path, options: &ExportOptions) -> Result<Exported> {
    export(
        &ModelDir::open(source)?.with_other_base(options.other_base),
        out,
        options,
    )
}

/// Writes `source` as a Hugging Face model directory at `out`: `config.json`
/// ([`crate::model::ModelConfig::to_hf_json`], `torch_dtype` set to the dtype written), the
/// weights in that dtype (the source's stored dtype unless `options.dtype` says otherwise;
/// tied heads written once, as `transformers` saves them), sharded above
/// `options.max_shard_size`, and the tokenizer and generation files of the model's origin
/// (`COPIED_FILES`; a run trained on `tokenizer` data exports its `tokenizer_path`).
///
/// `out` must not exist or be empty, unless `options.force` (it is then replaced whole); it
/// may not hold the source. Everything is written into a temporary directory beside `out`,
/// which is renamed into place last.
///
/// Adapters (`source.adapter`) are written as a PEFT adapter directory
/// (`adapter_config.json` + `adapter_model.safetensors`, which PEFT's
/// `PeftModel.from_pretrained` loads over the base) unless `options.merge`, which writes the
/// merged model (`W + s B A`) as above.
pub fn export(source: &ModelDir, out: &Path, options: &ExportOptions) -> Result<Exported> {
    check_destination(source, out, options.force)?;
    match (&source.adapter, options.merge) {
        (None, true) => {
            return Err(Error::Config(format!(
                "--merge: {} holds no adapters (adapter_config.json): it is a whole model \
                 already; export it without --merge",
                source.dir.display()
            )))
        }
        (Some(_), false) => return export_adapter(source, out, options),
        _ => {}
    }
    let mut loaded = source.load_with(&Checks::default(), &Device::Cpu)?;
    // A QLoRA run: its adapters merged into the dequantized 4-bit base by the loader, then
    // each projection quantized again and dequantized, as PEFT's `merge_and_unload` leaves a
    // 4-bit base (its weights, dequantized, are what is written).
    let quant = source.run.as_ref().and_then(|r| r.config.nf4_settings());
    if let Some(layers) = loaded.quantized.as_ref().filter(|_| options.merge) {
        loaded.params = layers.requantized(&loaded.params)?;
    } else if let Some(q) = quant.filter(|_| options.merge) {
        loaded.params = crate::lora::dequantized_base(loaded.config.as_ref(), &loaded.params, &q)?;
    }
    let origins = origins(source);
    let (dtype, dtype_from) = match options.dtype {
        Some(d) => (d, "--dtype".to_string()),
        None => stored_dtype(&origins)?,
    };
    let copies = files_to_copy(&origins);
    let (weight_files, total_size) = write_dir(out, &copies, |tmp| {
        let written = write_weights(
            &source.dir,
            tmp,
            &loaded.params,
            dtype,
            options.max_shard_size,
        )?;
        let mut config = loaded.config.to_hf_json();
        if let Value::Object(m) = &mut config {
            m.insert("torch_dtype".into(), json!(dtype.torch_name()));
            if m.contains_key("dtype") {
                m.insert("dtype".into(), json!(dtype.torch_name()));
            }
        }
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| Error::checkpoint(tmp.join(CONFIG_FILE), e.to_string()))?;
        io::write_atomic(&tmp.join(CONFIG_FILE), format!("{text}\n").as_bytes())?;
        Ok(written)
    })?;
    Ok(Exported {
        dir: out.to_path_buf(),
        dtype,
        dtype_from,
        weight_files,
        total_size,
        copied: copies,
    })
}

/// `t` (stored as tensor `name` of the export from `source`) in `dtype`: every cast of an
/// export goes through here. A cast that overflows (a finite value becoming inf, as f16 turns
/// anything of magnitude 65520 or more) is refused.
fn cast(source: &Path, name: &str, t: &Tensor, dtype: WeightDtype) -> Result<Tensor> {
    let cast = t.to_dtype(dtype.dtype())?;
    if cast.dtype() == t.dtype() || !cast.dtype().is_float() {
        return Ok(cast);
    }
    let max_abs = |x: &Tensor| -> Result<f32> {
        Ok(x.to_dtype(DType::F32)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?)
    };
    if t.elem_count() == 0 {
        return Ok(cast);
    }
    let after = max_abs(&cast)?;
    if after.is_infinite() {
        let before = max_abs(t)?;
        if before.is_finite() {
            let range = match dtype {
                WeightDtype::F16 => "±65504",
                WeightDtype::Bf16 => "±3.39e38",
                WeightDtype::F32 => "±3.40e38",
            };
            return Err(Error::checkpoint(
                source,
                format!(
                    "tensor `{name}`: max |value| {before:e} is beyond the range of {dtype} \
                     ({range}) and would be written as inf; export it as bf16 (--dtype bf16, \
                     f32's range) or f32"
                ),
            ));
        }
    }
    Ok(cast)
}

/// Writes the adapters of `source` as a PEFT adapter directory at `out` (the tensors in
/// `options.dtype` if given, else as stored), with the base's tokenizer files.
fn export_adapter(source: &ModelDir, out: &Path, options: &ExportOptions) -> Result<Exported> {
    let checks = Checks {
        unmerged: true,
        ..Checks::default()
    };
    let loaded = source.load_with(&checks, &Device::Cpu)?;
    let Some(adapter) = loaded.adapter else {
        return Err(Error::Config(format!(
            "{}: no adapters loaded",
            out.display()
        )));
    };
    let (dtype, dtype_from) = match options.dtype {
        Some(d) => (d, "--dtype".to_string()),
        None => (
            WeightDtype::F32,
            "the adapters' (trained in f32)".to_string(),
        ),
    };
    let mut tensors = Vec::new();
    for (path, (a, b)) in &adapter.loras {
        let a_name = candle_peft::format::lora_a_name(path);
        let b_name = candle_peft::format::lora_b_name(path);
        tensors.push((a_name.clone(), cast(&source.dir, &a_name, a, dtype)?));
        tensors.push((b_name.clone(), cast(&source.dir, &b_name, b, dtype)?));
    }
    for (name, t) in &adapter.saved {
        let saved = candle_peft::format::saved_name(name);
        tensors.push((saved.clone(), cast(&source.dir, &saved, t, dtype)?));
    }
    let total_size = tensors
        .iter()
        .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum();
    let copies = files_to_copy(&origins(source));
    let metadata = loaded
        .base
        .as_ref()
        .map(crate::lora::BaseIdentity::to_metadata)
        .unwrap_or_default();
    write_dir(out, &copies, |tmp| {
        candle_peft::format::save(tmp, &adapter.config, &tensors, &metadata)
            .map_err(|e| Error::checkpoint(tmp, e.to_string()))
    })?;
    Ok(Exported {
        dir: out.to_path_buf(),
        dtype,
        dtype_from,
        weight_files: vec![candle_peft::format::ADAPTER_WEIGHTS_FILE.to_string()],
        total_size,
        copied: copies,
    })
}

/// Writes the parameters as `dtype` into `dir`: one `model.safetensors`, or shards and the
/// index. Returns the files written and the bytes of tensor data.
fn write_weights(
    source: &Path,
    dir: &Path,
    params: &crate::model::Params,
    dtype: WeightDtype,
    max_shard_size: u64,
) -> Result<(Vec<String>, u64)> {
    let width = dtype.dtype().size_in_bytes() as u64;
    let sizes: Vec<(String, u64)> = params
        .iter()
        .map(|(n, v)| (n.clone(), v.elem_count() as u64 * width))
        .collect();
    let total: u64 = sizes.iter().map(|(_, b)| b).sum();
    let shards = plan_shards(&sizes, max_shard_size);
    let n = shards.len();
    let mut files = Vec::with_capacity(n + 1);
    let mut weight_map = BTreeMap::new();
    for (i, names) in shards.iter().enumerate() {
        let file = match n {
            1 => MODEL_FILE.to_string(),
            _ => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
        };
        let tensors = names
            .iter()
            .map(|name| {
                Ok((
                    name.clone(),
                    cast(source, name, &params.tensor(name)?, dtype)?,
                ))
            })
            .collect::<Result<Vec<(String, Tensor)>>>()?;
        write_safetensors(&dir.join(&file), tensors)?;
        for name in names {
            weight_map.insert(name.clone(), file.clone());
        }
        files.push(file);
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| Error::checkpoint(&path, e.to_string()))?;
        io::write_atomic(&path, format!("{text}\n").as_bytes())?;
        files.push(INDEX_FILE.to_string());
    }
    Ok((files, total))
}

/// Writes one safetensors file with `{"format": "pt"}` metadata (which transformers 4.x
/// loaders check), streamed tensor by tensor, atomically and fsynced.
fn write_safetensors(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<()> {
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    io::save_safetensors(path, &tensors, Some(meta))
}

/// `source` and the models it was started from: a trainer run's `init_from`, followed while it
/// can still be found (a warning says where it cannot).
fn origins(source: &ModelDir) -> Vec<ModelDir> {
    let mut chain = vec![source.clone()];
    while chain.len() < MAX_ORIGINS {
        let last = &chain[chain.len() - 1];
        let Some(from) = last.run.as_ref().and_then(|s| s.config.init_from.clone()) else {
            break;
        };
        match ModelDir::open(&from) {
            Ok(m) => chain.push(m),
            Err(e) => {
                tracing::warn!(
                    "{} was started from `{from}`, which cannot be read now ({e}): its stored \
                     dtype and tokenizer files are unknown",
                    last.dir.display()
                );
                break;
            }
        }
    }
    chain
}

/// The dtype the model's origin stored its weights in, and where that was read.
fn stored_dtype(origins: &[ModelDir]) -> Result<(WeightDtype, String)> {
    let last = &origins[origins.len() - 1];
    let config = last.dir.join(CONFIG_FILE);
    let json: Value = io::read_json(&config)?;
    let named = json
        .get("torch_dtype")
        .or_else(|| json.get("dtype"))
        .and_then(Value::as_str);
    let from_config = named.and_then(WeightDtype::from_torch_name);
    let said = |what: &str| format!("{what} of {}", config.display());
    if let Some(run) = last.run.as_ref().map(|s| &s.config) {
        // A trainer checkpoint stores f32 master weights: a run from scratch exports f32; one
        // whose pretrained origin is gone keeps the torch_dtype its config.json carried over.
        return Ok(match (&run.init_from, from_config) {
            (Some(_), Some(d)) => (d, said("torch_dtype")),
            _ => (
                WeightDtype::F32,
                format!("trained by the trainer in f32 ({})", last.dir.display()),
            ),
        });
    }
    if let Some(d) = from_config {
        return Ok((d, said("torch_dtype")));
    }
    if let Some(name) = named {
        tracing::warn!(
            "{}: torch_dtype `{name}` is not f32, bf16 or f16: exporting as the stored tensors are",
            config.display()
        );
    }
    let headers = last.weights.headers()?;
    let stored = headers
        .iter()
        .find_map(|h| WeightDtype::from_header(&h.dtype));
    Ok(match stored {
        Some(d) => (d, format!("the stored tensors of {}", last.dir.display())),
        None => (WeightDtype::F32, "no stored float dtype found".into()),
    })
}

/// The files to copy: each of [`COPIED_FILES`] from the first of the origins that has it, and
/// a run's own tokenizer (`tokenizer`, `sft`, `chat-task` data) as `tokenizer.json`, with the
/// other files of [`COPIED_FILES`] beside it that the origins lack.
fn files_to_copy(origins: &[ModelDir]) -> Vec<(String, PathBuf)> {
    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    for name in COPIED_FILES {
        if let Some(p) = origins
            .iter()
            .map(|m| m.dir.join(name))
            .find(|p| p.is_file())
        {
            files.insert(name.to_string(), p);
        }
    }
    if let Some(run) = origins[0].run.as_ref().map(|s| &s.config) {
        if let (true, Some(tok)) = (run.data.uses_tokenizer(), &run.tokenizer_path) {
            if tok.is_file() {
                files.insert(TOKENIZER_FILE.to_string(), tok.clone());
                // The tokenizer's settings and chat template beside it, unless the origins
                // have their own (a fresh run's export is then a usable chat model).
                if let Some(dir) = tok.parent() {
                    for name in &COPIED_FILES[1..] {
                        let p = dir.join(name);
                        if p.is_file() {
                            files.entry(name.to_string()).or_insert(p);
                        }
                    }
                }
            } else {
                tracing::warn!(
                    "the run of {} trained on the tokenizer {}, which cannot be found now: \
                     not exported",
                    origins[0].dir.display(),
                    tok.display()
                );
            }
        }
    }
    files.into_iter().collect()
}
