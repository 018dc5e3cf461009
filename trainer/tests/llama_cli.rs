//! The README's Llama example, from outside: continue training a Llama-family model from a
//! local Hugging Face directory on a text file (its own tokenizer.json), sample with top-p,
//! export in bf16, and load the export; a tokenizer larger than the model's vocabulary is
//! refused naming it.

mod common;

use std::fs;
use std::path::Path;

use common::llama::fixture;
use common::{hf, output_text, run_cli};

/// The `llama` fixture (vocabulary 301) with a word-level tokenizer.json (10 ids) beside it.
fn model_dir(dir: &Path) -> String {
    fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        fs::copy(fixture("llama").join(f), dir.join(f)).unwrap();
    }
    hf::tokenizer(dir);
    dir.to_str().unwrap().to_string()
}

#[test]
fn continue_training_sample_and_export_a_llama() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let model = model_dir(&cwd.join("model"));
    let corpus = hf::corpus(cwd);
    let run = |args: &[&str]| {
        let o = run_cli(args, cwd);
        assert!(o.status.success(), "{args:?}: {}", output_text(&o));
        output_text(&o)
    };
    let out = run(&[
        "train",
        "--init-from",
        &model,
        "--data",
        "tokenizer",
        "--data-path",
        corpus.to_str().unwrap(),
        "--block-size",
        "8",
        "--batch-size",
        "4",
        "--max-iters",
        "6",
        "--eval-interval",
        "3",
        "--lr",
        "3e-3",
        "--out-dir",
        "runs/notes",
    ]);
    assert!(out.contains("llama"), "{out}");
    let state = fs::read_to_string(cwd.join("runs/notes/run.toml")).unwrap();
    assert!(
        state.contains("tokenizer.json") && state.contains("arch = \"llama\""),
        "{state}"
    );
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
    let bad = run_cli(&["sample", "runs/notes", "--top-p", "0"], cwd);
    assert_eq!(bad.status.code(), Some(1), "{}", output_text(&bad));
    assert!(output_text(&bad).contains("--top-p"));
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let model = model_dir(&cwd.join("model"));
    // 400 words: more ids than the model's 301 embeddings.
    let words: Vec<String> = (0..400).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let tok = trainer::pretrained::word_level(&refs, &[]).unwrap();
    tok.save(cwd.join("big.json"), false).unwrap();
    fs::write(cwd.join("text.txt"), words.join(" ")).unwrap();
    let o = run_cli(
        &[
            "train",
            "--init-from",
            &model,
            "--data",
            "tokenizer",
            "--data-path",
            "text.txt",
            "--tokenizer-path",
            "big.json",
            "--block-size",
            "8",
            "--out-dir",
            "runs/x",
        ],
        cwd,
    );
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("301") && text.contains("400"), "{text}");
    let o = run_cli(
        &[
            "sample",
            &model,
            "--tokenizer-path",
            "big.json",
            "--prompt",
            "w1",
        ],
        cwd,
    );
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("big.json"), "{text}");
}

#[test]
fn lora_train_sample_and_export_adapters_or_merged() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let model = model_dir(&cwd.join("model"));
    let corpus = hf::corpus(cwd);
    let train = |targets: &str, out: &str| {
        run_cli(
            &[
                "train",
                "--init-from",
                &model,
                "--data",
                "tokenizer",
                "--data-path",
                corpus.to_str().unwrap(),
                "--block-size",
                "8",
                "--batch-size",
                "4",
                "--max-iters",
                "4",
                "--eval-interval",
                "2",
                "--lora-r",
                "4",
                "--lora-alpha",
                "8",
                "--lora-targets",
                targets,
                "--out-dir",
                out,
            ],
            cwd,
        )
    };
    let o = train("q_proj,v_proj", "runs/lora");
    let out = output_text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("LoRA: r 4, alpha 8") && out.contains("targets q_proj,v_proj"),
        "{out}"
    );
    let ckpt = cwd.join("runs/lora/checkpoints/step-0000004");
    assert!(ckpt.join("adapter_model.safetensors").is_file());
    assert!(!ckpt.join("model.safetensors").exists());
    let run = |args: &[&str]| {
        let o = run_cli(args, cwd);
        assert!(o.status.success(), "{args:?}: {}", output_text(&o));
        output_text(&o)
    };
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
    let o = run_cli(&["export", "merged", "again", "--merge"], cwd);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        output_text(&o).contains("holds no adapters"),
        "{}",
        output_text(&o)
    );
    // A target that matches nothing is named, with the layers the model has.
    let o = train("c_attn", "runs/none");
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("c_attn") && text.contains("q_proj"), "{text}");
}
