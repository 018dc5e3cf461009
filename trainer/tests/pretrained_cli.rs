//! The `trainer` binary on models it did not train: `sample` and `eval` of a bare Hugging Face
//! model directory or hub id (with its `tokenizer.json`), `train --init-from` a hub id, and
//! `inspect` failing on weights that do not match their config. Nothing is downloaded: the
//! tests build the model directories and the hub cache themselves.

mod common;

use std::path::Path;
use std::process::Output;

use common::{output_text as text, run_cli as trainer};

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

/// A temporary directory holding a model directory `hf/` (32 positions) and the tiny corpus,
/// with the hub cache `run_cli` gives the binary (`home/hf`) holding the model as [`ID`].
fn model_and_hub() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::hf::hf_model_dir(&dir.join("hf"), 32);
    common::hf::hub_cache(&dir.join("home/hf"), ID, &dir.join("hf"));
    common::hf::corpus(dir);
    tmp
}

/// `train --init-from from` on the corpus with the model's tokenizer for `iters` steps into
/// run directory `out`; the output, which must be a success.
fn fine_tune(from: &str, iters: &str, out: &str, dir: &Path) -> String {
    ok(trainer(
        &[
            "train",
            "--init-from",
            from,
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
            iters,
            "--eval-iters",
            "1",
            "--out-dir",
            out,
        ],
        dir,
    ))
}

#[test]
fn sample_and_eval_bare_hf_models() {
    let tmp = model_and_hub();
    let dir = tmp.path();
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
        ));
        assert!(out.starts_with("the cat"), "{model}: {out}");
        assert!(out.split_whitespace().count() >= 6, "{model}: {out}");

        // A bare model has no run config: the data must come from flags.
        let err = fails(trainer(&["eval", model], dir));
        assert!(err.contains("--data-path"), "{model}: {err}");
        let out = ok(trainer(&["eval", model, "--data-path", "corpus.txt"], dir));
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
    ));
    assert!(err.contains("64") && err.contains("32"), "{err}");
    // A model directory without tokenizer.json cannot be sampled from without one.
    std::fs::remove_file(dir.join("hf/tokenizer.json")).unwrap();
    let err = fails(trainer(&["sample", "hf"], dir));
    assert!(err.contains("tokenizer.json"), "{err}");

    let help = ok(trainer(&["eval", "--help"], dir));
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
    let tmp = model_and_hub();
    let dir = tmp.path();
    fine_tune(ID, "2", "run", dir);
    let out = ok(trainer(&["eval", "run"], dir));
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
    ));
    assert!(out.starts_with("a dog"), "{out}");
    // A run can be fine-tuned further from its run directory.
    fine_tune("run", "1", "run2", dir);
}

#[test]
fn inspect_fails_on_weights_that_do_not_match_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let hf = common::hf::hf_model_dir(&dir.join("hf"), 16);
    let out = ok(trainer(&["inspect", "hf"], dir));
    assert!(out.contains("weights match the config"), "{out}");

    // config.json claims 3 layers; the weights have 2.
    let mut cfg = common::hf::config_json(&hf);
    cfg["n_layer"] = 3.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = fails(trainer(&["inspect", "hf"], dir));
    common::assert_mentions(&err, &["config.json", "missing `transformer.h.2."]);
    // n_positions 8 against 16 rows of wpe.
    cfg["n_layer"] = 2.into();
    cfg["n_positions"] = 8.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = fails(trainer(&["inspect", "hf"], dir));
    assert!(err.contains("transformer.wpe.weight"), "{err}");
}

#[test]
fn sample_checks_the_tokenizer_against_the_model() {
    let tmp = model_and_hub();
    let dir = tmp.path();
    let save = |name: &str, words: &[&str]| {
        let p = dir.join(name);
        let tok = trainer::pretrained::word_level(words, &[]).unwrap();
        tok.save(&p, false).unwrap();
        p.display().to_string()
    };
    let args = |tok: &str| -> Vec<String> {
        [
            "sample",
            "hf",
            "--tokenizer-path",
            tok,
            "--prompt",
            "the cat",
        ]
        .into_iter()
        .chain([
            "--max-new-tokens",
            "40",
            "--temperature",
            "2",
            "--top-k",
            "10",
        ])
        .map(String::from)
        .collect()
    };
    let run = |a: Vec<String>| trainer(&a.iter().map(String::as_str).collect::<Vec<_>>(), dir);
    // More ids than the model embeds (10): refused, naming the tokenizer and both sizes.
    let mut words = common::hf::WORDS.to_vec();
    words.extend(["zebra", "yak"]);
    let big = save("big.json", &words);
    let err = fails(run(args(&big)));
    common::assert_mentions(&err, &["big.json", "12 token ids", "only 10"]);
    // Fewer ids (the first 4 words): by default every id of the model is drawn (as
    // transformers), those the tokenizer lacks shown as <id:N>; with --tokenizer-ids-only the
    // model's other ids are never drawn, so every sample decodes (hot sampling over the top 10
    // would draw them).
    let small = save("small.json", &common::hf::WORDS[..4]);
    assert!(ok(run(args(&small))).contains("<id:"));
    let mut only = args(&small);
    only.push("--tokenizer-ids-only".into());
    let o = run(only);
    assert!(o.status.success(), "{}", text(&o));
    // The sample on stdout (stderr warns that 42 tokens pass the 32 learned positions).
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let words: Vec<&str> = out.split_whitespace().collect();
    // The prompt's 2 words and 40 drawn ones: an id the tokenizer lacks would decode to
    // nothing.
    assert_eq!(words.len(), 42, "{out}");
    for w in words {
        assert!(common::hf::WORDS[..4].contains(&w), "{w} in {out}");
    }
}
