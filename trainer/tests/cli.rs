//! The `trainer` binary end to end: train, inspect, eval, sample, resume, and its errors.

mod common;

use common::{output_text as text, run_cli as trainer};

#[test]
fn train_inspect_eval_sample_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = common::tiny_cli_run(dir);
    assert!(out.contains("addition accuracy"), "{out}");
    assert!(out.contains("== done =="), "{out}");
    assert!(dir
        .join("run/checkpoints/step-0000003/model.safetensors")
        .is_file());
    assert!(dir.join("run/metrics.jsonl").is_file());
    assert!(dir.join("run/loss.svg").is_file());

    let o = trainer(&["inspect", "run"], dir);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    for want in [
        "transformer.h.0.attn.c_attn.weight",
        "[16, 48]",
        "F32",
        "parameters",
        "step        3",
        "weights match the config",
    ] {
        assert!(out.contains(want), "inspect output lacks {want:?}:\n{out}");
    }

    let o = trainer(&["eval", "run"], dir);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("val loss"), "{}", text(&o));

    let o = trainer(
        &[
            "sample",
            "run",
            "--prompt",
            "12+34=",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        dir,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("12+34="));

    let o = trainer(&["train", "--resume", "run", "--max-iters", "5"], dir);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("at step 3"), "{}", text(&o));
    assert!(dir.join("run/checkpoints/step-0000005").is_dir());
}

#[test]
fn errors_are_one_clear_line_and_exit_nonzero() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cases: [(&[&str], &str); 5] = [
        (&["train", "--n-head", "3"], "divisible"),
        (
            &["train", "--data", "char", "--data-path", "missing.txt"],
            "missing.txt",
        ),
        (&["train", "--config", "nope.toml"], "nope.toml"),
        (&["inspect", "nowhere"], "nowhere"),
        (&["train", "--device", "tpu"], "device"),
    ];
    for (args, want) in cases {
        let o = trainer(args, dir);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("error:") && err.contains(want),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn help_lists_every_subcommand_and_config_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let o = trainer(&["--help"], tmp.path());
    let out = text(&o);
    for sub in ["train", "sample", "eval", "inspect"] {
        assert!(out.contains(sub), "{out}");
    }
    let o = trainer(&["train", "--help"], tmp.path());
    let out = text(&o);
    let cfg = trainer::config::TrainConfig::default();
    let toml = cfg.to_toml();
    for line in toml.lines() {
        if let Some((key, _)) = line.split_once(" = ") {
            let flag = format!("--{}", key.trim().replace('_', "-"));
            assert!(out.contains(&flag), "train --help lacks {flag}");
        }
    }
    assert!(out.contains("--resume") && out.contains("--config"));
}
