//! Starting from, fine-tuning and resuming pretrained models: `init_from` a Hugging Face model
//! directory, a trainer checkpoint or run directory; the pretrained positions survive a shorter
//! training context; `config.json` names the vocabulary's own special tokens.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, IndexOp};
use common::{run_to_end, tiny_config, tiny_run, train, weights};
use tempfile::TempDir;
use trainer::checkpoint;
use trainer::config::TrainConfig;
use trainer::pretrained::{EvalRequest, ModelDir};
use trainer::train::Trainer;

/// The rows of `transformer.wpe.weight` in checkpoint or model directory `dir`.
fn wpe_rows(dir: &Path) -> Vec<Vec<f32>> {
    let loaded =
        checkpoint::io::load_safetensors(&dir.join("model.safetensors"), &Device::Cpu).unwrap();
    loaded.tensors["transformer.wpe.weight"]
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec2()
        .unwrap()
}

/// Two steps, evaluated (and checkpointed) at the second.
fn two_steps(c: &mut TrainConfig) {
    c.max_iters = 2;
    c.eval_interval = 2;
}

#[test]
fn init_from_accepts_run_and_checkpoint_directories() {
    let (tmp, first, _) = tiny_run(two_steps);
    let latest = checkpoint::resolve(&first).unwrap();
    let want = Trainer::resume(&latest, |_| {}).unwrap();
    for from in [&first, &latest] {
        let t = Trainer::new(TrainConfig {
            init_from: Some(from.display().to_string()),
            ..tiny_config(&tmp.path().join("second"))
        })
        .unwrap_or_else(|e| panic!("init_from {}: {e}", from.display()));
        assert_eq!(weights(&t), weights(&want), "from {}", from.display());
    }
    // A directory that is neither is one clear error naming it.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = Trainer::new(TrainConfig {
        init_from: Some(empty.display().to_string()),
        ..tiny_config(&tmp.path().join("third"))
    })
    .err()
    .expect("an empty directory is no model");
    assert!(e.to_string().contains("empty"), "{e}");
}

/// A Hugging Face model directory (`hf/`, 32 positions) and the tiny corpus (`data/`) in a
/// fresh temporary directory.
fn pretrained() -> (TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let hf = common::hf::hf_model_dir(&tmp.path().join("hf"), 32);
    let data = tmp.path().join("data");
    common::hf::corpus(&data);
    (tmp, hf, data)
}

/// Fine-tuning config: the tiny tokenizer corpus at a context of 8, from a model with 32
/// positions, no weight decay (so positions 8.. receive no update at all).
fn finetune(out: &Path, from: &Path, data: &Path) -> TrainConfig {
    TrainConfig {
        init_from: Some(from.display().to_string()),
        data: "tokenizer".parse().unwrap(),
        data_path: Some(data.join("corpus.txt")),
        tokenizer_path: Some(from.join("tokenizer.json")),
        block_size: 8,
        weight_decay: 0.0,
        max_iters: 2,
        eval_interval: 2,
        sample_tokens: 12,
        ..tiny_config(out)
    }
}

#[test]
fn finetuning_at_a_shorter_context_keeps_the_pretrained_positions() {
    let (tmp, hf, data) = pretrained();
    let out = tmp.path().join("ft");
    let t = train(finetune(&out, &hf, &data));
    assert_eq!(t.model.config().max_positions(), 32);
    let ckpt = checkpoint::resolve(&out).unwrap();
    let cfg = common::hf::config_json(&ckpt);
    assert_eq!(cfg["n_positions"], 32, "{cfg}");
    assert_eq!(cfg["n_ctx"], 32, "{cfg}");
    let (before, after) = (wpe_rows(&hf), wpe_rows(&ckpt));
    assert_eq!(after.len(), 32);
    assert_ne!(
        before[..8],
        after[..8],
        "the trained positions did not move"
    );
    assert_eq!(before[8..], after[8..], "untrained positions changed");
    drop(t);

    // Resume: the checkpoint's model has 32 positions, the run's context is still 8.
    let mut resumed = Trainer::resume(&out, |c| c.max_iters = 4).unwrap();
    assert_eq!(resumed.step(), 2);
    assert_eq!(resumed.config.block_size, 8);
    assert_eq!(resumed.model.config().max_positions(), 32);
    run_to_end(&mut resumed);
    let ckpt = checkpoint::resolve(&out).unwrap();
    assert!(ckpt.ends_with("step-0000004"), "{}", ckpt.display());
    assert_eq!(common::hf::config_json(&ckpt)["n_positions"], 32);
    assert!(resumed.evaluate().unwrap().val_loss.is_finite());
    // The whole pretrained context is usable after fine-tuning.
    let idx = candle_core::Tensor::zeros((1, 32), DType::U32, &Device::Cpu).unwrap();
    let logits = resumed
        .model
        .forward(&idx, &trainer::model::Ctx::eval())
        .unwrap();
    assert_eq!(logits.dims(), &[1, 32, common::hf::WORDS.len()]);
}

#[test]
fn shorter_context_trains_with_remat_and_pipeline() {
    let (tmp, hf, data) = pretrained();
    let plain = train(finetune(&tmp.path().join("plain"), &hf, &data));
    let remat = train(TrainConfig {
        remat: "all".parse().unwrap(),
        ..finetune(&tmp.path().join("remat"), &hf, &data)
    });
    // Recomputation is bit-exact: the same weights as the plain run.
    assert_eq!(weights(&plain), weights(&remat));
    // The plan is costed at the training context (8 tokens), not the model's 32 positions.
    let costs = remat
        .model
        .config()
        .chain_costs(4, 8, DType::F32, remat.config.kernels);
    let want = candle_remat::Policy::EveryK(1).plan(&costs).unwrap();
    assert_eq!(remat.remat_plan(), Some(&want));
    let pipe = train(TrainConfig {
        pipeline_stages: 2,
        microbatches: 2,
        sample_tokens: 0,
        ..finetune(&tmp.path().join("pipe"), &hf, &data)
    });
    assert_eq!(pipe.model.config().max_positions(), 32);
    let w = pipe.params.tensor("transformer.wpe.weight").unwrap();
    assert_eq!(w.dims(), &[32, 16]);
    let row: Vec<f32> = w.i(31).unwrap().to_vec1().unwrap();
    assert_eq!(row, wpe_rows(&hf)[31]);
}

#[test]
fn config_json_names_the_vocabularys_special_tokens() {
    let (tmp, data) = common::temp_join("data");
    let corpus = common::hf::corpus(&data);
    let tok = common::hf::tokenizer(&data);
    // A fresh model over the tiny tokenizer: `<|endoftext|>` is id 9, not GPT-2's 50256.
    let out = tmp.path().join("tok");
    train(TrainConfig {
        data: "tokenizer".parse().unwrap(),
        data_path: Some(corpus.clone()),
        tokenizer_path: Some(tok),
        block_size: 8,
        max_iters: 1,
        ..tiny_config(&out)
    });
    let cfg = common::hf::config_json(&checkpoint::resolve(&out).unwrap());
    assert_eq!(cfg["eos_token_id"], common::hf::ENDOFTEXT, "{cfg}");
    assert_eq!(cfg["bos_token_id"], common::hf::ENDOFTEXT, "{cfg}");
    // A character vocabulary has no such token: the ids are written as null (transformers'
    // GPT2Config would otherwise default them to 50256).
    let out = tmp.path().join("char");
    train(TrainConfig {
        data: "char".parse().unwrap(),
        data_path: Some(corpus),
        block_size: 8,
        max_iters: 1,
        ..tiny_config(&out)
    });
    let cfg = common::hf::config_json(&checkpoint::resolve(&out).unwrap());
    for key in ["eos_token_id", "bos_token_id"] {
        assert_eq!(cfg.get(key), Some(&serde_json::Value::Null), "{key}: {cfg}");
    }
}

#[test]
fn eval_of_a_checkpoint_is_the_runs_own_evaluation() {
    let (tmp, out, t) = tiny_run(two_steps);
    let want = t.evaluate().unwrap();
    let ckpt = checkpoint::resolve(&out).unwrap();
    for spec in [&out, &ckpt] {
        let model = ModelDir::open(&spec.display().to_string()).unwrap();
        assert_eq!(EvalRequest::default().evaluate(&model).unwrap(), want);
    }
    // Flags replace single settings of the run.
    let model = ModelDir::open(&out.display().to_string()).unwrap();
    let shorter = EvalRequest {
        block_size: Some(12),
        eval_problems: Some(0),
        ..EvalRequest::default()
    };
    let got = shorter.evaluate(&model).unwrap();
    assert_eq!((got.step, got.score), (2, None));
    assert_ne!(got.val_loss, want.val_loss);

    // The same weights without the trainer state: a bare model, which needs its data given.
    let bare = tmp.path().join("bare");
    common::copy_model(&ckpt, &bare);
    let model = ModelDir::open(&bare.display().to_string()).unwrap();
    assert!(model.run.is_none());
    let e = EvalRequest::default().evaluate(&model).unwrap_err();
    assert!(e.to_string().contains("--data-path"), "{e}");
    // The run's data, given by flags, gives the run's numbers again (same seed and batches).
    let as_run = EvalRequest {
        data: Some("addition".parse().unwrap()),
        block_size: Some(16),
        batch_size: Some(4),
        eval_iters: Some(2),
        eval_problems: Some(16),
        ..EvalRequest::default()
    };
    let got = as_run.evaluate(&model).unwrap();
    assert_eq!(
        (got.train_loss, got.val_loss, got.score),
        (want.train_loss, want.val_loss, want.score)
    );
    assert_eq!(got.step, 0);
}
