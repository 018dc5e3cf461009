//! Gemma 3 (text) against Hugging Face transformers: tiny random `Gemma3ForCausalLM`s made by
//! `scripts/python/make_gemma3_fixtures.py` (every tensor randomised, every RMSNorm weight
//! included, 12 tokens against a sliding window of 4, distinct local and global RoPE bases),
//! one per `config.json` layout, with transformers' loss, logits, every gradient and a greedy
//! continuation committed under `tests/fixtures/gemma3/<case>/`.
//!
//! Tolerances (f32), as for the Llama family (`llama_hf.rs`): the loss within 1e-5 relative;
//! logits within 1e-5 of the largest; every gradient within 1e-4 of its largest element. Both
//! sides sum in f32 in different orders (blocked attention against eager softmax, chunked loss
//! against whole logits, tanh GELU as composite ops against torch's kernel); each feature
//! switched off moves the loss by far more than its tolerance (`each_feature_moves_the_loss`).
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod common;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use common::llama::{config_error, expected_at, greedy_against, Expected};
use common::rel;
use trainer::checkpoint;
use trainer::model::gemma3::{Gemma3Config, LayerType};
use trainer::model::layers::{GateAct, RopeScaling};
use trainer::model::{Builder, Ctx, Kernels, Model, ModelConfig, Params};

const CASES: [&str; 2] = ["gemma3", "gemma3_legacy"];

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gemma3")
        .join(case)
}

fn read_config(path: &Path) -> Gemma3Config {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    Gemma3Config::from_hf_json(&v, path).unwrap()
}

/// The case's config (read through the registry, as every loading path does) and weights.
fn load(case: &str) -> (Gemma3Config, Params) {
    let (config, params) = checkpoint::load_model(&fixture(case), &Device::Cpu).unwrap();
    let gemma = read_config(&fixture(case).join("config.json"));
    assert_eq!(config.to_hf_json(), gemma.to_hf_json());
    (gemma, params)
}

/// `config`'s model over `params`, each tensor passed through `map` (a feature switched off
/// by its weights), its logits and loss of the fixture's batch.
fn run(
    config: &Gemma3Config,
    params: &Params,
    map: &dyn Fn(&str, Tensor) -> Tensor,
    kernels: Kernels,
    ex: &Expected,
) -> (Tensor, Tensor) {
    let source = |name: &str, _: &[usize]| -> trainer::data::Result<Tensor> {
        Ok(map(name, params.tensor(name)?))
    };
    let model: Box<dyn Model> = config.build(&Builder::root(&source)).unwrap();
    let ctx = Ctx::train(0).with_kernels(kernels);
    let logits = model.forward(&ex.idx, &ctx).unwrap();
    let loss = model.loss(&ex.idx, &ex.targets, &ctx).unwrap().mean;
    (logits, loss)
}

fn same(_: &str, t: Tensor) -> Tensor {
    t
}

#[test]
fn loss_logits_and_every_gradient_match_transformers() {
    for case in CASES {
        let (config, params) = load(case);
        let ex = expected_at(&fixture(case).join("expected.safetensors"));
        assert!(
            !ex.grads.is_empty() && ex.grads.len() == params.len(),
            "{case}"
        );
        for kernels in [Kernels::Fused, Kernels::Reference] {
            let (logits, loss) = run(&config, &params, &same, kernels, &ex);
            let l = loss.to_scalar::<f32>().unwrap();
            let dl = ((l - ex.loss) / ex.loss).abs();
            let dlogits = rel(&logits, &ex.logits);
            let grads = loss.backward().unwrap();
            let mut worst = (0f32, String::new());
            for (name, want) in &ex.grads {
                let g = grads.get(params.get(name).unwrap()).expect(name);
                let e = rel(g, want);
                if e > worst.0 || e.is_nan() {
                    worst = (e, name.clone());
                }
            }
            eprintln!(
                "{case} {kernels}: loss {dl:.2e}, logits {dlogits:.2e}, worst gradient {:.2e} ({})",
                worst.0, worst.1
            );
            assert!(dl <= 1e-5 && dlogits <= 1e-5, "{case} {kernels}");
            assert!(worst.0 <= 1e-4, "{case} {kernels}: {} {}", worst.1, worst.0);
        }
    }
}

/// A feature switched off: by the config, or by the weights (a model computing `x * w` is
/// Gemma's over the weights `w - 1`; one without the embedding scale is Gemma's over an
/// embedding divided by it, the untied head unchanged).
type Off = (
    &'static str,
    &'static str,
    Box<dyn Fn(&mut Gemma3Config)>,
    Box<dyn Fn(&str, Tensor) -> Tensor>,
);

/// A feature switched off by the config alone (`edit`), over the same weights.
fn by_config(
    case: &'static str,
    what: &'static str,
    edit: impl Fn(&mut Gemma3Config) + 'static,
) -> Off {
    (case, what, Box::new(edit), Box::new(same))
}

#[test]
fn each_feature_moves_the_loss() {
    let keep = |_: &mut Gemma3Config| {};
    let offs: Vec<Off> = vec![
        (
            "gemma3",
            "norms scale by w, not 1 + w",
            Box::new(keep),
            Box::new(|n: &str, t: Tensor| {
                if n.ends_with("norm.weight") {
                    (t - 1.0).unwrap()
                } else {
                    t
                }
            }),
        ),
        (
            "gemma3_legacy",
            "no embedding scale",
            Box::new(keep),
            Box::new(|n: &str, t: Tensor| {
                if n == "model.embed_tokens.weight" {
                    (t / 32f64.sqrt()).unwrap()
                } else {
                    t
                }
            }),
        ),
        by_config("gemma3", "scores scaled by head_dim^-0.5", |c| {
            c.query_pre_attn_scalar = c.head_dim
        }),
        by_config("gemma3", "no sliding window", |c| c.sliding_window = 1000),
        by_config("gemma3", "the global RoPE base on sliding layers", |c| {
            c.rope_local_base_freq = c.rope_theta
        }),
        by_config("gemma3_legacy", "no RoPE scaling on full layers", |c| {
            c.rope_scaling = RopeScaling::None
        }),
        by_config("gemma3", "SwiGLU for GeGLU", |c| {
            c.hidden_activation = GateAct::Silu
        }),
        by_config("gemma3_legacy", "no final soft-cap", |c| {
            c.final_logit_softcapping = None
        }),
    ];
    for (case, what, edit, map) in offs {
        let (mut config, params) = load(case);
        edit(&mut config);
        let ex = expected_at(&fixture(case).join("expected.safetensors"));
        let (_, loss) = run(&config, &params, map.as_ref(), Kernels::Fused, &ex);
        let d = ((loss.to_scalar::<f32>().unwrap() - ex.loss) / ex.loss).abs();
        eprintln!("{case}, {what}: the loss moves by {d:.2e} (relative)");
        assert!(d > 1e-3, "{case}: {what} leaves the loss within {d:e}");
    }
}

#[test]
fn greedy_generation_with_the_kv_cache_equals_transformers() {
    for case in CASES {
        let (config, params) = load(case);
        let model = trainer::model::build(&config, &params).unwrap();
        let (got, want) =
            greedy_against(model.as_ref(), &fixture(case).join("generate.safetensors"));
        // 5 + 20 tokens through layers with a window of 4: the sliding layers' caches are cut.
        assert!(got.len() + 5 > 2 * config.sliding_window + 1);
        assert_eq!(got, want, "{case}");
    }
}

#[test]
fn both_config_layouts_read_as_transformers_reads_them() {
    let new = read_config(&fixture("gemma3").join("config.json"));
    let legacy = read_config(&fixture("gemma3_legacy").join("config.json"));
    use LayerType::{Full, Sliding};
    for c in [&new, &legacy] {
        assert_eq!(c.layer_types, [Sliding, Full, Sliding]);
        assert_eq!((c.rope_theta, c.rope_local_base_freq), (1000.0, 20.0));
        assert_eq!(
            (c.sliding_window, c.query_pre_attn_scalar, c.head_dim),
            (4, 24, 16)
        );
        assert_eq!(c.local_rope_scaling, RopeScaling::None);
        // written as transformers 5.x writes it, read back the same
        let path = Path::new("config.json");
        assert_eq!(
            &Gemma3Config::from_hf_json(&c.to_hf_json(), path).unwrap(),
            c
        );
    }
    assert_eq!(new.rope_scaling, RopeScaling::None);
    assert_eq!(legacy.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    assert_eq!(
        (new.attn_logit_softcapping, new.final_logit_softcapping),
        (None, None)
    );
    assert_eq!(
        (
            legacy.attn_logit_softcapping,
            legacy.final_logit_softcapping
        ),
        (Some(2.0), Some(3.0))
    );
    assert!(new.tie_word_embeddings && !legacy.tie_word_embeddings);
    // The legacy fixture sets `attn_logit_softcapping` 2, which transformers' Gemma 3 reads but
    // does not apply (nor do we): its loss matches with it set.
    // transformers' own save of the legacy config (5.x layout) reads to the same model
    let saved = read_config(&fixture("gemma3_legacy").join("config.saved.json"));
    assert_eq!(
        saved,
        Gemma3Config {
            torch_dtype: saved.torch_dtype.clone(),
            ..legacy
        }
    );
}

#[test]
fn unsupported_options_are_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::read_json(&fixture("gemma3").join("config.json"));
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["use_bidirectional_attention"] = true.into()),
            "`use_bidirectional_attention`",
        ),
        (
            Box::new(|v| v["hidden_activation"] = "gelu".into()),
            "`hidden_activation`: `gelu` is not supported",
        ),
        (
            Box::new(|v| v["rope_parameters"]["sliding_attention"]["rope_type"] = "yarn".into()),
            "`rope_parameters.sliding_attention`",
        ),
        (
            Box::new(|v| v["layer_types"][1] = "chunked_attention".into()),
            "`layer_types`: unsupported",
        ),
        (
            Box::new(|v| v["sliding_window"] = serde_json::Value::Null),
            "`sliding_window`: null",
        ),
        (
            Box::new(|v| v["final_logit_softcapping"] = "30".into()),
            "`final_logit_softcapping`",
        ),
    ];
    for (edit, want) in cases {
        let e = config_error(&base, edit.as_ref(), tmp.path());
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn export_loads_back_equal() {
    use trainer::export::{self, ExportOptions};
    use trainer::pretrained::ModelDir;
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = tmp.path().join(case);
        let src = fixture(case);
        export::export_spec(src.to_str().unwrap(), &out, &ExportOptions::default()).unwrap();
        let (config, params) = load(case);
        let back = read_config(&out.join("config.json"));
        assert_eq!(
            back,
            Gemma3Config {
                torch_dtype: back.torch_dtype.clone(),
                ..config.clone()
            }
        );
        let model = ModelDir::open(out.to_str().unwrap())
            .unwrap()
            .load_model(&Device::Cpu)
            .unwrap();
        let ex = expected_at(&src.join("expected.safetensors"));
        let (_, want) = run(&config, &params, &same, Kernels::Fused, &ex);
        let got = model
            .loss(&ex.idx, &ex.targets, &Ctx::train(0))
            .unwrap()
            .mean;
        assert_eq!(
            got.to_scalar::<f32>().unwrap(),
            want.to_scalar::<f32>().unwrap(),
            "{case}"
        );
    }
}

#[test]
fn a_peft_lora_adapter_gives_peft_loss_logits_and_gradients() {
    use candle_peft::Adapter;
    let (config, params) = common::load_dir(&fixture("gemma3"));
    let adapter = Adapter::load(&fixture("lora"), &Device::Cpu).unwrap();
    let (model, trainable) = common::with_adapter(config.as_ref(), &params, &adapter);
    let e = expected_at(&fixture("lora").join("expected.safetensors"));
    for kernels in [Kernels::Fused, Kernels::Reference] {
        common::llama::check_against(model.as_ref(), &trainable, &e, kernels, "gemma3 lora");
    }
    // The adapter matters: the base alone is far from PEFT's logits.
    let base = trainer::model::build(config.as_ref(), &params).unwrap();
    let logits = base.forward(&e.idx, &Ctx::eval()).unwrap();
    let r = rel(&logits, &e.logits);
    assert!(r > 1e-3, "the adapter moves the logits by only {r:e}");
}

#[test]
fn a_lora_dpo_run_over_gemma_starts_at_log_2_and_learns() {
    use trainer::config::TrainConfig;
    use trainer::data::DataKind;
    use trainer::train::Trainer;
    let tmp = tempfile::tempdir().unwrap();
    // The `gemma3` fixture's shape over the DPO fixtures' tokenizer (320 ids + 5 added).
    let mut gemma = read_config(&fixture("gemma3").join("config.json"));
    gemma.vocab_size = 325;
    let (_, params) = trainer::model::init(&gemma, 5, &Device::Cpu).unwrap();
    let base = tmp.path().join("base");
    checkpoint::save_model(&base, &gemma, &params).unwrap();
    let pairs = common::dpo::write_pairs(tmp.path());
    let cfg = TrainConfig {
        init_from: Some(base.display().to_string()),
        max_iters: 8,
        lr_decay_iters: Some(8),
        eval_interval: 8,
        ..common::dpo::lora_dpo_config(tmp.path(), DataKind::Preference, &pairs)
    };
    let (steps, _) = common::finish(Trainer::new(cfg).unwrap());
    // a fresh adapter (B = 0) is the reference: every log-ratio 0, the sigmoid loss log 2
    let first = steps[0].loss;
    assert!(
        (first - std::f32::consts::LN_2).abs() < 1e-7,
        "first loss {first}"
    );
    let losses: Vec<f32> = steps.iter().map(|s| s.loss).collect();
    let margin = steps.last().unwrap().objective["rewards/margins"];
    assert!(
        margin > 0.0 && losses[losses.len() - 1] < first,
        "{losses:?}, margin {margin}"
    );
}

#[test]
fn a_gemma_3_270m_config_has_transformers_parameter_count() {
    let dir = fixture("shape_270m");
    let config = trainer::model::config_from_hf_json_file(&dir.join("config.json")).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("parameters.json")).unwrap())
            .unwrap();
    assert_eq!(
        config.num_params() as u64,
        want["parameters"].as_u64().unwrap()
    );
    let gemma = read_config(&dir.join("config.json"));
    let full = gemma.layer_types.iter().filter(|t| **t == LayerType::Full);
    assert_eq!(
        (full.count(), gemma.head_dim, gemma.sliding_window),
        (3, 256, 512)
    );
    assert_eq!((gemma.rope_theta, gemma.rope_local_base_freq), (1e6, 1e4));
    // a 2048-token context: the 15 sliding layers attend over 512 tokens only
    let (at_512, at_2048) = (config.flops_per_token(512), config.flops_per_token(2048));
    let attn = |ctx: f64| 12.0 * 4.0 * 256.0 * ctx;
    let want = attn(3.0 * 2048.0 + 15.0 * 512.0) - attn(18.0 * 512.0);
    assert!(
        ((at_2048 - at_512) - want).abs() < 1.0,
        "{at_512} {at_2048}"
    );
}
