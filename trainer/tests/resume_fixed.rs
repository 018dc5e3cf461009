//! What `--resume` may change (issue #32): every config field is classified, where it is
//! declared, as one a resumed run applies or one fixed by the run; a changed fixed field is
//! refused, naming it with both values and the run, before anything is written or pruned.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::Device;
use common::{output_text, run_cli, run_to_end, snapshot, tiny_config, tiny_run};
use trainer::config::{OnResume, TrainConfig};
use trainer::data::DataKind;
use trainer::train::Trainer;

/// The fields a resumed run applies. Changing the class of a field, or adding a field, must
/// update this list or [`FIXED`]: the classification is reviewed here.
const MAY_CHANGE: &[&str] = &[
    "out_dir",
    "device",
    "cache_dir",
    "max_iters",
    "optimizer_options",
    "lr",
    "min_lr",
    "warmup_iters",
    "lr_decay_iters",
    "weight_decay",
    "beta1",
    "beta2",
    "remat",
    "dtype",
    "loss_scale",
    "pipeline_stages",
    "microbatches",
    "schedule",
    "pipeline_threads",
    "pipeline_devices",
    "zero",
    "kernels",
    "tf32",
    "triton_kernels",
    "chunked_loss",
    "peak_flops",
    "grad_clip",
    "eval_interval",
    "eval_iters",
    "eval_problems",
    "keep_last",
    "sample_tokens",
    "base_dtype",
];

/// The fields fixed by the run.
const FIXED: &[&str] = &[
    "seed",
    "data",
    "data_path",
    "data_order",
    "doc_mask",
    "tokenizer_path",
    "packing",
    "completion_only",
    "chat_task",
    "chat_examples",
    "val_fraction",
    "digits",
    "init_from",
    "arch",
    "model_json",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "dropout",
    "bias",
    "n_kv_head",
    "mlp_hidden",
    "rope_theta",
    "tie_embeddings",
    "batch_size",
    "grad_accum",
    "objective",
    "objective_options",
    "optimizer",
    "dpo_loss",
    "dpo_beta",
    "dpo_label_smoothing",
    "dpo_precompute_ref",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "rslora",
    "modules_to_save",
    "base_quant",
    "base_quant_double",
    "base_quant_skip",
    "base_compute_dtype",
    "adapter",
    "other_base",
];

#[test]
fn every_config_field_is_classified_for_resume() {
    // The serialised config's keys are every field (None included, as null).
    let json = serde_json::to_value(TrainConfig::default()).unwrap();
    let keys: BTreeSet<String> = json.as_object().unwrap().keys().cloned().collect();
    let may: BTreeSet<String> = MAY_CHANGE.iter().map(|s| s.to_string()).collect();
    let fixed: BTreeSet<String> = FIXED.iter().map(|s| s.to_string()).collect();
    assert!(may.is_disjoint(&fixed), "{:?}", may.intersection(&fixed));
    let listed: BTreeSet<String> = may.union(&fixed).cloned().collect();
    let unlisted: Vec<_> = keys.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "config fields in neither MAY_CHANGE nor FIXED (classify them): {unlisted:?}"
    );
    let stale: Vec<_> = listed.difference(&keys).collect();
    assert!(stale.is_empty(), "not config fields: {stale:?}");
    // The config's own classification (generated from its field list) agrees.
    assert_eq!(TrainConfig::FIELDS.len(), keys.len());
    for (name, class) in TrainConfig::FIELDS {
        let want = if may.contains(*name) {
            OnResume::may_change
        } else {
            OnResume::fixed
        };
        assert_eq!(*class, want, "{name}");
    }
}

/// Every file of the run directory, byte for byte.
fn state_of(run: &Path) -> Vec<(String, Vec<u8>)> {
    snapshot(run)
}

fn refusal(run: &Path, set: impl FnOnce(&mut TrainConfig)) -> String {
    match Trainer::resume(run, set) {
        Ok(_) => panic!("resume accepted the change"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn fixed_fields_changed_on_resume_are_refused_naming_them() {
    let (tmp, run, _) = tiny_run(|c| {
        c.max_iters = 4;
        c.keep_last = 1;
    });
    let other = tmp.path().join("other-model");
    type Set = Box<dyn Fn(&mut TrainConfig)>;
    let cases: Vec<(&str, Set)> = vec![
        ("rope_theta", Box::new(|c| c.rope_theta = 500.0)),
        ("n_kv_head", Box::new(|c| c.n_kv_head = 1)),
        ("mlp_hidden", Box::new(|c| c.mlp_hidden = 64)),
        ("arch", Box::new(|c| c.arch = "llama".parse().unwrap())),
        ("tie_embeddings", Box::new(|c| c.tie_embeddings = false)),
        (
            "model_json",
            Box::new(move |c| c.model_json = Some(PathBuf::from("config.json"))),
        ),
        (
            "init_from",
            Box::new(move |c| c.init_from = Some(other.display().to_string())),
        ),
        ("lora_dropout", Box::new(|c| c.lora_dropout = 0.2)),
        (
            "data_order",
            Box::new(|c| c.data_order = "epoch".parse().unwrap()),
        ),
        ("dropout", Box::new(|c| c.dropout = 0.3)),
        ("grad_accum", Box::new(|c| c.grad_accum = 2)),
        ("dpo_beta", Box::new(|c| c.dpo_beta = 0.5)),
        ("optimizer", Box::new(|c| c.optimizer = "sgd".into())),
        (
            "chat_task",
            Box::new(|c| c.chat_task = "basics".parse().unwrap()),
        ),
    ];
    let before = state_of(&run);
    // Every case is tried; the failures are reported together.
    let mut wrong = Vec::new();
    for (name, set) in cases {
        let r = Trainer::resume(&run, |c| {
            c.max_iters = 8;
            set(c);
        });
        match r.map(|_| ()).map_err(|e| e.to_string()) {
            Ok(()) => wrong.push(format!("{name}: accepted")),
            Err(e) => {
                let named = e.contains(&format!("cannot change {name} (")) && e.contains("->");
                let dir = e.contains(&run.display().to_string());
                if !named || !dir || e.contains("max_iters") {
                    wrong.push(format!("{name}: {e}"));
                }
            }
        }
        if before != state_of(&run) {
            wrong.push(format!("{name}: the run directory changed"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Several at once are all named, with both values.
    let e = refusal(&run, |c| {
        c.rope_theta = 500.0;
        c.n_kv_head = 1;
    });
    common::assert_mentions(&e, &["rope_theta (10000.0 -> 500.0)", "n_kv_head (0 -> 1)"]);
}

#[test]
fn may_change_fields_apply_on_resume() {
    let (_tmp, run, t) = tiny_run(|c| c.max_iters = 4);
    drop(t);
    let mut t = Trainer::resume(&run, |c| {
        c.max_iters = 6;
        c.lr = 5e-4;
        c.min_lr = 5e-4;
        c.warmup_iters = 0;
        c.eval_interval = 1;
        c.keep_last = 1;
        c.grad_clip = 0.5;
    })
    .unwrap();
    assert_eq!(t.config.grad_clip, 0.5);
    assert_eq!(t.config.eval_interval, 1);
    let steps = run_to_end(&mut t);
    assert_eq!(steps.len(), 2);
    for s in &steps {
        assert_eq!(s.lr, 5e-4, "step {}: the new lr is not applied", s.step);
    }
    let state: trainer::checkpoint::TrainerState = trainer::checkpoint::io::read_json(
        &run.join("checkpoints/step-0000006/trainer_state.json"),
    )
    .unwrap();
    assert_eq!(state.config.max_iters, 6);
    assert_eq!(state.config.lr, 5e-4);
    // eval_interval 1 checkpointed step 5, keep_last 1 pruned it (step 6 is the latest).
    assert!(!run.join("checkpoints/step-0000005").exists());
}

#[test]
fn cli_resume_with_a_changed_model_field_exits_nonzero_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    common::tiny_cli_run(cwd);
    let run = cwd.join("run");
    let before = state_of(&run);
    let o = run_cli(
        &[
            "train",
            "--resume",
            "run",
            "--max-iters",
            "6",
            "--rope-theta",
            "500",
        ],
        cwd,
    );
    let text = output_text(&o);
    assert!(!o.status.success(), "accepted: {text}");
    assert!(text.contains("rope_theta"), "{text}");
    assert!(before == state_of(&run), "the run directory changed");
}

/// The tiny Llama base of the LoRA tests, copied to `dir`.
fn copy_base(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/base");
    common::copy_model(&src, dir);
    dir.to_path_buf()
}

#[test]
fn lora_resume_onto_another_base_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let base = copy_base(&tmp.path().join("base"));
    // Another base: one weight changed.
    let other = copy_base(&tmp.path().join("other"));
    let path = other.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let n = w["model.norm.weight"].clone();
    w.insert("model.norm.weight".into(), (n + 1.0).unwrap());
    candle_core::safetensors::save(&w, &path).unwrap();

    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt"),
    )
    .unwrap();
    let corpus = tmp.path().join("corpus.txt");
    std::fs::write(&corpus, &text[..20_000]).unwrap();
    let run = tmp.path().join("run");
    common::train(TrainConfig {
        init_from: Some(base.display().to_string()),
        data: DataKind::Char,
        data_path: Some(corpus),
        lora_r: 4,
        lora_alpha: 8.0,
        max_iters: 4,
        lr_decay_iters: Some(4),
        eval_interval: 2,
        keep_last: 1,
        ..tiny_config(&run)
    });
    let before = state_of(&run);
    let o = run_cli(
        &[
            "train",
            "--resume",
            "run",
            "--init-from",
            "other",
            "--max-iters",
            "8",
        ],
        tmp.path(),
    );
    let out = output_text(&o);
    assert!(!o.status.success(), "accepted: {out}");
    assert!(out.contains("init_from") && out.contains("other"), "{out}");
    assert!(before == state_of(&run), "the run directory changed");
    // The run still resumes on its own base.
    let t = Trainer::resume(&run, |c| c.max_iters = 6).unwrap();
    assert_eq!(t.step(), 4);
}
