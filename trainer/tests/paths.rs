//! Paths a run is given (#32): an `--out-dir` that is a file is refused saying so, and the
//! paths a run reads are recorded absolute, so that it resumes from any working directory;
//! `--sample-tokens` is bounded.

mod common;

use std::fs;

use common::{output_text, run_cli, TINY_ARGS};

/// `--out-dir` naming a file (or a directory inside one) says it is a file. (Before: "File
/// exists (os error 17)".)
#[test]
fn an_out_dir_that_is_a_file_is_refused_saying_so() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    fs::write(cwd.join("notes"), "not a run").unwrap();
    for out in ["notes", "notes/run"] {
        let mut args = vec!["train", "--out-dir", out, "--max-iters", "1"];
        args.extend_from_slice(TINY_ARGS);
        let o = run_cli(&args, cwd);
        let text = output_text(&o);
        assert!(!o.status.success(), "{text}");
        assert!(text.contains("notes is a file, not a directory"), "{text}");
    }
    assert_eq!(fs::read_to_string(cwd.join("notes")).unwrap(), "not a run");
}

/// A run started with a relative `--data-path` resumes from another directory: the run
/// records the path absolute. (Before: stored as typed, the resume looked for it in the
/// new working directory.)
#[test]
fn relative_paths_are_recorded_absolute_and_resume_from_elsewhere() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    fs::create_dir_all(a.join("texts")).unwrap();
    fs::create_dir_all(&b).unwrap();
    fs::write(
        a.join("texts/corpus.txt"),
        "to be or not to be\n".repeat(100),
    )
    .unwrap();
    let mut args = vec![
        "train",
        "--data",
        "char",
        "--data-path",
        "texts/corpus.txt",
        "--out-dir",
        "run",
        "--max-iters",
        "2",
    ];
    args.extend_from_slice(TINY_ARGS);
    let o = run_cli(&args, &a);
    assert!(o.status.success(), "{}", output_text(&o));
    let corpus = fs::canonicalize(a.join("texts/corpus.txt")).unwrap();
    let recorded = fs::read_to_string(a.join("run/run.toml")).unwrap();
    assert!(recorded.contains(&*corpus.to_string_lossy()), "{recorded}");
    let run = a.join("run");
    let o = run_cli(
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--max-iters",
            "3",
        ],
        &b,
    );
    assert!(o.status.success(), "{}", output_text(&o));
}

/// `--sample-tokens` beyond the bound is refused naming it. (Before: 10^12 tokens were
/// sampled at the first evaluation, for ever.)
#[test]
fn sample_tokens_and_grad_accum_are_bounded() {
    // Each grows a run's time (a sample, a step) without bound; a mistyped 10^12 would never
    // end an evaluation or log a step.
    for (flag, key) in [
        ("--sample-tokens", "sample_tokens"),
        ("--grad-accum", "grad_accum"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let mut args = vec!["train", "--out-dir", "run", flag, "1000000000000"];
        args.extend_from_slice(TINY_ARGS);
        let o = run_cli(&args, tmp.path());
        let text = output_text(&o);
        assert!(!o.status.success(), "{text}");
        assert!(text.contains(&format!("{key} is 1000000000000")), "{text}");
    }
}
