//! The Llama family against Hugging Face transformers: tiny random models made by
//! `scripts/python/make_llama_fixtures.py` (every tensor randomised, biases and norm scales
//! included), with transformers' loss, logits, every gradient and a greedy continuation
//! committed under `tests/fixtures/llama/<case>/`.
//!
//! Tolerances (f32): the loss within 1e-5 relative; logits within 1e-5 of the largest
//! logit; every gradient within 1e-4 of its largest element (relative to the tensor's scale,
//! so that near-zero entries do not turn rounding noise into huge ratios). Both sides sum in
//! f32 in different orders (blocked flash attention against eager softmax, chunked loss
//! against whole logits), which moves the last few bits; a misplaced bias, norm, rotary
//! frequency or mask moves them by orders of magnitude more (each case is also run with its
//! feature disabled and must then fail these bounds).
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod common;

use std::path::Path;

use candle_core::{Device, Tensor};
use common::llama::{config_error, expected, fixture, greedy_against, Expected};
use common::rel;
use trainer::checkpoint;
use trainer::model::llama::{LlamaConfig, RopeScaling};
use trainer::model::{Builder, Ctx, Kernels, Model, ModelConfig, Params};

fn load(case: &str) -> (LlamaConfig, Params) {
    let (config, params) = checkpoint::load_model(&fixture(case), &Device::Cpu).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(case).join("config.json")).unwrap())
            .unwrap();
    let llama = LlamaConfig::from_hf_json(&json, Path::new("config.json")).unwrap();
    assert_eq!(config.to_hf_json(), llama.to_hf_json());
    (llama, params)
}

/// How far `config`'s model over `params` is from the fixture: the loss's relative error, the
/// logits' and the worst gradient's (with its name).
fn errors(
    case: &str,
    config: &LlamaConfig,
    params: &Params,
    kernels: Kernels,
    ex: &Expected,
) -> (f32, f32, (f32, String)) {
    // The builder asks only for what `config` has (a disabled feature's tensors are left
    // out; an untied head gets a copy of the embedding).
    let source = |name: &str, _: &[usize]| -> trainer::data::Result<Tensor> {
        match params.tensor(name) {
            Ok(t) => Ok(t),
            Err(_) if name == "lm_head.weight" => Ok(candle_core::Var::from_tensor(
                &params.tensor("model.embed_tokens.weight")?.detach(),
            )?
            .as_tensor()
            .clone()),
            Err(e) => Err(e),
        }
    };
    let model: Box<dyn Model> = config.build(&Builder::root(&source)).unwrap();
    let ctx = Ctx::train(0)
        .with_kernels(kernels)
        .with_rows(ex.rows.clone());
    let logits = model.forward(&ex.idx, &ctx).unwrap();
    let loss = model.loss(&ex.idx, &ex.targets, &ctx).unwrap();
    let got = loss.mean.to_scalar::<f32>().unwrap();
    let grads = loss.mean.backward().unwrap();
    let mut worst = (0f32, String::new());
    for (name, want) in &ex.grads {
        let e = match params.get(name).and_then(|v| grads.get(v)) {
            Some(g) => rel(g, want),
            None => f32::INFINITY,
        };
        if e > worst.0 || e.is_nan() {
            worst = (e, name.clone());
        }
    }
    assert!(!ex.grads.is_empty(), "{case}: no gradients in the fixture");
    (
        ((got - ex.loss) / ex.loss).abs(),
        rel(&logits, &ex.logits),
        worst,
    )
}

fn matches(case: &str, config: &LlamaConfig, params: &Params, kernels: Kernels) -> bool {
    let ex = expected(case);
    let (loss, logits, (grad, name)) = errors(case, config, params, kernels, &ex);
    eprintln!(
        "{case} {kernels}: loss {loss:.2e}, logits {logits:.2e}, worst gradient {grad:.2e} ({name})"
    );
    loss <= 1e-5 && logits <= 1e-5 && grad <= 1e-4
}

/// The case matches transformers with both kernels, and fails with `disable` applied.
fn check(case: &str, disable: impl Fn(&mut LlamaConfig)) {
    let (config, params) = load(case);
    for kernels in [Kernels::Fused, Kernels::Reference] {
        assert!(matches(case, &config, &params, kernels), "{case} {kernels}");
    }
    let mut off = config.clone();
    disable(&mut off);
    assert_ne!(off, config, "{case}: disabling changed nothing");
    assert!(
        !matches(case, &off, &params, Kernels::Fused),
        "{case}: still matches with its feature disabled"
    );
}

#[test]
fn llama_with_attention_and_mlp_biases() {
    check("llama", |c| {
        c.qkv_bias = false;
        c.o_bias = false;
    });
}

#[test]
fn llama3_rope_scaling() {
    check("llama3_rope", |c| c.rope_scaling = RopeScaling::None);
}

#[test]
fn linear_rope_scaling() {
    check("llama_linear_rope", |c| c.rope_scaling = RopeScaling::None);
}

#[test]
fn tied_embeddings() {
    check("tied", |c| c.tie_word_embeddings = false);
}

#[test]
fn qwen2_qkv_bias() {
    check("qwen2", |c| c.qkv_bias = false);
}

#[test]
fn qwen3_qk_norm() {
    check("qwen3", |c| c.qk_norm = false);
}

#[test]
fn mistral_sliding_window() {
    check("mistral_sliding", |c| {
        c.layer_windows = vec![None; c.num_hidden_layers]
    });
}

#[test]
fn packed_documents_attend_within_themselves() {
    let case = "packed";
    let (config, params) = load(case);
    for kernels in [Kernels::Fused, Kernels::Reference] {
        assert!(matches(case, &config, &params, kernels), "{kernels}");
    }
    let mut ex = expected(case);
    ex.rows.doc_ids = None;
    let (loss, _, _) = errors(case, &config, &params, Kernels::Fused, &ex);
    assert!(
        loss > 1e-3,
        "without document ids the loss still matches ({loss:.2e})"
    );
}

#[test]
fn legacy_and_v5_config_layouts_read_alike() {
    let dir = fixture("llama3_rope");
    let read = |f: &str| {
        let p = dir.join(f);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        LlamaConfig::from_hf_json(&v, &p).unwrap()
    };
    let (v5, legacy) = (read("config.json"), read("config.legacy.json"));
    assert!(matches!(v5.rope_scaling, RopeScaling::Llama3 { .. }));
    assert_eq!(
        LlamaConfig {
            torch_dtype: None,
            ..v5
        },
        LlamaConfig {
            torch_dtype: None,
            ..legacy
        }
    );
}

#[test]
fn greedy_generation_with_the_kv_cache_equals_transformers() {
    for case in [
        "llama",
        "llama3_rope",
        "tied",
        "qwen2",
        "qwen3",
        "mistral_sliding",
    ] {
        let (config, params) = load(case);
        let model = trainer::model::build(&config, &params).unwrap();
        let (got, want) =
            greedy_against(model.as_ref(), &fixture(case).join("generate.safetensors"));
        assert_eq!(got, want, "{case}");
    }
}

/// A change to a `config.json`.
type Edit = Box<dyn Fn(&mut serde_json::Value)>;

#[test]
fn bad_configs_name_the_file_and_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::read_json(&fixture("llama3_rope").join("config.legacy.json"));
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "unknown model_type",
            Box::new(|v| v["model_type"] = "gemma7".into()),
            "`model_type` is `gemma7`",
        ),
        (
            "unknown class, no model_type",
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("model_type");
                v["architectures"] = serde_json::json!(["FalconForCausalLM"]);
            }),
            "`architectures` is `FalconForCausalLM`",
        ),
        (
            "unsupported rope type",
            Box::new(|v| v["rope_scaling"]["rope_type"] = "yarn".into()),
            "`rope_scaling.rope_type`: `yarn` is not supported",
        ),
        (
            "llama3 scaling without its factor",
            Box::new(|v| {
                v["rope_scaling"].as_object_mut().unwrap().remove("factor");
            }),
            "`rope_scaling.factor`",
        ),
        (
            "another activation",
            Box::new(|v| v["hidden_act"] = "gelu".into()),
            "`hidden_act`: `gelu` is not supported",
        ),
        (
            "heads not a multiple of kv heads",
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
            "multiple of num_key_value_heads",
        ),
        (
            "missing width",
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("hidden_size");
            }),
            "`hidden_size`: missing",
        ),
        (
            "a width that is not a number",
            Box::new(|v| v["intermediate_size"] = "48".into()),
            "`intermediate_size`: must be a non-negative integer",
        ),
    ];
    for (what, edit, want) in cases {
        let e = config_error(&base, edit.as_ref(), tmp.path());
        assert!(e.contains(want), "{what}: {e}");
    }
}

#[test]
fn a_tensor_of_the_wrong_shape_or_a_missing_one_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    common::copy_model(&fixture("llama"), tmp.path());
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    v["intermediate_size"] = 40.into();
    std::fs::write(tmp.path().join("config.json"), v.to_string()).unwrap();
    let e = checkpoint::load_model(tmp.path(), &Device::Cpu)
        .expect_err("wrong shape")
        .to_string();
    common::assert_mentions(
        &e,
        &["model.layers.0.mlp.down_proj.weight", "model.safetensors"],
    );
    v["intermediate_size"] = 48.into();
    v["num_hidden_layers"] = 3.into();
    std::fs::write(tmp.path().join("config.json"), v.to_string()).unwrap();
    let e = checkpoint::load_model(tmp.path(), &Device::Cpu)
        .expect_err("missing layer")
        .to_string();
    assert!(e.contains("missing `model.layers.2."), "{e}");
}
