//! The `trainer` binary on models it did not train: `sample` and `eval` of a bare Hugging Face
//! model directory or hub id (with its `tokenizer.json`), `train --init-from` a hub id, and
//! `inspect` failing on weights that do not match their config. Nothing is downloaded: the
//! tests build the model directories and the hub cache themselves.

mod common;

use std::path::Path;
use std::process::{Command, Output};

/// Runs the binary in `cwd` with `HF_HOME` and the data cache inside `home`.
fn trainer(args: &[&str], cwd: &Path, home: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(cwd)
        .env("HF_HOME", home.join("hf"))
        .env("XDG_CACHE_HOME", home.join("cache"))
        .output()
        .expect("run the trainer binary")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "{}", text(&o));
    text(&o)
}

fn fails(o: Output) -> String {
    assert!(!o.status.success(), "succeeded:\n{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(err.contains("error:"), "{err}");
    err
}

const ID: &str = "test-org/tiny-words";

#[test]
fn sample_and_eval_bare_hf_models() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let home = dir.join("home");
    common::hf::hf_model_dir(&dir.join("hf"), 32);
    common::hf::hub_cache(&home.join("hf"), ID, &dir.join("hf"));
    common::hf::corpus(dir);

    for model in ["hf", ID] {
        let out = ok(trainer(
            &[
                "sample",
                model,
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0",
            ],
            dir,
            &home,
        ));
        assert!(out.starts_with("the cat"), "{model}: {out}");
        assert!(out.split_whitespace().count() >= 6, "{model}: {out}");

        // A bare model has no run config: the data must come from flags.
        let err = fails(trainer(&["eval", model], dir, &home));
        assert!(err.contains("--data-path"), "{model}: {err}");
        let out = ok(trainer(
            &["eval", model, "--data-path", "corpus.txt"],
            dir,
            &home,
        ));
        assert!(out.contains("val loss"), "{model}: {out}");
        let out = ok(trainer(
            &[
                "eval",
                model,
                "--data-path",
                "corpus.txt",
                "--block-size",
                "8",
                "--eval-iters",
                "2",
            ],
            dir,
            &home,
        ));
        assert!(out.contains("val loss"), "{model}: {out}");
    }
    // Beyond the model's positions is an error naming both numbers.
    let err = fails(trainer(
        &[
            "eval",
            "hf",
            "--data-path",
            "corpus.txt",
            "--block-size",
            "64",
        ],
        dir,
        &home,
    ));
    assert!(err.contains("64") && err.contains("32"), "{err}");
    // A model directory without tokenizer.json cannot be sampled from without one.
    std::fs::remove_file(dir.join("hf/tokenizer.json")).unwrap();
    let err = fails(trainer(&["sample", "hf"], dir, &home));
    assert!(err.contains("tokenizer.json"), "{err}");

    let help = ok(trainer(&["eval", "--help"], dir, &home));
    for want in [
        "--data-path",
        "--data ",
        "--tokenizer-path",
        "--block-size",
        "tokenizer.json",
    ] {
        assert!(help.contains(want), "eval --help lacks {want:?}:\n{help}");
    }
}

#[test]
fn train_init_from_a_hub_id_then_sample_and_eval_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let home = dir.join("home");
    common::hf::hf_model_dir(&dir.join("hf"), 32);
    common::hf::hub_cache(&home.join("hf"), ID, &dir.join("hf"));
    common::hf::corpus(dir);
    ok(trainer(
        &[
            "train",
            "--init-from",
            ID,
            "--data",
            "tokenizer",
            "--data-path",
            "corpus.txt",
            "--tokenizer-path",
            "hf/tokenizer.json",
            "--block-size",
            "8",
            "--batch-size",
            "4",
            "--max-iters",
            "2",
            "--eval-iters",
            "1",
            "--out-dir",
            "run",
        ],
        dir,
        &home,
    ));
    let out = ok(trainer(&["eval", "run"], dir, &home));
    assert!(out.contains("step        2"), "{out}");
    let out = ok(trainer(
        &[
            "sample",
            "run",
            "--prompt",
            "a dog",
            "--max-new-tokens",
            "3",
        ],
        dir,
        &home,
    ));
    assert!(out.starts_with("a dog"), "{out}");
    // A run can be fine-tuned further from its run directory.
    ok(trainer(
        &[
            "train",
            "--init-from",
            "run",
            "--data",
            "tokenizer",
            "--data-path",
            "corpus.txt",
            "--tokenizer-path",
            "hf/tokenizer.json",
            "--block-size",
            "8",
            "--batch-size",
            "4",
            "--max-iters",
            "1",
            "--eval-iters",
            "1",
            "--out-dir",
            "run2",
        ],
        dir,
        &home,
    ));
}

#[test]
fn inspect_fails_on_weights_that_do_not_match_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let hf = common::hf::hf_model_dir(&dir.join("hf"), 16);
    let out = ok(trainer(&["inspect", "hf"], dir, dir));
    assert!(out.contains("weights match the config"), "{out}");

    // config.json claims 3 layers; the weights have 2.
    let mut cfg = common::hf::config_json(&hf);
    cfg["n_layer"] = 3.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = fails(trainer(&["inspect", "hf"], dir, dir));
    assert!(
        err.contains("config.json") && err.contains("missing `transformer.h.2."),
        "{err}"
    );
    // n_positions 8 against 16 rows of wpe.
    cfg["n_layer"] = 2.into();
    cfg["n_positions"] = 8.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = fails(trainer(&["inspect", "hf"], dir, dir));
    assert!(err.contains("transformer.wpe.weight"), "{err}");
}
