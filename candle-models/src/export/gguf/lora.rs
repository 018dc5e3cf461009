//! Adapters as a GGUF LoRA file, what `llama-cli -m base.gguf --lora adapter.gguf` loads, as
//! llama.cpp's own `convert_lora_to_gguf.py` writes it: `general.type` `adapter`,
//! `adapter.type` `lora`, `adapter.lora.alpha`, and for each adapted module of the base
//! `<llama.cpp name>.lora_a` (`[r, in]`) and `.lora_b` (`[out, r]`), with lora_B's rows of the
//! query and key projections permuted as the base's rows are (Llama). llama.cpp scales the
//! product by alpha / r; for rsLoRA (PEFT's alpha / sqrt(r)) the file's alpha is alpha ·
//! sqrt(r), which gives llama.cpp PEFT's scale (the converter writes the plain alpha).
//!
//! The adapters are checked against their base as every command checks them (the base's
//! identity, the shapes, a finite update). What a GGUF LoRA cannot hold is refused by name:
//! modules saved whole (`modules_to_save`), an adapter on a head tied to the embedding.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::writer::{GgmlType, TensorInfo, Value};
use super::{exported_arch, kv_heads, permute_qk, tensor_name, usize_of};
use super::{GgufExported, GgufOptions, GgufType};
use crate::load::{Checks, ModelDir};
use crate::{Error, Result};

/// Writes the adapters of `source` (a LoRA run, or a PEFT adapter directory over its base)
/// as the GGUF LoRA file `out`, in `options.ty` (f32 by default, as llama.cpp's converter;
/// q8_0 falls back to f16 for lora_B, whose rows of r values are not whole blocks; q4_k_m is
/// refused, as the converter has no such type for adapters). The base is exported on its own
/// ([`super::export_gguf`] of the base directory).
pub fn export_gguf_lora(
    source: &ModelDir,
    out: &Path,
    options: &GgufOptions,
) -> Result<GgufExported> {
    super::check_destination(out, options.force)?;
    let Some(dir) = &source.adapter else {
        return Err(Error::Config(format!(
            "{}: holds no adapters (adapter_config.json): a GGUF LoRA file is written from a \
             LoRA run or a PEFT adapter directory; export a whole model without --gguf-lora",
            source.dir.display()
        )));
    };
    let ty = options.ty.unwrap_or(GgufType::F32);
    if ty == GgufType::Q4KM {
        return Err(Error::Config(
            "--gguf-type q4_k_m is for models: llama.cpp's adapters are f32, f16, bf16 or q8_0"
                .into(),
        ));
    }
    let checks = Checks {
        unmerged: true,
        ..Checks::default()
    };
    let loaded = source.load_with(&checks, &Device::Cpu)?;
    let adapter = loaded
        .adapter
        .ok_or_else(|| Error::Config(format!("{}: no adapters loaded", dir.display())))?;
    let hf = loaded.config.to_hf_json();
    let arch = exported_arch(&hf, &source.dir)?;
    if !adapter.saved.is_empty() {
        let names: Vec<&str> = adapter.saved.keys().map(String::as_str).collect();
        return Err(Error::Config(format!(
            "{}: saves whole modules ({}, modules_to_save), which a GGUF LoRA file cannot \
             hold: export without --gguf-lora to merge the adapters into one model file",
            dir.display(),
            names.join(", ")
        )));
    }
    let tied = loaded.params.tensor("lm_head.weight").is_err();
    let permute = arch
        .permute_qk
        .then_some((usize_of(&hf, "num_attention_heads")?, kv_heads(&hf)?));
    let (infos, tensors) = lora_tensors(&adapter, ty, tied, permute, arch.name)?;
    let config = &adapter.config;
    let alpha = match config.use_rslora {
        true => config.lora_alpha * (config.r as f64).sqrt(),
        false => config.lora_alpha,
    };
    let file_name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let metadata = vec![
        (
            "general.architecture".to_string(),
            Value::Str(arch.name.into()),
        ),
        ("general.type".to_string(), Value::Str("adapter".into())),
        ("general.name".to_string(), Value::Str(file_name)),
        ("adapter.type".to_string(), Value::Str("lora".into())),
        ("adapter.lora.alpha".to_string(), Value::F32(alpha as f32)),
        ("general.quantization_version".to_string(), Value::U32(2)),
    ];
    let bytes = super::write_file(out, &metadata, &infos, |i| Ok(tensors[i].clone()))?;
    Ok(GgufExported {
        path: out.to_path_buf(),
        architecture: arch.name.to_string(),
        ty,
        tensors: infos.len(),
        bytes,
        tokenizer: false,
    })
}

/// Each adapted module's `lora_a` and `lora_b` as the file holds them (llama.cpp's names, f32
/// values, lora_B's rows permuted when `permute` gives the query and key-value heads), with
/// their infos in `ty`: a module without a tensor in llama.cpp's `arch` model is refused.
fn lora_tensors(
    adapter: &candle_peft::Adapter,
    ty: GgufType,
    tied: bool,
    permute: Option<(usize, usize)>,
    arch: &str,
) -> Result<(Vec<TensorInfo>, Vec<Tensor>)> {
    let mut infos = Vec::new();
    let mut tensors = Vec::new();
    for (path, (a, b)) in &adapter.loras {
        let weight = format!("{path}.weight");
        let name = tensor_name(&weight).filter(|_| !(tied && path == "lm_head"));
        let Some(name) = name else {
            return Err(Error::Config(format!(
                "{}: module `{path}` has no tensor in llama.cpp's {arch} model{}",
                adapter.dir.display(),
                if tied {
                    " (its head is the tied embedding)"
                } else {
                    ""
                }
            )));
        };
        let a = a.to_dtype(DType::F32)?;
        let mut b = b.to_dtype(DType::F32)?;
        if let Some(heads) = permute {
            b = permute_qk(&weight, &b, heads)?;
        }
        for (suffix, t) in [("lora_a", a), ("lora_b", b)] {
            let shape = t.dims().to_vec();
            let matrix = ty.matrix();
            let ty = match matrix.bytes(&shape) {
                Some(_) => matrix,
                None => GgmlType::F16,
            };
            infos.push(TensorInfo {
                name: format!("{name}.{suffix}"),
                shape,
                ty,
            });
            tensors.push(t);
        }
    }
    Ok((infos, tensors))
}
