//! Our QLoRA adapter directory loads in PEFT over the bitsandbytes model (issue #39). A
//! `--base-quant nf4` run over the tiny Llama of `tests/fixtures/lora/base` (double
//! quantization, lm_head kept: the settings `tests/fixtures/qlora/base_dq` was saved with by
//! transformers + bitsandbytes), `trainer export` of it (a PEFT adapter directory), and our
//! logits and loss of the 4-bit base plus that adapter on the QLoRA fixture batch, in f32: the
//! directory `tests/fixtures/qlora/ours/` that `scripts/python/verify_qlora.py` loads in PEFT
//! over `base_dq` (regenerated with `UPDATE_GOLDEN=1`; its README records the verification).
//! Here: regenerating gives the committed files (1e-6: the same f32 arithmetic, bits unless the
//! thread count changes a sum's order), so what PEFT verified is what the code writes today.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::llama::expected_at;
use common::{load_dir, lora_base, lora_config, max_abs};
use trainer::config::{BaseQuant, TrainConfig};
use trainer::load::ModelDir;
use trainer::lora::{nf4_on_load, read_adapter, Nf4Settings};
use trainer::model::Ctx;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qlora")
        .join(name)
}

/// Trains the QLoRA run, exports its adapter to `dir/adapter` and writes
/// `dir/expected.safetensors`: `input_ids`, `labels`, our `logits` and `loss` over the base
/// quantized on load.
fn write_ours(dir: &Path) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        base_quant: BaseQuant::Nf4,
        base_quant_double: true,
        max_iters: 3,
        eval_interval: 3,
        ..lora_config(tmp.path(), &lora_base())
    };
    common::train(cfg);
    let run = ModelDir::open(&tmp.path().join("run").display().to_string()).unwrap();
    let options = trainer::export::ExportOptions {
        force: true,
        ..Default::default()
    };
    trainer::export::export(&run, &dir.join("adapter"), &options).unwrap();

    let adapter = read_adapter(&dir.join("adapter"), &Device::Cpu).unwrap();
    let (config, base) = load_dir(&lora_base());
    let settings = Nf4Settings {
        double: true,
        ..Nf4Settings::default()
    };
    let quant = nf4_on_load(&base, &settings);
    let (model, _) = trainer::lora::adapt_quantized(
        config.as_ref(),
        &base,
        &quant,
        &adapter.config,
        Some(&adapter),
        DType::F32,
        0,
    )
    .unwrap();
    let batch = fixture("expected_dq.safetensors");
    let e = expected_at(&batch);
    let logits = model.forward(&e.idx, &Ctx::eval()).unwrap();
    let loss = model.loss(&e.idx, &e.targets, &Ctx::eval()).unwrap().mean;
    let mut fixture_batch = candle_core::safetensors::load(&batch, &Device::Cpu).unwrap();
    let out = HashMap::from([
        (
            "input_ids".to_string(),
            fixture_batch.remove("input_ids").unwrap(),
        ),
        (
            "labels".to_string(),
            fixture_batch.remove("labels").unwrap(),
        ),
        ("logits".to_string(), logits),
        ("loss".to_string(), loss),
    ]);
    candle_core::safetensors::save(&out, dir.join("expected.safetensors")).unwrap();
}

fn load(dir: &Path, file: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap()
}

/// `adapter_config.json` without `base_model_name_or_path` (the absolute path of the base
/// on the machine that wrote it).
fn adapter_config(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("adapter/adapter_config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("base_model_name_or_path");
    v
}

#[test]
fn our_qlora_adapter_matches_the_peft_verified_golden() {
    let golden = fixture("ours");
    let (_tmp, dir, update) = common::golden_target(&golden);
    std::fs::create_dir_all(&dir).unwrap();
    write_ours(&dir);
    if update {
        return;
    }
    let files = ["adapter/adapter_model.safetensors", "expected.safetensors"];
    common::assert_golden_tensors(&dir, &golden, &files);
    assert_eq!(adapter_config(&dir), adapter_config(&golden));
    // The adapter moved off zero (B starts at 0), so PEFT's check compares a real update.
    let b = load(&dir, "adapter/adapter_model.safetensors");
    let moved = b
        .iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .map(|(_, t)| max_abs(t))
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "lora_B max {moved}");
}
