//! Writing a model as one GGUF file that llama.cpp runs (`llama-cli -m model.gguf`), as
//! llama.cpp's own `convert_hf_to_gguf.py` writes it: the same architecture name, metadata
//! keys, tensor names and layouts (Llama's q/k rows permuted for its rotary layout), the same
//! tensor types (1-D tensors and norms in f32; the rest in the type asked for, q8_0 falling back
//! to f16 where rows are not whole blocks), and the tokenizer inside (`vocab.rs`).
//!
//! Llama, Mistral (llama.cpp's `llama` architecture), Qwen2 and Qwen3 are written; adapters
//! (a LoRA run, a PEFT adapter directory) are merged into their base first, or written alone
//! as a GGUF LoRA file ([`export_gguf_lora`]). The file is written beside its destination and
//! renamed into place.
//!
//! A model without adapters is read one tensor at a time from its mapped files
//! ([`crate::load::ModelDir::stream`]): memory holds about three copies of the largest tensor
//! in f32 (read, flattened, encoded), not the model. A SmolLM2-135M-shaped bf16 model peaked
//! at 271 MB of anonymous memory, against 692 MB when loaded whole. Adapters are checked
//! against, and merged into, their whole base.

mod kquants;
mod lora;
mod quant;
mod rope;
mod vocab;
mod writer;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::Value as Json;

pub use lora::export_gguf_lora;
use writer::{GgmlType, TensorInfo, Value};

use crate::load::{Checks, ModelDir};
use crate::{Error, Result};

/// The tensor types of an exported GGUF file (llama.cpp's `--outtype` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum GgufType {
    /// Every tensor in f32 (`ALL_F32`).
    F32,
    /// Matrices in f16, vectors in f32 (`MOSTLY_F16`).
    F16,
    /// Matrices in bf16, vectors in f32 (`MOSTLY_BF16`).
    Bf16,
    /// Matrices in q8_0 (8 bits and an f16 scale per 32), vectors in f32 (`MOSTLY_Q8_0`).
    #[cfg_attr(feature = "clap", value(name = "q8_0"))]
    Q8_0,
    /// llama.cpp's q4_k_m mixture (`MOSTLY_Q4_K_M`, what `llama-quantize ... Q4_K_M` writes):
    /// q4_k matrices, q6_k for the output head and for the value and down projections of
    /// some layers, vectors in f32.
    #[cfg_attr(feature = "clap", value(name = "q4_k_m"))]
    Q4KM,
}

impl GgufType {
    /// `general.file_type` (llama.cpp's `enum llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            GgufType::F32 => 0,
            GgufType::F16 => 1,
            GgufType::Q8_0 => 7,
            GgufType::Bf16 => 32,
            GgufType::Q4KM => 15,
        }
    }

    /// The type a matrix takes.
    fn matrix(self) -> GgmlType {
        match self {
            GgufType::F32 => GgmlType::F32,
            GgufType::F16 => GgmlType::F16,
            GgufType::Bf16 => GgmlType::Bf16,
            GgufType::Q8_0 => GgmlType::Q8_0,
            GgufType::Q4KM => GgmlType::Q4K,
        }
    }
}

/// How to export a GGUF file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgufOptions {
    /// The tensor types (`None`: as the converter's `auto`, bf16 for a source stored in bf16,
    /// f16 otherwise).
    pub ty: Option<GgufType>,
    /// Write the tokenizer (`tokenizer.*` keys); without it llama.cpp needs another file's.
    pub tokenizer: bool,
    /// Replace an existing file.
    pub force: bool,
    /// Adapters are merged even over another base than the one they record (a warning).
    pub other_base: bool,
}

/// What a GGUF export wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufExported {
    /// The file written.
    pub path: PathBuf,
    /// llama.cpp's architecture name.
    pub architecture: String,
    /// The tensor types written.
    pub ty: GgufType,
    /// Tensors written.
    pub tensors: usize,
    /// The file's size in bytes.
    pub bytes: u64,
    /// Whether the tokenizer is inside.
    pub tokenizer: bool,
}

/// How an architecture's tensors and keys are written.
struct Arch {
    /// llama.cpp's name (`general.architecture`, the keys' prefix).
    name: &'static str,
    /// q_proj/k_proj rows permuted from Hugging Face's rotary layout to llama.cpp's (Llama).
    permute_qk: bool,
    /// `{arch}.vocab_size` and `{arch}.rope.dimension_count` written (Llama's converter does).
    vocab_and_rope_dims: bool,
    /// `attention.key_length` / `value_length` written (from the config's `head_dim`).
    head_dims: bool,
}

/// The GGUF architecture of the model whose `config.json` is `hf` (from `dir`), or an error
/// naming the class that cannot be exported.
fn exported_arch(hf: &Json, dir: &Path) -> Result<Arch> {
    let class = hf["architectures"][0].as_str().unwrap_or("?").to_string();
    arch_of(&class).ok_or_else(|| {
        Error::Config(format!(
            "{}: architecture {class} cannot be exported to GGUF (Llama, Mistral, Qwen2 and \
             Qwen3 can)",
            dir.display()
        ))
    })
}

fn arch_of(hf_class: &str) -> Option<Arch> {
    let (name, permute_qk, vocab_and_rope_dims, head_dims) = match hf_class {
        "LlamaForCausalLM" | "MistralForCausalLM" => ("llama", true, true, true),
        "Qwen2ForCausalLM" => ("qwen2", false, false, false),
        "Qwen3ForCausalLM" => ("qwen3", false, false, true),
        _ => return None,
    };
    Some(Arch {
        name,
        permute_qk,
        vocab_and_rope_dims,
        head_dims,
    })
}

/// Writes `source` as the GGUF file `out` (see the module documentation).
pub fn export_gguf(source: &ModelDir, out: &Path, options: &GgufOptions) -> Result<GgufExported> {
    check_destination(out, options.force)?;
    // Without adapters the tensors are read one at a time from the mapped files, so memory
    // holds the largest tensor, not the model; adapters are checked against, and merged
    // into, their whole base first.
    let (config, weights) = match source.adapter {
        None => {
            let (config, streamed) = source.stream()?;
            (config, Weights::Streamed(streamed))
        }
        Some(_) => {
            let loaded = source.load_with(&Checks::default(), &Device::Cpu)?;
            (loaded.config, Weights::Loaded(loaded.params))
        }
    };
    let hf = config.to_hf_json();
    let arch = exported_arch(&hf, &source.dir)?;
    let (rope_keys, rope_freqs) = rope::scaling(arch.name, &hf, &source.dir)?;
    let ty = match options.ty {
        Some(t) => t,
        None => match super::stored_dtype(&super::origins(source))?.0 {
            super::WeightDtype::Bf16 => GgufType::Bf16,
            _ => GgufType::F16,
        },
    };
    let mut metadata = model_metadata(&arch, &hf, source, ty)?;
    metadata.extend(rope_keys);
    let mut tokenizer = false;
    if options.tokenizer {
        let dir = tokenizer_dir(source).ok_or_else(|| {
            Error::Config(format!(
                "{}: no tokenizer.json found beside the model or its origins; export without \
                 the tokenizer with --gguf-no-tokenizer",
                source.dir.display()
            ))
        })?;
        metadata.extend(vocab::metadata(&dir, config.vocab_size())?);
        tokenizer = true;
    }
    let heads = (usize_of(&hf, "num_attention_heads")?, kv_heads(&hf)?);
    let plan = plan(&config.shapes(), rope_freqs, ty, &source.dir)?;
    let infos: Vec<TensorInfo> = plan.iter().map(|(_, info)| info.clone()).collect();
    let bytes = write_file(out, &metadata, &infos, |i| {
        let (name, mut t) = match &plan[i].0 {
            Source::Param(name) => (name.as_str(), weights.tensor(name)?),
            Source::Values(v) => ("", Tensor::new(v.as_slice(), &Device::Cpu)?),
        };
        if arch.permute_qk {
            t = permute_qk(name, &t, heads)?;
        }
        Ok(t)
    })?;
    Ok(GgufExported {
        path: out.to_path_buf(),
        architecture: arch.name.to_string(),
        ty,
        tensors: plan.len(),
        bytes,
        tokenizer,
    })
}

/// Refuses an existing `out` unless `force`.
fn check_destination(out: &Path, force: bool) -> Result<()> {
    if out.exists() && !force {
        return Err(Error::Config(format!(
            "{} exists: pass --force to replace it",
            out.display()
        )));
    }
    Ok(())
}

/// Writes the GGUF file `out`: the header (`metadata`, `infos`), then each tensor `i` as
/// `tensor(i)` gives it, one at a time, encoded in `infos[i]`'s type. The file is written in
/// a temporary directory beside `out` (removed however this returns) and renamed into place:
/// a failed export leaves nothing behind. Returns the file's size.
fn write_file(
    out: &Path,
    metadata: &[(String, Value)],
    infos: &[TensorInfo],
    mut tensor: impl FnMut(usize) -> Result<Tensor>,
) -> Result<u64> {
    let (dir, _) = super::atomic::temporary_beside(out)?;
    let _cleanup = super::atomic::RemoveOnDrop(Some(dir.clone()));
    let tmp = dir.join("model.gguf");
    let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let io_err = |e: std::io::Error| Error::io(&tmp, e);
    let mut data = writer::write_header(BufWriter::new(file), metadata, infos).map_err(io_err)?;
    for (i, info) in infos.iter().enumerate() {
        let t = tensor(i)?;
        let bytes =
            quant::encode(&t, info.ty).map_err(|e| Error::Config(format!("{}: {e}", info.name)))?;
        data.tensor(&bytes).map_err(io_err)?;
    }
    let mut w = data.finish().map_err(io_err)?;
    w.flush().map_err(io_err)?;
    let file = w.into_inner().map_err(|e| io_err(e.into_error()))?;
    file.sync_all().map_err(io_err)?;
    let bytes = file.metadata().map_err(io_err)?.len();
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))?;
    Ok(bytes)
}

/// `t` (the Hugging Face tensor `name`, or rows of it) with q/k rows permuted for llama.cpp
/// (`heads`: query and key-value heads); other tensors as they are.
fn permute_qk(name: &str, t: &Tensor, heads: (usize, usize)) -> Result<Tensor> {
    if name.ends_with("q_proj.weight") {
        permute(t, heads.0)
    } else if name.ends_with("k_proj.weight") {
        permute(t, heads.1)
    } else {
        Ok(t.clone())
    }
}

/// The parameters of the model written: loaded whole (adapters merged in), or read one at a
/// time.
enum Weights {
    Loaded(crate::model::Params),
    Streamed(crate::load::Streamed),
}

impl Weights {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        match self {
            Weights::Loaded(p) => Ok(p.tensor(name)?),
            Weights::Streamed(s) => s.tensor(name, &Device::Cpu),
        }
    }
}

/// Where a tensor of the file comes from.
enum Source {
    /// A parameter, by Hugging Face name.
    Param(String),
    /// Values computed for the file (Llama 3's `rope_freqs.weight`).
    Values(Vec<f32>),
}

/// Each tensor of the file (`rope_freqs` if given, then every Hugging Face tensor of
/// `params`) with what the file holds of it (llama.cpp's name, the shape, the type [`Mixture`]
/// chooses), in file order.
fn plan(
    shapes: &BTreeMap<String, Vec<usize>>,
    rope_freqs: Option<Vec<f32>>,
    ty: GgufType,
    dir: &Path,
) -> Result<Vec<(Source, TensorInfo)>> {
    let mut mixture = Mixture::new(shapes.keys(), ty);
    let extra = rope_freqs.map(|v| {
        let info = TensorInfo {
            name: "rope_freqs.weight".into(),
            shape: vec![v.len()],
            ty: GgmlType::F32,
        };
        Ok((Source::Values(v), info))
    });
    let params = shapes.iter().map(|(name, shape)| {
        let gguf_name = tensor_name(name).ok_or_else(|| {
            Error::Config(format!(
                "{}: tensor {name} has no llama.cpp name",
                dir.display()
            ))
        })?;
        let shape = shape.clone();
        let ty = mixture.type_of(&gguf_name, &shape);
        let info = TensorInfo {
            name: gguf_name,
            shape,
            ty,
        };
        Ok((Source::Param(name.clone()), info))
    });
    extra.into_iter().chain(params).collect()
}

/// The general and architecture keys, as llama.cpp's converter writes them for `arch`.
fn model_metadata(
    arch: &Arch,
    hf: &Json,
    source: &ModelDir,
    ty: GgufType,
) -> Result<Vec<(String, Value)>> {
    let a = arch.name;
    let u = |k: &str| -> Result<Value> { Ok(Value::U32(usize_of(hf, k)? as u32)) };
    let head_dim = match hf.get("head_dim").and_then(Json::as_u64) {
        Some(d) => d as usize,
        None => usize_of(hf, "hidden_size")? / usize_of(hf, "num_attention_heads")?,
    };
    let name = source
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut m = vec![
        ("general.architecture".to_string(), Value::Str(a.into())),
        ("general.type".to_string(), Value::Str("model".into())),
        ("general.name".to_string(), Value::Str(name)),
        (format!("{a}.block_count"), u("num_hidden_layers")?),
        (format!("{a}.context_length"), u("max_position_embeddings")?),
        (format!("{a}.embedding_length"), u("hidden_size")?),
        (format!("{a}.feed_forward_length"), u("intermediate_size")?),
        (
            format!("{a}.attention.head_count"),
            u("num_attention_heads")?,
        ),
        (
            format!("{a}.attention.head_count_kv"),
            Value::U32(kv_heads(hf)? as u32),
        ),
        (
            format!("{a}.rope.freq_base"),
            Value::F32(f64_of(hf, "rope_theta")? as f32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(f64_of(hf, "rms_norm_eps")? as f32),
        ),
    ];
    if arch.head_dims && hf.get("head_dim").is_some() {
        m.push((
            format!("{a}.attention.key_length"),
            Value::U32(head_dim as u32),
        ));
        m.push((
            format!("{a}.attention.value_length"),
            Value::U32(head_dim as u32),
        ));
    }
    m.push(("general.file_type".to_string(), Value::U32(ty.file_type())));
    if arch.vocab_and_rope_dims {
        m.push((format!("{a}.vocab_size"), u("vocab_size")?));
        m.push((
            format!("{a}.rope.dimension_count"),
            Value::U32(head_dim as u32),
        ));
    }
    m.push(("general.quantization_version".to_string(), Value::U32(2)));
    Ok(m)
}

fn usize_of(hf: &Json, key: &str) -> Result<usize> {
    hf.get(key)
        .and_then(Json::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| Error::Config(format!("config.json: {key} is missing or not a count")))
}

fn f64_of(hf: &Json, key: &str) -> Result<f64> {
    hf.get(key)
        .and_then(Json::as_f64)
        .ok_or_else(|| Error::Config(format!("config.json: {key} is missing or not a number")))
}

fn kv_heads(hf: &Json) -> Result<usize> {
    match hf.get("num_key_value_heads").and_then(Json::as_u64) {
        Some(k) => Ok(k as usize),
        None => usize_of(hf, "num_attention_heads"),
    }
}

/// llama.cpp's name of a Hugging Face tensor of a Llama-family model.
fn tensor_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = part.rsplit_once('.')?;
    let name = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

/// The stored type of each tensor, in file order: vectors and norms in f32 (as the converter
/// and `llama-quantize` keep them); matrices in the file's type, q8_0 falling back to f16
/// where rows are not whole blocks (the converter); for q4_k_m, `llama-quantize`'s choice
/// (`llama_tensor_get_type`): q6_k for the output head (the token embedding when tied), and
/// for the value and down projections of the layers `use_more_bits` picks, counted in file
/// order; q4_k elsewhere; rows not whole 256-blocks falling back to q5_0 (q4_k) or q8_0
/// (q6_k), then f16.
struct Mixture {
    ty: GgufType,
    tied: bool,
    layers: usize,
    attn_v: usize,
    ffn_down: usize,
}

impl Mixture {
    fn new<'a>(names: impl Iterator<Item = &'a String>, ty: GgufType) -> Self {
        let names: Vec<&String> = names.collect();
        let count = |suffix: &str| names.iter().filter(|n| n.ends_with(suffix)).count();
        Mixture {
            ty,
            tied: !names.iter().any(|n| n.as_str() == "lm_head.weight"),
            layers: count("v_proj.weight"),
            attn_v: 0,
            ffn_down: 0,
        }
    }

    fn type_of(&mut self, gguf_name: &str, shape: &[usize]) -> GgmlType {
        if shape.len() <= 1
            || gguf_name.ends_with("_norm.weight")
            || !gguf_name.ends_with(".weight")
        {
            return GgmlType::F32;
        }
        if self.ty != GgufType::Q4KM {
            let t = self.ty.matrix();
            return if t.bytes(shape).is_some() {
                t
            } else {
                GgmlType::F16
            };
        }
        let more_bits = |i: usize, n: usize| {
            i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2
        };
        let head = gguf_name == "output.weight" || (self.tied && gguf_name == "token_embd.weight");
        let mut t = GgmlType::Q4K;
        if head {
            return if GgmlType::Q6K.bytes(shape).is_some() {
                GgmlType::Q6K
            } else {
                GgmlType::Q8_0
            };
        } else if gguf_name.ends_with(".attn_v.weight") {
            if more_bits(self.attn_v, self.layers) {
                t = GgmlType::Q6K;
            }
            self.attn_v += 1;
        } else if gguf_name.ends_with(".ffn_down.weight") {
            if more_bits(self.ffn_down, self.layers) {
                t = GgmlType::Q6K;
            }
            self.ffn_down += 1;
        }
        if t.bytes(shape).is_none() {
            t = if t == GgmlType::Q4K {
                GgmlType::Q5_0
            } else {
                GgmlType::Q8_0
            };
            if t.bytes(shape).is_none() {
                t = GgmlType::F16;
            }
        }
        t
    }
}

/// Hugging Face's q/k rows (rotary halves) in llama.cpp's order (interleaved pairs): the
/// converter's `LlamaModel.permute`.
fn permute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    Ok(w.reshape((heads, 2, rows / heads / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// The directory holding the tokenizer: the source's, or its origins' (an `--init-from`).
fn tokenizer_dir(source: &ModelDir) -> Option<PathBuf> {
    super::origins(source)
        .into_iter()
        .map(|o| o.dir)
        .chain(source.adapter.clone())
        .find(|d| d.join(candle_data::tokenizer::TOKENIZER_FILE).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_cpp() {
        assert_eq!(
            tensor_name("model.layers.3.self_attn.q_proj.bias").unwrap(),
            "blk.3.attn_q.bias"
        );
        assert_eq!(
            tensor_name("model.layers.0.mlp.down_proj.weight").unwrap(),
            "blk.0.ffn_down.weight"
        );
        assert_eq!(tensor_name("lm_head.weight").unwrap(), "output.weight");
        assert!(tensor_name("model.layers.0.mlp.fc.weight").is_none());
    }
}
