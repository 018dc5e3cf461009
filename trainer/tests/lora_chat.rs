//! The embedded LoRA default: configs/lora_chat.toml loads, its task's held-out questions have
//! one prompt and one answer length, the committed base (data/chat-base) scores at most 10% on
//! them, and a few LoRA steps run and lower the loss.

use std::path::{Path, PathBuf};

use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::train::Trainer;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn lora_chat_config_runs_on_the_committed_base() {
    let root = repo();
    let mut cfg = TrainConfig::from_toml_file(&root.join("configs/lora_chat.toml")).unwrap();
    assert_eq!(cfg.data, DataKind::ChatTask);
    assert!(
        cfg.lora_r > 0 && cfg.lora_r <= 16,
        "LoRA r = {}",
        cfg.lora_r
    );
    assert!(cfg.modules_to_save.0.is_empty());
    // Paths in the config are relative to the repository root.
    let tmp = tempfile::tempdir().unwrap();
    cfg.init_from = Some(root.join(cfg.init_from.unwrap()).display().to_string());
    cfg.out_dir = tmp.path().join("run");
    cfg.chat_examples = 2000;
    cfg.max_iters = 4;
    cfg.eval_interval = 4;
    cfg.eval_problems = 100;
    let mut t = Trainer::new(cfg).unwrap();

    let task = t.data.task().expect("the chat task has a score");
    let problems = task.eval_problems(100);
    assert_eq!(problems.len(), 100);
    let (p0, a0) = (problems[0].0.len(), problems[0].1.len());
    assert!(problems.iter().all(|(p, a)| p.len() == p0 && a.len() == a0));
    // The base has not learned the task.
    let before = t.evaluate().unwrap();
    let score = before.score.unwrap();
    assert!(score <= 0.10, "base accuracy {score}");

    let first = t.train_step().unwrap();
    for _ in 1..4 {
        t.train_step().unwrap();
    }
    let after = t.evaluate().unwrap();
    assert!(
        after.val_loss < before.val_loss,
        "{} -> {}",
        before.val_loss,
        after.val_loss
    );
    assert!(first.loss.is_finite());
}
