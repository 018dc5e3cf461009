//! The DPO tests' run: LoRA over the DPO fixtures' tiny Llama base.

use std::path::{Path, PathBuf};

use trainer::config::TrainConfig;
use trainer::data::DataKind;

/// A fixture file of `trainer/tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    super::fixtures(name)
}

/// Every DPO fixture record in one file `dir/pairs.jsonl` (10 records: strings,
/// conversations, implicit prompts; line 4's prompt fills 65 tokens).
pub fn write_pairs(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("pairs.jsonl");
    let text: String = [
        "strings",
        "conversational",
        "implicit_strings",
        "implicit_conversational",
    ]
    .iter()
    .map(|n| std::fs::read_to_string(fixture(&format!("dpo/{n}.jsonl"))).unwrap())
    .collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// A LoRA DPO run (r 4, lr 2e-2, batch 4 x 64, 6 steps) over the fixture's base on `data` at
/// `path` (Llama 3's tokenizer and chat template), in `out/run`.
pub fn lora_dpo_config(out: &Path, data: DataKind, path: &Path) -> TrainConfig {
    TrainConfig {
        init_from: Some(fixture("dpo/base").display().to_string()),
        data,
        data_path: Some(path.to_path_buf()),
        tokenizer_path: Some(fixture("chat/llama3/tokenizer.json")),
        objective: "dpo".into(),
        lora_r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.0,
        lr: 2e-2,
        weight_decay: 0.0,
        warmup_iters: 0,
        batch_size: 4,
        block_size: 64,
        max_iters: 6,
        lr_decay_iters: Some(6),
        eval_interval: 6,
        sample_tokens: 0,
        ..super::tiny_config(&out.join("run"))
    }
}
