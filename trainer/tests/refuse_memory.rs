//! Runs whose model cannot fit in memory are refused before anything of the model's size is
//! allocated, on every command that builds a model: a fresh `train`, `train --init-from`,
//! `train --resume`, `eval`, `sample`, `export` and `inspect`. Each refused process must end
//! with an error that names the memory it needs, and its peak resident memory must stay small
//! (the limit, 200 MB, is far below the models' sizes: tens of GB to TB).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;

/// Peak RSS the refused processes may reach, in KiB (the binary, Candle and the data only).
const MAX_RSS_KIB: i64 = 200 << 10;

/// Runs the trainer with `args` in `cwd`; returns (exit status, stderr, peak RSS in KiB).
// The child is reaped by `wait4` (which also returns its resource usage), not by `wait`.
#[allow(clippy::zombie_processes)]
fn run_measured(args: &[&str], cwd: &Path) -> (i32, String, i64) {
    let child = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(cwd)
        .env("HF_HOME", cwd.join("home/hf"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let stderr = child.stderr.unwrap();
    let text = std::io::read_to_string(stderr).unwrap();
    let mut status = 0;
    // SAFETY: plain POSIX calls on our own child, with valid out-pointers.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4");
    (libc::WEXITSTATUS(status), text, usage.ru_maxrss)
}

fn assert_refused(args: &[&str], cwd: &Path) {
    let (code, err, rss) = run_measured(args, cwd);
    assert_ne!(code, 0, "{args:?} succeeded: {err}");
    assert!(
        err.contains("GiB") && err.contains("memory is available"),
        "{args:?}: {err}"
    );
    assert!(rss < MAX_RSS_KIB, "{args:?}: peak RSS {rss} KiB");
}

/// Makes `dir/config.json` describe a GPT of 100 000 layers, 1024 wide (about 1.3e12
/// parameters), and `trainer_state.json` (if any) agree with it.
fn enlarge(dir: &Path) {
    let path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["n_layer"] = 100_000.into();
    cfg["n_embd"] = 1024.into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let state = dir.join("trainer_state.json");
    if state.exists() {
        let mut s: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
        s["config"]["n_layer"] = 100_000.into();
        s["config"]["n_embd"] = 1024.into();
        std::fs::write(&state, s.to_string()).unwrap();
    }
}

#[test]
fn models_beyond_memory_are_refused_before_they_are_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    // A fresh run: 100 000 layers of width 1024.
    assert_refused(
        &[
            "train",
            "--n-layer",
            "100000",
            "--n-embd",
            "1024",
            "--out-dir",
            "fresh",
        ],
        cwd,
    );
    assert!(!cwd.join("fresh/checkpoints").exists());

    // A small run to start from, then its checkpoint made huge (weights untouched: they must
    // never be read).
    let mut args = vec!["train", "--out-dir", "small", "--max-iters", "2"];
    args.extend_from_slice(common::TINY_ARGS);
    let out = common::run_cli(&args, cwd);
    assert!(out.status.success(), "{}", common::output_text(&out));
    let ckpt = trainer::checkpoint::resolve(&cwd.join("small")).unwrap();
    enlarge(&ckpt);
    let ckpt = ckpt.to_str().unwrap();
    assert_refused(&["train", "--init-from", ckpt, "--out-dir", "tuned"], cwd);
    assert_refused(&["train", "--resume", ckpt], cwd);
    assert_refused(&["eval", ckpt], cwd);
    assert_refused(&["sample", ckpt, "--max-new-tokens", "4"], cwd);
    // The loader every command shares refuses for the others too.
    assert_refused(&["export", ckpt, "exported"], cwd);
    assert!(!cwd.join("exported").exists());
    assert_refused(&["inspect", ckpt], cwd);
}

/// Every size the memory estimate depends on is bounded before anything proportional to it
/// is built (#32): a layer count beyond any model (`--n-layer`, a model's
/// `num_hidden_layers`) is an error naming it; a layer count that is possible but too large
/// for the width (its parameter list alone would take GBs), and adapters of a huge rank, are
/// refused by the memory check, which runs from the sizes alone. Each refused process stays
/// small. (Before: 24 GB and 7.5 GB allocated or aborted, the adapters allocated until the
/// OOM killer, the 1M-layer Llama built its 9M-name parameter list first.)
#[test]
fn every_size_is_bounded_before_it_is_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let refused_naming = |args: &[&str], what: &str| {
        let (code, err, rss) = run_measured(args, cwd);
        assert_ne!(code, 0, "{args:?} succeeded: {err}");
        assert!(err.contains(what), "{args:?}: {err}");
        assert!(rss < MAX_RSS_KIB, "{args:?}: peak RSS {rss} KiB");
    };
    refused_naming(
        &["train", "--n-layer", "1000000000", "--out-dir", "a"],
        "n_layer is 1000000000",
    );
    assert_refused(
        &[
            "train",
            "--arch",
            "llama",
            "--n-layer",
            "1000000",
            "--n-embd",
            "4096",
            "--n-head",
            "32",
            "--out-dir",
            "b",
        ],
        cwd,
    );
    // A Llama whose config.json counts 4 million layers.
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/base");
    let huge = cwd.join("huge");
    std::fs::create_dir(&huge).unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = 4_000_000.into();
    std::fs::write(huge.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        base.join("model.safetensors"),
        huge.join("model.safetensors"),
    )
    .unwrap();
    let huge = huge.to_str().unwrap();
    for args in [
        &["train", "--init-from", huge, "--out-dir", "c"][..],
        &["inspect", huge],
    ] {
        refused_naming(args, "`num_hidden_layers` is 4000000");
    }
    // Adapters of rank 10^8 over the small base: 1.4 TB of adapter state.
    std::fs::write(cwd.join("corpus.txt"), "to be or not to be\n".repeat(200)).unwrap();
    let base = base.to_str().unwrap();
    assert_refused(
        &[
            "train",
            "--init-from",
            base,
            "--lora-r",
            "100000000",
            "--data",
            "char",
            "--data-path",
            "corpus.txt",
            "--out-dir",
            "d",
        ],
        cwd,
    );
}
