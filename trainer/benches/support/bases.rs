//! The base models the LoRA benches train over: the shapes, their random weights written once
//! in bf16, and the bytes a QLoRA run holds them in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use candle_fused::nf4::Nf4Weight;
use rand_chacha::rand_core::SeedableRng;
use serde_json::{json, Value};
use trainer::lora::Nf4Settings;
use trainer::model::llama::{Family, LlamaConfig};
use trainer::model::{config_from_hf_json_file, Builder, ModelConfig, Params};

use super::root;

/// The model shapes the bench runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Shape {
    /// SmolLM2-135M: 30 layers, 576 wide, 9 / 3 heads, MLP 1536, vocab 49152, tied.
    #[value(name = "smollm2-135m")]
    Smollm2,
    /// Llama-3.2-1B: 16 layers, 2048 wide, 32 / 8 heads, MLP 8192, vocab 128256, tied (rope
    /// theta 500000; its `llama3` RoPE scaling left out, which changes no cost).
    #[value(name = "llama-1b")]
    Llama1b,
    /// Gemma 3 270M (`Gemma3ForCausalLM`): 18 layers, 640 wide, 4 heads / 1 KV head of 256,
    /// MLP 2048, vocab 262144, tied, every 6th layer full and the rest sliding (window 512):
    /// the `config.json` of `scripts/python/make_gemma3_fixtures.py`'s `shape_270m`, which
    /// `bench/torch_llama_step.py` reads too.
    #[value(name = "gemma3-270m")]
    Gemma3_270m,
}

/// The `config.json` of Gemma 3 270M's shape (transformers' parameter count of it:
/// 268,098,176, in `parameters.json` beside it).
pub fn gemma3_270m_json() -> PathBuf {
    root().join("trainer/tests/fixtures/gemma3/shape_270m/config.json")
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Smollm2 => "smollm2-135m",
            Shape::Llama1b => "llama-1b",
            Shape::Gemma3_270m => "gemma3-270m",
        }
    }

    pub fn config(self) -> anyhow::Result<Box<dyn ModelConfig>> {
        let (base, rope_theta) = match self {
            Shape::Smollm2 => (
                LlamaConfig::new(Family::Llama, 49152, 30, 576, 9, 3, 1536),
                100000.0,
            ),
            Shape::Llama1b => (
                LlamaConfig::new(Family::Llama, 128256, 16, 2048, 32, 8, 8192),
                500000.0,
            ),
            Shape::Gemma3_270m => return Ok(config_from_hf_json_file(&gemma3_270m_json())?),
        };
        Ok(Box::new(LlamaConfig {
            tie_word_embeddings: true,
            rope_theta,
            ..base
        }))
    }
}

/// Where the base model of `shape` is: `dir`, or by default under Cargo's target tmp dir.
pub fn base_path(shape: Shape, dir: Option<&Path>) -> PathBuf {
    match dir {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("lora_step_base_{}", shape.name())),
    }
}

/// Whether `dir` holds a written base model.
pub fn has_base(dir: &Path) -> bool {
    dir.join("config.json").exists() && dir.join("model.safetensors").exists()
}

/// The base model directory ([`base_path`]), written by this process if it is not there yet.
pub fn base_dir(shape: Shape, dir: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = base_path(shape, dir);
    if !has_base(&dir) {
        write_base(shape, &dir)?;
    }
    Ok(dir)
}

/// Writes the base model of `shape` to `dir` (random init, seed 0, stored in bf16). Each
/// tensor is drawn in f32 and stored in bf16 before the next is drawn (the values of
/// `Params::init` then `to_dtype`), so no f32 copy of the model is ever whole.
pub fn write_base(shape: Shape, dir: &Path) -> anyhow::Result<()> {
    eprintln!("writing the base model to {}", dir.display());
    std::fs::create_dir_all(dir)?;
    let cfg = shape.config()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mut tensors = Vec::new();
    for (name, shape) in cfg.shapes() {
        let data = cfg.init(&name, &shape, &mut rng)?;
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(DType::BF16)?;
        tensors.push((name, t));
    }
    trainer::checkpoint::save_model(dir, cfg.as_ref(), &Params::from_tensors(tensors)?)?;
    Ok(())
}

/// The `bytes` child: the base's weight bytes in bf16 and as our QLoRA run holds them (every
/// linear layer the settings quantize through `Nf4Weight::quantize`, as `nf4_on_load` does,
/// its `storage_bytes`; the rest in bf16), the projections apart from the whole.
pub fn base_bytes(shape: Shape, base: &Path, double: bool) -> anyhow::Result<Value> {
    let tensors = candle_core::safetensors::load(base.join("model.safetensors"), &Device::Cpu)?;
    let settings = Nf4Settings {
        double,
        ..Nf4Settings::default()
    };
    let bf16 = |t: &Tensor| t.elem_count() * 2;
    let quantized = std::cell::RefCell::new(BTreeMap::new());
    let quant = |path: &str, _: usize, _: usize| -> trainer::data::Result<Option<Nf4Weight>> {
        if settings.skips(path) {
            return Ok(None);
        }
        let name = format!("{path}.weight");
        let w = tensors.get(&name).context(name.clone());
        let w = w.map_err(|e| trainer::data::Error::Config(e.to_string()))?;
        let q = Nf4Weight::quantize(w, settings.double)?;
        quantized.borrow_mut().insert(name, q.storage_bytes());
        Ok(Some(q))
    };
    let source = |name: &str, _: &[usize]| -> trainer::data::Result<Tensor> {
        tensors
            .get(name)
            .cloned()
            .ok_or_else(|| trainer::data::Error::Config(format!("no tensor {name}")))
    };
    drop(
        shape
            .config()?
            .build(&Builder::root(&source).with_quant(&quant))?,
    );
    let quantized = quantized.into_inner();
    let whole_bf16: usize = tensors.values().map(bf16).sum();
    let proj_bf16: usize = quantized.keys().map(|n| bf16(&tensors[n])).sum();
    let proj_nf4: usize = quantized.values().sum();
    Ok(json!({
        "case": "bytes", "quantized_layers": quantized.len(),
        "proj_bf16_bytes": proj_bf16, "proj_nf4_bytes": proj_nf4,
        "whole_bf16_bytes": whole_bf16, "whole_qlora_bytes": whole_bf16 - proj_bf16 + proj_nf4,
    }))
}
