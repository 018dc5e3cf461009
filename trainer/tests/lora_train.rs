//! LoRA runs of the trainer over the tiny Llama base of `tests/fixtures/lora/base`: only the
//! adapters train, checkpoints hold the adapters (PEFT's files) and their optimiser state,
//! resume is bit-exact, a changed base is refused, and every command loads a LoRA checkpoint
//! as the merged model.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{assert_same_steps, finish, lora_base, lora_config, weights};
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::load::ModelDir;
use trainer::train::Trainer;

#[test]
fn only_adapters_train_and_resume_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = lora_config(tmp.path(), &lora_base());
    let t = Trainer::new(cfg.clone()).unwrap();
    // all-linear on 2 layers: 7 projections, A and B each; the optimiser holds only those.
    assert_eq!(t.params.len(), 28);
    assert!(t
        .params
        .iter()
        .all(|(n, _)| n.starts_with("base_model.model.")));
    let (steps, end) = finish(t);
    assert!(
        steps.last().unwrap().loss < steps[0].loss,
        "the adapters learn"
    );
    let ckpt = tmp.path().join("run/checkpoints/step-0000006");
    let mut files: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "adapter_config.json",
            "adapter_model.safetensors",
            "amp.safetensors",
            "manifest.json",
            "optimizer.safetensors",
            "trainer_state.json"
        ]
    );
    // Half the run, then resume from its checkpoint at step 3: the same steps and weights.
    let tmp2 = tempfile::tempdir().unwrap();
    let half = TrainConfig {
        max_iters: 3,
        ..lora_config(tmp2.path(), &lora_base())
    };
    let (resumed, t) = common::split_run(half, 6);
    assert_same_steps(&steps, &resumed, "LoRA resume");
    assert_eq!(end, weights(&t), "the same adapters after resuming");
}

#[test]
fn a_lora_checkpoint_loads_as_the_merged_model_over_its_base() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::trained_model_gap(lora_config(tmp.path(), &lora_base()));
    // Merged vs unmerged: f32 rounding of W + s B A only.
    assert!(d < 1e-5, "{d}");
}

#[test]
fn resuming_over_a_changed_base_is_refused() {
    let (tmp, base) = common::temp_join("base");
    common::copy_model(&lora_base(), &base);
    let cfg = TrainConfig {
        max_iters: 3,
        ..lora_config(tmp.path(), &base)
    };
    common::train(cfg);
    // Another base under the same path: one weight changed.
    let path = base.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let w = t["model.norm.weight"].clone();
    t.insert("model.norm.weight".into(), (w + 1.0).unwrap());
    candle_core::safetensors::save(&t, &path).unwrap();
    let run = tmp.path().join("run");
    let e = Trainer::resume(&run, |c| c.max_iters = 6)
        .err()
        .expect("must refuse")
        .to_string();
    common::assert_mentions(&e, &["made on the base", "differ in tensor values"]);
    // Loading it for inference is refused alike.
    let e = ModelDir::open(&run.display().to_string())
        .unwrap()
        .load_model(&Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("differ in tensor values"), "{e}");
}

#[test]
fn a_peft_adapter_continues_training_and_its_settings_are_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = lora_base().join("../adapter_rslora");
    let cfg = TrainConfig {
        adapter: Some(adapter),
        lora_r: 0,
        max_iters: 2,
        ..lora_config(tmp.path(), &lora_base())
    };
    let t = common::train(cfg);
    assert_eq!(t.config.lora_r, 8);
    assert!(t.config.rslora);
    assert_eq!(t.config.lora_alpha, 16.0);
    let saved = candle_peft::Adapter::load(
        &tmp.path().join("run/checkpoints/step-0000002"),
        &Device::Cpu,
    )
    .unwrap();
    assert!(saved.config.use_rslora && saved.config.r == 8);
    assert_eq!(saved.loras.len(), 14);
}

#[test]
fn lora_needs_a_base_and_takes_gpt2() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        init_from: None,
        ..lora_config(tmp.path(), &lora_base())
    };
    let e = Trainer::new(cfg).err().unwrap().to_string();
    assert!(e.contains("--init-from"), "{e}");
    // GPT-2 (Conv1D weights) takes LoRA with PEFT's fan_in_fan_out (tests/lora_gpt2.rs):
    // four Conv1D layers per block, A and B each.
    let (_keep, gpt_dir, _) = common::tiny_run(|c| c.max_iters = 1);
    let cfg = TrainConfig {
        init_from: Some(gpt_dir.display().to_string()),
        data: DataKind::Addition,
        data_path: None,
        ..lora_config(tmp.path(), &lora_base())
    };
    let t = Trainer::new(cfg).unwrap();
    assert_eq!(t.params.len(), 2 * 4 * 2);
}

#[test]
fn a_bf16_base_stays_bf16_and_gets_no_gradient() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        dtype: trainer::config::Precision::Bf16,
        max_iters: 2,
        ..lora_config(tmp.path(), &lora_base())
    };
    let t = common::train(cfg);
    let links = t.model.links();
    let ids: Vec<_> = t.params.iter().map(|(_, v)| v.as_tensor().id()).collect();
    let frozen: Vec<Tensor> = links
        .iter()
        .flat_map(|l| l.params())
        .filter(|w| !ids.contains(&w.id()))
        .collect();
    assert!(!frozen.is_empty());
    assert!(frozen.iter().all(|w| w.dtype() == DType::BF16));
    assert!(t.params.iter().all(|(_, v)| v.dtype() == DType::F32));
}

#[test]
fn lora_runs_under_remat_and_pipeline_like_the_plain_step() {
    // Adapter dropout is keyed by (seed, site, row) like the model's: a recomputed block and a
    // pipeline microbatch draw the plain step's masks.
    let run = |set: &dyn Fn(&mut TrainConfig)| {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = TrainConfig {
            max_iters: 3,
            ..lora_config(tmp.path(), &lora_base())
        };
        set(&mut cfg);
        let (steps, w) = finish(Trainer::new(cfg).unwrap());
        (steps, w)
    };
    let plain = run(&|_| {});
    let remat = run(&|c| c.remat = "every:1".parse().unwrap());
    assert_same_steps(&plain.0, &remat.0, "LoRA with remat");
    assert_eq!(
        plain.1, remat.1,
        "remat recomputes the same adapters' outputs"
    );
    let piped = run(&|c| {
        c.pipeline_stages = 2;
        c.microbatches = 2;
    });
    for (a, b) in plain.0.iter().zip(&piped.0) {
        let rel = (a.loss - b.loss).abs() / a.loss;
        assert!(rel < 1e-5, "step {}: {} vs {}", a.step, a.loss, b.loss);
    }
}
