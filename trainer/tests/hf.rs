//! Hugging Face compatibility: GPT-2 parameter names, loading GPT2Model-style files, and
//! finding a model in a local hub cache that the test builds (no network).

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use candle_core::{Device, Tensor};
use common::values;
use trainer::checkpoint::{self, io};
use trainer::model::gpt2::{Gpt, GptConfig};
use trainer::model::{ModelConfig, Params};

/// The 148 tensor names of Hugging Face's `GPT2LMHeadModel` for GPT-2 small (its
/// `state_dict()` minus the `attn.bias` buffers and the tied `lm_head.weight`), with shapes.
fn hf_gpt2_small() -> HashMap<String, Vec<usize>> {
    let mut m = HashMap::new();
    m.insert("transformer.wte.weight".to_string(), vec![50257, 768]);
    m.insert("transformer.wpe.weight".to_string(), vec![1024, 768]);
    // Every other module has a weight and a bias as long as the weight's last dimension
    // (LayerNorm: its scale; `Conv1D`: stored `[in, out]`).
    let mut module = |name: String, weight: Vec<usize>| {
        m.insert(format!("{name}.bias"), vec![weight[weight.len() - 1]]);
        m.insert(format!("{name}.weight"), weight);
    };
    module("transformer.ln_f".into(), vec![768]);
    for i in 0..12 {
        for (n, weight) in [
            ("ln_1", vec![768]),
            ("attn.c_attn", vec![768, 2304]),
            ("attn.c_proj", vec![768, 768]),
            ("ln_2", vec![768]),
            ("mlp.c_fc", vec![768, 3072]),
            ("mlp.c_proj", vec![3072, 768]),
        ] {
            module(format!("transformer.h.{i}.{n}"), weight);
        }
    }
    m
}

#[test]
fn names_and_shapes_are_those_of_hf_gpt2() {
    let ours: HashMap<String, Vec<usize>> = GptConfig::gpt2().shapes().into_iter().collect();
    assert_eq!(ours, hf_gpt2_small());
    let n: usize = ours.values().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(n, 124_439_808); // GPT-2 small, tied head counted once
    assert_eq!(GptConfig::gpt2().num_params(), n);
}

fn tiny() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        block_size: 8,
        vocab_size: 11,
        dropout: 0.0,
        bias: true,
        ..GptConfig::default()
    }
}

/// Rewrites a model directory the way `GPT2Model.save_pretrained` names tensors (no
/// `transformer.` prefix, with the causal-mask buffers) and as f16.
fn write_transformers_style(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    let loaded = io::load_safetensors(&src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (name, t) in loaded.tensors {
        let short = name.trim_start_matches("transformer.").to_string();
        tensors.push((short, t.to_dtype(candle_core::DType::F16).unwrap()));
    }
    for i in 0..2 {
        let mask = Tensor::ones((1, 1, 8, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        tensors.push((format!("h.{i}.attn.bias"), mask));
    }
    io::save_safetensors(&dst.join("model.safetensors"), &tensors, None).unwrap();
    fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
}

/// A fresh [`tiny`] GPT (initialised with `seed`) saved as a model directory at `dir`.
fn saved_tiny(dir: &Path, seed: u64) -> (Gpt, Params) {
    let (model, params) = Gpt::new(&tiny(), seed, &Device::Cpu).unwrap();
    checkpoint::save_model(dir, &tiny(), &params).unwrap();
    (model, params)
}

#[test]
fn loads_transformers_style_files_and_matches_outputs() {
    let (tmp, ours) = common::temp_join("ours");
    let (model, _) = saved_tiny(&ours, 3);
    let hf = tmp.path().join("hf");
    write_transformers_style(&ours, &hf);

    let (cfg, loaded) = checkpoint::load_model(&hf, &Device::Cpu).unwrap();
    assert_eq!(cfg.to_hf_json(), tiny().to_hf_json());
    let reloaded = trainer::model::build(cfg.as_ref(), &loaded).unwrap();
    let idx = Tensor::new(&[[1u32, 5, 7, 2]], &Device::Cpu).unwrap();
    let a = model.forward(&idx, &trainer::model::Ctx::eval()).unwrap();
    let b = reloaded
        .forward(&idx, &trainer::model::Ctx::eval())
        .unwrap();
    // The f16 round trip loses ~3 decimal digits of the weights. Compared on the host: a NaN
    // anywhere but element 0 would vanish in Candle's `abs().max_all()`.
    let (a, b) = (values::<f32>(&a), values::<f32>(&b));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x.is_finite() && y.is_finite() && (x - y).abs() < 1e-2,
            "logit {i}: {x} vs {y}"
        );
    }
}

#[test]
fn finds_models_in_a_local_hub_cache() {
    let (tmp, model) = common::temp_join("model");
    let (_, params) = saved_tiny(&model, 4);
    let snap = common::hf::hub_cache(tmp.path(), "test-org/tiny-gpt2", &model);

    let cache = hf_hub::Cache::new(tmp.path().join("hub"));
    let dir = trainer::hub::snapshot_dir(&cache, "test-org/tiny-gpt2").unwrap();
    assert_eq!(dir, snap);
    let (cfg, loaded) = checkpoint::load_model(&dir, &Device::Cpu).unwrap();
    assert_eq!(cfg.to_hf_json(), tiny().to_hf_json());
    assert_eq!(loaded.len(), params.len());

    let err = trainer::hub::snapshot_dir(&cache, "test-org/other").unwrap_err();
    assert!(err.to_string().contains("test-org/other"), "{err}");
}

#[test]
fn special_token_ids_are_read_and_written_as_transformers_does() {
    let (_tmp, path) = common::temp_join("config.json");
    let read = |json: serde_json::Value| {
        fs::write(&path, json.to_string()).unwrap();
        GptConfig::from_hf_json_file(&path).unwrap()
    };
    let mut json = tiny().to_hf_json();
    // Written explicitly, as null when the vocabulary has no such token.
    assert_eq!(json["eos_token_id"], serde_json::Value::Null);
    assert_eq!(read(json.clone()), tiny());
    json["bos_token_id"] = 3.into();
    json["eos_token_id"] = 4.into();
    let cfg = read(json.clone());
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id), (Some(3), Some(4)));
    assert_eq!(cfg.to_hf_json()["eos_token_id"], 4);
    // Missing: transformers' GPT2Config default, 50256, where the vocabulary has that id.
    let obj = json.as_object_mut().unwrap();
    obj.remove("bos_token_id");
    obj.remove("eos_token_id");
    assert_eq!(read(json.clone()).eos_token_id, None); // 11 ids
    json["vocab_size"] = 50257.into();
    let cfg = read(json.clone());
    assert_eq!(
        (cfg.bos_token_id, cfg.eos_token_id),
        (Some(50256), Some(50256))
    );
    // Outside the vocabulary, or not a single id: no such token.
    json["vocab_size"] = 11.into();
    json["eos_token_id"] = 11.into();
    json["bos_token_id"] = serde_json::json!([1, 2]);
    let cfg = read(json);
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id), (None, None));
    // A config that names an id outside its vocabulary cannot be built.
    let bad = GptConfig {
        eos_token_id: Some(11),
        ..tiny()
    };
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("eos_token_id 11"));
}
