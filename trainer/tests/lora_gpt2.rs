//! LoRA on GPT-2 against PEFT: GPT-2's `Conv1D` layers store their weight `[in, out]`, and
//! PEFT adapts them with `fan_in_fan_out=True` (the same `lora_A [r, in]`, `lora_B [out, r]`;
//! merging adds the transposed update). The fixture `tests/fixtures/lora_gpt2/` (made with
//! transformers + PEFT by `scripts/python/make_gpt2_lora_fixtures.py`, non-zero B on every
//! `c_attn`, `c_proj` and `c_fc`) loaded over its tiny GPT-2 base gives PEFT's loss, logits
//! and LoRA gradients; merging gives PEFT's `merge_and_unload`.
//!
//! Tolerances (f32 on both sides; the script measures PEFT's f32 gradients against f64 at
//! 1.4e-6 relative): loss within 1e-5 absolute and logits within 1e-5 of their largest
//! magnitude (a few f32 roundings of values of order 1 through two layers), LoRA gradients
//! within 1e-4 relative (max abs difference over max abs value, per tensor: reductions in
//! another order, two orders above the f32-vs-f64 spread). A transposed update, a wrong
//! scaling or a missed module moves them by far more (the adapter moves the logits by ~1).

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_peft::{Adapter, LoraConfig};
use common::llama::{check_against, expected_at, Expected};
use common::{load_dir, rel, with_adapter};
use trainer::load::ModelDir;
use trainer::model::{Ctx, Kernels, Model, ModelConfig, Params};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lora_gpt2")
        .join(name)
}

fn base() -> (Box<dyn ModelConfig>, Params) {
    load_dir(&fixture("base"))
}

fn adapted() -> (Box<dyn Model>, Params, Adapter, Expected) {
    let (config, params) = base();
    let adapter = Adapter::load(&fixture("adapter"), &Device::Cpu).unwrap();
    assert!(adapter.config.fan_in_fan_out, "PEFT wrote fan_in_fan_out");
    let (model, trainable) = with_adapter(config.as_ref(), &params, &adapter);
    (
        model,
        trainable,
        adapter,
        expected_at(&fixture("expected.safetensors")),
    )
}

#[test]
fn gpt2_lora_gives_peft_loss_logits_and_gradients() {
    for kernels in [Kernels::Fused, Kernels::Reference] {
        let (model, trainable, _, e) = adapted();
        let what = format!("{kernels:?}");
        let logits = check_against(model.as_ref(), &trainable, &e, kernels, &what);
        assert!(
            rel(&logits, &e.extra["base_logits"]) > 1e-2,
            "the adapter changes the logits"
        );
        assert_eq!(
            trainable.len(),
            2 * 2 * 4,
            "c_attn, attn.c_proj, c_fc, mlp.c_proj x 2"
        );
    }
}

#[test]
fn gpt2_merge_is_peft_merge_and_unload() {
    let (config, params) = base();
    let (_, _, adapter, e) = adapted();
    let merged = trainer::lora::merge(config.as_ref(), &params, &adapter).unwrap();
    // The merged Conv1D weights are PEFT's (W + (s B A)ᵀ, stored [in, out]).
    let (_, theirs) = ModelDir::at(fixture("merged"))
        .unwrap()
        .load(&Device::Cpu)
        .unwrap();
    for (name, v) in theirs.iter() {
        let ours = merged.tensor(name).unwrap();
        let d = rel(&ours, v.as_tensor());
        assert!(
            d < 1e-6,
            "{name}: merged weight differs from PEFT's by {d:e}"
        );
    }
    let model = trainer::model::build(config.as_ref(), &merged).unwrap();
    let logits = model.forward(&e.idx, &Ctx::eval()).unwrap();
    assert!(rel(&logits, &e.extra["merged_logits"]) < 1e-5);
}

#[test]
fn our_gpt2_adapter_is_written_with_fan_in_fan_out_and_reloads() {
    let (config, params) = base();
    let lora = LoraConfig::new(4, 8.0).with_targets("c_attn,c_proj,c_fc".parse().unwrap());
    let (model, trainable, recorded) =
        trainer::lora::adapt_recorded(config.as_ref(), &params, &lora, None, DType::F32, 1)
            .unwrap();
    assert!(
        recorded.fan_in_fan_out,
        "Conv1D layers: PEFT's fan_in_fan_out"
    );
    // PEFT's initialisation (B = 0): the base model's logits.
    let e = expected_at(&fixture("expected.safetensors"));
    let logits = model.forward(&e.idx, &Ctx::eval()).unwrap();
    assert!(rel(&logits, &e.extra["base_logits"]) < 1e-5);
    let tmp = tempfile::tempdir().unwrap();
    let tensors: Vec<(String, Tensor)> = trainable
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    candle_peft::format::save(tmp.path(), &recorded, &tensors, &Default::default()).unwrap();
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(json["fan_in_fan_out"], serde_json::json!(true));
    let back = Adapter::load(tmp.path(), &Device::Cpu).unwrap();
    assert_eq!(back.config, recorded);
    trainer::lora::fit(config.as_ref(), &params, &back).unwrap();
}

/// `trainer train --lora-r 8` over a GPT-2 trained by the CLI with the default architecture:
/// adapters on every `Conv1D` (the tied head has none of its own), a checkpoint whose
/// `adapter_config.json` says `fan_in_fan_out`, a bit-exact resume, and exports (the PEFT
/// adapter as it was trained, the merged model computing what the adapted one computes).
#[test]
fn cli_lora_on_gpt2_trains_resumes_and_exports() {
    use common::{output_text, run_cli};
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let shape = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "16",
    ];
    let common_args = [
        "--data",
        "addition",
        "--batch-size",
        "4",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--peak-flops",
        "1e12",
    ];
    let run = |args: &[&str]| {
        let all: Vec<&str> = args.iter().chain(&common_args).copied().collect();
        let o = run_cli(&all, cwd);
        assert!(o.status.success(), "{}", output_text(&o));
        o
    };
    let mut base: Vec<&str> = vec!["train", "--max-iters", "2", "--out-dir", "base"];
    base.extend(shape);
    run(&base);
    let lora = |iters: &str, out: &str| {
        run(&[
            "train",
            "--init-from",
            "base",
            "--lora-r",
            "8",
            "--max-iters",
            iters,
            "--out-dir",
            out,
        ])
    };
    let o = lora("4", "lora");
    assert!(output_text(&o).contains("LoRA: r 8"), "{}", output_text(&o));
    let ckpt = cwd.join("lora/checkpoints/step-0000004");
    let adapter = Adapter::load(&ckpt, &Device::Cpu).unwrap();
    assert!(adapter.config.fan_in_fan_out, "GPT-2: fan_in_fan_out");
    let mut paths: Vec<&str> = adapter.loras.keys().map(String::as_str).collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            "transformer.h.0.attn.c_attn",
            "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj",
            "transformer.h.1.attn.c_attn",
            "transformer.h.1.attn.c_proj",
            "transformer.h.1.mlp.c_fc",
            "transformer.h.1.mlp.c_proj",
        ]
    );
    // Resume from step 2 to step 4: the same adapters, bit for bit.
    lora("2", "half");
    let o = run_cli(&["train", "--resume", "half", "--max-iters", "4"], cwd);
    assert!(o.status.success(), "{}", output_text(&o));
    let resumed = Adapter::load(&cwd.join("half/checkpoints/step-0000004"), &Device::Cpu).unwrap();
    for (path, (a, b)) in &adapter.loras {
        let (ra, rb) = &resumed.loras[path];
        assert_eq!(rel(ra, a), 0.0, "{path}: lora_A after resume");
        assert_eq!(rel(rb, b), 0.0, "{path}: lora_B after resume");
    }
    // Exports: the adapter as trained (PEFT's directory), and merged.
    let ck = ckpt.display().to_string();
    let o = run_cli(&["export", &ck, "adapter-out"], cwd);
    assert!(o.status.success(), "{}", output_text(&o));
    let exported = Adapter::load(&cwd.join("adapter-out"), &Device::Cpu).unwrap();
    assert_eq!(exported.config, adapter.config);
    let o = run_cli(&["export", "--merge", &ck, "merged-out"], cwd);
    assert!(o.status.success(), "{}", output_text(&o));
    let (config, params) = load_dir(&cwd.join("base/checkpoints/step-0000002"));
    let (adapted, _) = with_adapter(config.as_ref(), &params, &adapter);
    let merged = ModelDir::at(cwd.join("merged-out"))
        .unwrap()
        .load_model(&Device::Cpu)
        .unwrap();
    let idx = Tensor::new(&[[1u32, 4, 2, 7, 3, 0, 5, 6]], &Device::Cpu).unwrap();
    let (a, m) = (
        adapted.forward(&idx, &Ctx::eval()).unwrap(),
        merged.forward(&idx, &Ctx::eval()).unwrap(),
    );
    assert!(
        rel(&m, &a) < 1e-5,
        "the merged export computes the adapted model"
    );
}
