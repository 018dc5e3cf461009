//! The CLI keeps runs apart: the README's first command can run twice (the default run
//! directory gets a fresh name), an explicit `--out-dir` holding a run is refused unless
//! `--overwrite`, an I/O error prints the OS text once, negative values are values, and an
//! empty `out_dir` is refused.

mod common;

use common::{output_text as text, run_cli as trainer, TINY_ARGS};

#[test]
fn the_default_command_twice_keeps_both_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec!["train", "--max-iters", "2"];
    args.extend_from_slice(TINY_ARGS);
    let first = trainer(&args, tmp.path());
    assert!(first.status.success(), "{}", text(&first));
    let metrics = tmp.path().join("runs/addition/metrics.jsonl");
    let before = std::fs::read(&metrics).unwrap();
    let second = trainer(&args, tmp.path());
    assert!(second.status.success(), "{}", text(&second));
    assert!(
        text(&second).contains("runs/addition-2"),
        "{}",
        text(&second)
    );
    assert_eq!(std::fs::read(&metrics).unwrap(), before);
    assert!(tmp
        .path()
        .join("runs/addition-2/checkpoints/step-0000002")
        .is_dir());
}

#[test]
fn an_explicit_run_directory_is_never_overwritten_silently() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec!["train", "--out-dir", "mine", "--max-iters", "2"];
    args.extend_from_slice(TINY_ARGS);
    assert!(trainer(&args, tmp.path()).status.success());
    let refused = trainer(&args, tmp.path());
    let out = text(&refused);
    assert!(!refused.status.success(), "{out}");
    common::assert_mentions(&out, &["--resume mine", "--overwrite"]);
    args.push("--overwrite");
    let replaced = trainer(&args, tmp.path());
    assert!(replaced.status.success(), "{}", text(&replaced));

    // Resuming into another directory forks the run there; the original is untouched.
    let before = std::fs::read(tmp.path().join("mine/metrics.jsonl")).unwrap();
    let fork = trainer(
        &[
            "train",
            "--resume",
            "mine",
            "--out-dir",
            "fork",
            "--max-iters",
            "3",
        ],
        tmp.path(),
    );
    assert!(fork.status.success(), "{}", text(&fork));
    assert!(tmp.path().join("fork/checkpoints/step-0000003").is_dir());
    assert_eq!(
        std::fs::read(tmp.path().join("mine/metrics.jsonl")).unwrap(),
        before
    );
}

#[test]
fn io_errors_print_the_os_text_once() {
    let tmp = tempfile::tempdir().unwrap();
    let o = trainer(&["train", "--config", "missing.toml"], tmp.path());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("missing.toml"), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn negative_values_reach_the_config_check_and_an_empty_out_dir_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // `--lr -1` is a value, not an unknown flag: the config check names the field.
    let neg = trainer(&["train", "--lr", "-1"], tmp.path());
    let out = text(&neg);
    assert!(!neg.status.success(), "{out}");
    assert!(out.contains("lr must be positive, got -1"), "{out}");
    // An empty out_dir would train into the current directory.
    std::fs::write(tmp.path().join("run.toml"), "out_dir = \"\"\n").unwrap();
    let empty = trainer(&["train", "--config", "run.toml"], tmp.path());
    let out = text(&empty);
    assert!(!empty.status.success(), "{out}");
    assert!(out.contains("out_dir must name a directory"), "{out}");
    assert!(!tmp.path().join("metrics.jsonl").exists());
}

#[test]
fn default_runs_started_at_once_each_take_a_fresh_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec!["train", "--max-iters", "2"];
    args.extend_from_slice(TINY_ARGS);
    let outs: Vec<_> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..3)
            .map(|_| s.spawn(|| trainer(&args, tmp.path())))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for o in &outs {
        assert!(o.status.success(), "{}", text(o));
    }
    for dir in ["addition", "addition-2", "addition-3"] {
        let ckpt = tmp
            .path()
            .join("runs")
            .join(dir)
            .join("checkpoints/step-0000002");
        assert!(
            ckpt.is_dir(),
            "{dir}: {}",
            outs.iter().map(text).collect::<String>()
        );
    }
}
