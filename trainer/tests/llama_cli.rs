//! The README's Llama example, from outside: continue training a Llama-family model from a
//! local Hugging Face directory on a text file (its own tokenizer.json), sample with top-p,
//! export in bf16, and load the export; a tokenizer larger than the model's vocabulary is
//! refused naming it.

mod common;

use std::fs;
use std::path::Path;

use common::llama::fixture;
use common::{hf, output_text, run_cli};

/// A fresh temporary directory (the CLI's working directory) and, in its `model/`, the `llama`
/// fixture (vocabulary 301) with a word-level tokenizer.json (10 ids) beside it.
fn model_dir() -> (tempfile::TempDir, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    common::copy_model(&fixture("llama"), &dir);
    hf::tokenizer(&dir);
    let model = dir.to_str().unwrap().to_string();
    (tmp, model)
}

/// `trainer train` from `model` on `corpus` (8-token blocks, batches of 4) for `iters` steps,
/// evaluating every `eval`; the caller adds the rest.
fn train_args<'a>(model: &'a str, corpus: &'a Path, iters: &'a str, eval: &'a str) -> Vec<&'a str> {
    let corpus = corpus.to_str().unwrap();
    let mut args = vec!["train", "--init-from", model, "--data-path", corpus];
    args.extend(["--max-iters", iters, "--eval-interval", eval]);
    args.extend(common::words(
        "--data tokenizer --block-size 8 --batch-size 4",
    ));
    args
}

/// Runs the CLI in `cwd`, asserts it exited with status 1 and returns its output.
fn refused(args: &[&str], cwd: &Path) -> String {
    common::refusal_text(&run_cli(args, cwd))
}

/// Runs the CLI in `cwd`, asserts it succeeded and returns its output.
fn ok(args: &[&str], cwd: &Path) -> String {
    let o = run_cli(args, cwd);
    assert!(o.status.success(), "{args:?}: {}", output_text(&o));
    output_text(&o)
}

#[test]
fn continue_training_sample_and_export_a_llama() {
    let (tmp, model) = model_dir();
    let cwd = tmp.path();
    let corpus = hf::corpus(cwd);
    let run = |args: &[&str]| ok(args, cwd);
    let mut args = train_args(&model, &corpus, "6", "3");
    args.extend(["--lr", "3e-3", "--out-dir", "runs/notes"]);
    let out = run(&args);
    assert!(out.contains("llama"), "{out}");
    let state = fs::read_to_string(cwd.join("runs/notes/run.toml")).unwrap();
    common::assert_mentions(&state, &["tokenizer.json", "arch = \"llama\""]);
    let sample = run(&[
        "sample",
        "runs/notes",
        "--prompt",
        "the cat",
        "--top-p",
        "0.9",
        "--max-new-tokens",
        "5",
    ]);
    assert!(sample.contains("the cat"), "{sample}");
    run(&["export", "runs/notes", "exported", "--dtype", "bf16"]);
    let cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(cwd.join("exported/config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert!(cwd.join("exported/tokenizer.json").is_file());
    let inspect = run(&["inspect", "exported"]);
    assert!(inspect.contains("BF16"), "{inspect}");
    let bad = refused(&["sample", "runs/notes", "--top-p", "0"], cwd);
    assert!(bad.contains("--top-p"), "{bad}");
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
    let (tmp, model) = model_dir();
    let cwd = tmp.path();
    // 400 words: more ids than the model's 301 embeddings.
    let words: Vec<String> = (0..400).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let tok = trainer::pretrained::word_level(&refs, &[]).unwrap();
    tok.save(cwd.join("big.json"), false).unwrap();
    fs::write(cwd.join("text.txt"), words.join(" ")).unwrap();
    let run = ["train", "--init-from", &model, "--data", "tokenizer"];
    let data = ["--data-path", "text.txt", "--tokenizer-path", "big.json"];
    let rest = ["--block-size", "8", "--out-dir", "runs/x"];
    let text = refused(&[&run[..], &data, &rest].concat(), cwd);
    assert!(text.contains("301") && text.contains("400"), "{text}");
    let sample = [
        "sample",
        &model,
        "--tokenizer-path",
        "big.json",
        "--prompt",
        "w1",
    ];
    let text = refused(&sample, cwd);
    assert!(text.contains("big.json"), "{text}");
}

#[test]
fn lora_train_sample_and_export_adapters_or_merged() {
    let (tmp, model) = model_dir();
    let cwd = tmp.path();
    let corpus = hf::corpus(cwd);
    let train = |targets: &str, out: &str| {
        let mut args = train_args(&model, &corpus, "4", "2");
        args.extend([
            "--lora-r",
            "4",
            "--lora-alpha",
            "8",
            "--lora-targets",
            targets,
        ]);
        args.extend(["--out-dir", out]);
        run_cli(&args, cwd)
    };
    let o = train("q_proj,v_proj", "runs/lora");
    let out = output_text(&o);
    assert!(o.status.success(), "{out}");
    common::assert_mentions(&out, &["LoRA: r 4, alpha 8", "targets q_proj,v_proj"]);
    let ckpt = cwd.join("runs/lora/checkpoints/step-0000004");
    assert!(ckpt.join("adapter_model.safetensors").is_file());
    assert!(!ckpt.join("model.safetensors").exists());
    let run = |args: &[&str]| ok(args, cwd);
    let sample = run(&[
        "sample",
        "runs/lora",
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "4",
    ]);
    assert!(sample.contains("the cat"), "{sample}");
    run(&["export", "runs/lora", "adapter"]);
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    ] {
        assert!(cwd.join("adapter").join(f).is_file(), "{f}");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(cwd.join("adapter/adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["q_proj", "v_proj"])
    );
    assert_eq!(cfg["r"], 4);
    run(&["export", "runs/lora", "merged", "--merge"]);
    assert!(cwd.join("merged/model.safetensors").is_file());
    let cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(cwd.join("merged/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    // The exported adapter samples over its base (base_model_name_or_path).
    run(&[
        "sample",
        "adapter",
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "2",
    ]);
    let text = refused(&["export", "merged", "again", "--merge"], cwd);
    assert!(text.contains("holds no adapters"), "{text}");
    // A target that matches nothing is named, with the layers the model has.
    let o = train("c_attn", "runs/none");
    let text = common::refusal_text(&o);
    assert!(text.contains("c_attn") && text.contains("q_proj"), "{text}");
}
