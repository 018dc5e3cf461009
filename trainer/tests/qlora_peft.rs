//! QLoRA against transformers + bitsandbytes 0.50.2 + PEFT (`tests/fixtures/qlora/`, made by
//! `scripts/python/make_qlora_fixtures.py`): the tiny Llama of `tests/fixtures/lora/base` loaded
//! in 4 bits (NF4, compute dtype f32, lm_head kept in f32), with and without double
//! quantization, saved by transformers, and PEFT's `adapter_plain` (non-zero B) trained over it.
//!
//! Shown: the saved 4-bit model reads back as bitsandbytes quantized it, and quantizing the f32
//! base on load gives the same tensors bit for bit; the step over it gives PEFT's logits (1e-5
//! of their largest magnitude), loss (1e-5 absolute) and LoRA gradients (1e-4 relative per
//! tensor), with the fused and the reference kernels: the same bounds as `lora_peft.rs` (f32 on
//! both sides, the same dequantized weights bit for bit, so only summation order differs);
//! `quantization_config`s of other kinds are refused by name.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_fused::nf4::Nf4Weight;
use candle_peft::Adapter;
use common::llama::{check_against, expected_at};
use common::{load_dir, rel};
use trainer::load::ModelDir;
use trainer::lora::{check_quantization_config, nf4_on_load, read_bnb_4bit, Nf4Settings};
use trainer::model::{Ctx, Kernels, Model, ModelConfig, Params, Quant};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `config`'s model over `base`, its projections quantized by `quant`, with the PEFT `adapter`
/// applied (f32, seed 0), and its trainable adapter tensors.
fn with_adapter_4bit(
    config: &dyn ModelConfig,
    base: &Params,
    quant: Quant<'_>,
    adapter: &Adapter,
) -> (Box<dyn Model>, Params) {
    trainer::lora::adapt_quantized(
        config,
        base,
        quant,
        &adapter.config,
        Some(adapter),
        DType::F32,
        0,
    )
    .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::U8 => t
            .to_vec1::<u8>()
            .unwrap()
            .into_iter()
            .map(u32::from)
            .collect(),
        _ => t
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect(),
    }
}

const SETTINGS: [(&str, bool); 2] = [("dq", true), ("plain", false)];

#[test]
fn saved_4bit_model_reads_back_as_quantized_on_load() {
    let (_, base) = load_dir(&fixture("lora/base"));
    for (setting, double) in SETTINGS {
        let q = read_bnb_4bit(&fixture(&format!("qlora/base_{setting}")), &Device::Cpu).unwrap();
        // 7 projections x 2 layers in 4 bits; lm_head, embeddings and norms kept.
        assert_eq!(q.layers.weights.len(), 14, "{setting}");
        assert!(!q.layers.weights.contains_key("lm_head"));
        let settings = Nf4Settings {
            double,
            ..Nf4Settings::default()
        };
        let quantize = nf4_on_load(&base, &settings);
        for (path, saved) in &q.layers.weights {
            let ours: Nf4Weight = quantize(path.as_str(), 0, 0).unwrap().unwrap();
            let (a, b) = (
                ours.to_tensors("w").unwrap(),
                saved.to_tensors("w").unwrap(),
            );
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
            for (k, t) in &a {
                assert_eq!(bits(t), bits(&b[k]), "{setting} {path}: {k}");
            }
        }
        assert!(quantize("lm_head", 0, 0).unwrap().is_none());
        for (name, v) in q.params.iter() {
            let want = base.tensor(name).unwrap();
            assert_eq!(bits(v.as_tensor()), bits(&want), "{setting} {name}");
        }
    }
}

#[test]
fn step_matches_peft_over_bitsandbytes() {
    let adapter = Adapter::load(&fixture("lora/adapter_plain"), &Device::Cpu).unwrap();
    let (config, base) = load_dir(&fixture("lora/base"));
    for (setting, double) in SETTINGS {
        let q = read_bnb_4bit(&fixture(&format!("qlora/base_{setting}")), &Device::Cpu).unwrap();
        let quant = |p: &str, i: usize, o: usize| q.quant(p, i, o);
        let (model, trainable) = with_adapter_4bit(q.config.as_ref(), &q.params, &quant, &adapter);
        let e = expected_at(&fixture(&format!("qlora/expected_{setting}.safetensors")));
        for kernels in [Kernels::Fused, Kernels::Reference] {
            let what = format!("{setting} {kernels:?}");
            check_against(model.as_ref(), &trainable, &e, kernels, &what);
        }
        // The f32 base quantized on load, layer by layer: the same model, the same loss bits.
        let settings = Nf4Settings {
            double,
            ..Nf4Settings::default()
        };
        let quant = nf4_on_load(&base, &settings);
        let (on_load, _) = with_adapter_4bit(config.as_ref(), &base, &quant, &adapter);
        let loss = |m: &dyn trainer::model::Model| {
            let l = m.loss(&e.idx, &e.targets, &Ctx::eval()).unwrap();
            l.mean.to_scalar::<f32>().unwrap().to_bits()
        };
        assert_eq!(
            loss(on_load.as_ref()),
            loss(model.as_ref()),
            "{setting}: on load"
        );
    }
}

#[test]
fn bf16_step_is_close_to_pefts() {
    // PEFT with bnb_4bit_compute_dtype bfloat16 runs only the 4-bit layers in bf16 (the rest
    // of the model in f32); ours with a bf16 context runs the whole model in bf16 (the frozen
    // weights and the adapters cast, f32 sums inside the fused ops). Both round the
    // dequantized weights and the projections' inputs to bf16 (8 significant bits: 3.9e-3 a
    // rounding); ours rounds the norms, attention and residual stream too. Measured: loss
    // 2.6e-4 relative, gradients up to 8.8e-2 of their largest magnitude, while PEFT's own
    // bf16 step differs from its f32 step by up to 5.5e-2 and ours from that by 5.7e-2. Bounds:
    // loss 1e-2, each gradient 1.5e-1 (a wrong scaling or a missed module moves them by ~1).
    let adapter = Adapter::load(&fixture("lora/adapter_plain"), &Device::Cpu).unwrap();
    let q = read_bnb_4bit(&fixture("qlora/base_dq"), &Device::Cpu).unwrap();
    let quant = |p: &str, i: usize, o: usize| q.quant(p, i, o);
    let (model, trainable) = with_adapter_4bit(q.config.as_ref(), &q.params, &quant, &adapter);
    let bf16 = model
        .map(&|t: &Tensor| match t.dtype() {
            DType::F32 => t.to_dtype(DType::BF16),
            _ => Ok(t.clone()),
        })
        .unwrap();
    let e = expected_at(&fixture("qlora/expected_dq_bf16.safetensors"));
    let ctx = Ctx::eval().with_dtype(DType::BF16);
    let loss = bf16.loss(&e.idx, &e.targets, &ctx).unwrap();
    let l = loss
        .mean
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let dl = ((l - e.loss) / e.loss).abs();
    let grads = loss.mean.backward().unwrap();
    let mut worst = 0f32;
    for (name, var) in trainable.iter() {
        let g = grads.get(var.as_tensor()).expect("a gradient");
        worst = worst.max(rel(&g.to_dtype(DType::F32).unwrap(), &e.grads[name]));
    }
    assert!(dl < 1e-2, "loss {l} vs PEFT's {}", e.loss);
    assert!(worst < 1.5e-1, "a gradient differs by {worst:e}");
}

#[test]
fn bf16_compute_dtype_is_pefts_linear4bit() {
    // `--base-compute-dtype bf16` over the f32 model: as bitsandbytes' `Linear4bit` with
    // bnb_4bit_compute_dtype bfloat16, only the 4-bit products run in bf16 (input, bias and
    // dequantized weight rounded to it, f32 sums, the output rounded once and widened back);
    // the adapters and the rest of the model compute in f32, as PEFT's. Both sides round the
    // same bf16 operands; their products differ only by the order of the f32 sums, which can
    // move an output across a bf16 rounding boundary (3.9e-3 of it). Measured: loss 7e-8
    // relative (0 with the reference kernels), gradients 2.3e-3 of their largest magnitude
    // (vs 2.6e-4 and 8.8e-2 with the whole model in bf16, bf16_step_is_close_to_pefts).
    // Bounds: loss 1e-5, gradients 1e-2; computing the 4-bit products in f32 instead is off
    // by 1.4e-3 in the loss and 5.6e-2 in a gradient.
    let adapter = Adapter::load(&fixture("lora/adapter_plain"), &Device::Cpu).unwrap();
    let mut q = read_bnb_4bit(&fixture("qlora/base_dq"), &Device::Cpu).unwrap();
    assert_eq!(q.layers.compute_dtype, Some(DType::F32), "as saved");
    q.layers.compute_dtype = Some(DType::BF16);
    let config = q.config.as_ref();
    let base = trainer::lora::BaseIdentity::of("base_dq", config, &q.params).unwrap();
    let (model, trainable, _) = trainer::lora::Tuning::lora_over(
        config,
        &q.params,
        &adapter.config,
        Some(&adapter),
        base,
        DType::F32,
        Some(&q.layers),
        0,
    )
    .unwrap();
    let e = expected_at(&fixture("qlora/expected_dq_bf16.safetensors"));
    for kernels in [Kernels::Fused, Kernels::Reference] {
        let ctx = Ctx::eval().with_kernels(kernels);
        let loss = model.loss(&e.idx, &e.targets, &ctx).unwrap();
        assert_eq!(loss.mean.dtype(), DType::F32);
        let l = loss.mean.to_scalar::<f32>().unwrap();
        let dl = ((l - e.loss) / e.loss).abs();
        let grads = loss.mean.backward().unwrap();
        let mut worst = 0f32;
        for (name, var) in trainable.iter() {
            let g = grads.get(var.as_tensor()).expect("a gradient");
            worst = worst.max(rel(g, &e.grads[name]));
        }
        assert!(
            dl < 1e-5,
            "{kernels:?}: loss {l} vs PEFT's {} ({dl:e})",
            e.loss
        );
        assert!(worst < 1e-2, "{kernels:?}: a gradient differs by {worst:e}");
    }
}

#[test]
fn merge_is_pefts_merge_and_unload_on_a_4bit_base() {
    // PEFT: dequantize, add s B A, quantize again (the model stays 4-bit); the fixture holds
    // each projection of that dequantized to bf16. Ours: the same steps over the f32 base
    // (what `export --merge` of a QLoRA run writes), rounded to bf16: equal values, up to the
    // f32 sum of the update (r = 8 products, which could move a value across an NF4 midpoint;
    // none does here).
    let (config, base) = load_dir(&fixture("lora/base"));
    let adapter = Adapter::load(&fixture("lora/adapter_plain"), &Device::Cpu).unwrap();
    let (deq, merged) = common::merged_4bit(config.as_ref(), &base, &adapter);
    let want = candle_core::safetensors::load(fixture("qlora/merged_dq.safetensors"), &Device::Cpu)
        .unwrap();
    assert_eq!(want.len(), 14);
    for (name, w) in &want {
        let ours = merged.tensor(name).unwrap().to_dtype(DType::BF16).unwrap();
        let d = rel(
            &ours.to_dtype(DType::F32).unwrap(),
            &w.to_dtype(DType::F32).unwrap(),
        );
        assert!(d <= 1e-6, "{name}: {d:e} from PEFT's merge_and_unload");
        // The update was applied (the merged weight is not the base's).
        let before = deq.tensor(name).unwrap().to_dtype(DType::BF16).unwrap();
        assert_ne!(bits(&before), bits(&ours), "{name}");
    }
}

#[test]
fn quantized_checkpoints_are_not_read_as_plain_models() {
    let e = ModelDir::at(fixture("qlora/base_dq"))
        .unwrap()
        .load(&Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4-bit (NF4)") && e.contains("base_dq"), "{e}");
    // A GPTQ checkpoint, by name.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("lora/base/model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("lora/base/config.json")).unwrap())
            .unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let e = ModelDir::at(tmp.path().to_path_buf())
        .unwrap()
        .load(&Device::Cpu)
        .unwrap_err()
        .to_string();
    common::assert_mentions(&e, &["quant_method `gptq`", "config.json"]);
}

#[test]
fn other_quantizations_are_refused_by_name() {
    let path = Path::new("config.json");
    let cfg = |q: serde_json::Value| serde_json::json!({ "quantization_config": q });
    let ok = cfg(
        serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true,
        "bnb_4bit_quant_type": "nf4", "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_use_double_quant": true}),
    );
    assert_eq!(check_quantization_config(path, &ok).unwrap(), Some(true));
    assert_eq!(
        check_quantization_config(path, &serde_json::json!({})).unwrap(),
        None
    );
    for (q, name) in [
        (
            serde_json::json!({"quant_method": "gptq", "bits": 4}),
            "gptq",
        ),
        (serde_json::json!({"quant_method": "awq", "bits": 4}), "awq"),
        (
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_8bit": true}),
            "8-bit",
        ),
        (
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true,
                "bnb_4bit_quant_type": "fp4"}),
            "fp4",
        ),
        (
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true,
                "bnb_4bit_quant_type": "nf4", "bnb_4bit_quant_storage": "bfloat16"}),
            "bfloat16",
        ),
    ] {
        let e = check_quantization_config(path, &cfg(q))
            .unwrap_err()
            .to_string();
        assert!(e.contains(name) && e.contains("config.json"), "{e}");
    }
}

#[test]
fn a_quant_state_that_does_not_fit_its_layer_is_named() {
    // up_proj of layer 0 is [128, 64]; its quant state saying [64, 128] (as many values, so
    // the tensors' lengths still agree) is refused naming the file and the quant state.
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("qlora/base_dq");
    std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
    let mut tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4";
    let json = String::from_utf8(tensors[name].to_vec1::<u8>().unwrap()).unwrap();
    assert!(json.contains("\"shape\": [128, 64]"), "{json}");
    let bytes = json.replace("[128, 64]", "[64, 128]").into_bytes();
    let n = bytes.len();
    tensors.insert(
        name.into(),
        Tensor::from_vec(bytes, n, &Device::Cpu).unwrap(),
    );
    let file = tmp.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let q = read_bnb_4bit(tmp.path(), &Device::Cpu).unwrap();
    let adapter = Adapter::load(&fixture("lora/adapter_plain"), &Device::Cpu).unwrap();
    let quant = |p: &str, i: usize, o: usize| q.quant(p, i, o);
    let e = match trainer::lora::adapt_quantized(
        q.config.as_ref(),
        &q.params,
        &quant,
        &adapter.config,
        Some(&adapter),
        DType::F32,
        0,
    ) {
        Ok(_) => panic!("a quant state of another shape is refused"),
        Err(e) => e.to_string(),
    };
    common::assert_mentions(&e, &[name, "model.safetensors", "[64, 128]"]);
}
