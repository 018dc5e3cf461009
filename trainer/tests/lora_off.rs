//! Adapters switched off for a forward pass (PEFT's `disable_adapter`): under
//! `Ctx::without_adapters()` every LoRA layer computes its base layer alone, and
//! `Tuning::without_adapters` puts the modules to save back to their frozen originals, so the
//! adapted model computes its base model's logits and loss exactly (the same ops on the same
//! weights), while the adapted model itself is left as it was.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_peft::Adapter;
use trainer::load::ModelDir;
use trainer::lora::{BaseIdentity, Tuning};
use trainer::model::{Ctx, Kernels, Model};

fn fixture(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The base model, the adapted one and its tuning, and the fixture's batch.
fn adapted(
    base: &str,
    adapter: &str,
    expected: &str,
) -> (
    Box<dyn Model>,
    Box<dyn Model>,
    Tuning,
    common::llama::Expected,
) {
    let (config, params) = ModelDir::at(fixture(base))
        .unwrap()
        .load(&Device::Cpu)
        .unwrap();
    let adapter = Adapter::load(&fixture(adapter), &Device::Cpu).unwrap();
    let id = BaseIdentity::of(base, config.as_ref(), &params).unwrap();
    let (model, _, tuning) = Tuning::lora(
        config.as_ref(),
        &params,
        &adapter.config,
        Some(&adapter),
        id,
        DType::F32,
        0,
    )
    .unwrap();
    let plain = trainer::model::build(config.as_ref(), &params).unwrap();
    (
        plain,
        model,
        tuning,
        common::llama::expected_at(&fixture(expected)),
    )
}

#[test]
fn adapters_off_give_the_base_logits_and_loss_with_modules_to_save_restored() {
    // LoRA on every projection plus a trained copy of lm_head (modules_to_save).
    let (plain, model, tuning, e) = adapted(
        "lora/base",
        "lora/adapter_mts",
        "lora/adapter_mts/expected.safetensors",
    );
    for kernels in [Kernels::Fused, Kernels::Reference] {
        let on = Ctx::eval().with_kernels(kernels);
        let off = on.clone().without_adapters();
        let base = plain.forward(&e.idx, &on).unwrap();
        let adapted_logits = model.forward(&e.idx, &on).unwrap();
        assert!(
            !same(&adapted_logits, &base),
            "the adapter changes the logits"
        );
        // The context alone switches the LoRA layers off, not the trained lm_head copy.
        assert!(!same(&model.forward(&e.idx, &off).unwrap(), &base));
        let view = tuning.without_adapters(model.as_ref()).unwrap();
        assert!(
            same(&view.forward(&e.idx, &off).unwrap(), &base),
            "{kernels:?}"
        );
        let (l_off, l_base) = (
            view.loss(&e.idx, &e.targets, &off).unwrap().mean,
            plain.loss(&e.idx, &e.targets, &on).unwrap().mean,
        );
        assert_eq!(
            l_off.to_scalar::<f32>().unwrap(),
            l_base.to_scalar::<f32>().unwrap()
        );
        // The adapted model is unchanged.
        assert!(same(&model.forward(&e.idx, &on).unwrap(), &adapted_logits));
    }
}

#[test]
fn gpt2_adapters_off_give_the_base_logits() {
    let (plain, model, tuning, e) = adapted(
        "lora_gpt2/base",
        "lora_gpt2/adapter",
        "lora_gpt2/expected.safetensors",
    );
    let off = Ctx::eval().without_adapters();
    let base = plain.forward(&e.idx, &Ctx::eval()).unwrap();
    assert!(same(&model.forward(&e.idx, &off).unwrap(), &base));
    let view = tuning.without_adapters(model.as_ref()).unwrap();
    assert!(same(&view.forward(&e.idx, &off).unwrap(), &base));
    assert!(!same(&model.forward(&e.idx, &Ctx::eval()).unwrap(), &base));
}
