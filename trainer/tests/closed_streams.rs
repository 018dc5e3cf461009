//! A closed stdout or stderr (`trainer train ... 2>&1 | head -3`, `| head -1`) never stops a
//! run or its signals: the run trains to the end, saves its checkpoint and metrics and exits
//! as usual; SIGTERM still stops it with a checkpoint and a second signal still exits at once.
//! (Before src/term.rs, the first print to the closed stream panicked: exit 101, nothing saved.)
#![cfg(unix)]

mod common;

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::process::{signal, wait_for_steps};
use common::TINY_ARGS;
use trainer::train::Trainer;

#[derive(Clone, Copy, Debug)]
enum Closed {
    Stdout,
    Stderr,
}

/// Starts `trainer train` with one of its streams a pipe whose reader is already gone; the
/// other goes to a file.
fn spawn(dir: &Path, closed: Closed, max_iters: &str) -> Child {
    let mut args = vec!["train", "--out-dir", "run"];
    args.extend_from_slice(TINY_ARGS);
    // After TINY_ARGS: the later flag wins.
    args.extend_from_slice(&["--max-iters", max_iters]);
    let file = || Stdio::from(std::fs::File::create(dir.join("other.txt")).unwrap());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainer"));
    cmd.args(&args)
        .current_dir(dir)
        .env("HF_HOME", dir.join("home/hf"))
        .env("XDG_CACHE_HOME", dir.join("home/cache"))
        .stdin(Stdio::null());
    match closed {
        Closed::Stdout => cmd.stdout(Stdio::piped()).stderr(file()),
        Closed::Stderr => cmd.stdout(file()).stderr(Stdio::piped()),
    };
    let mut child = cmd.spawn().expect("start the trainer binary");
    // Close the read end at once: every write to that stream now fails with EPIPE.
    drop(child.stdout.take());
    drop(child.stderr.take());
    child
}

fn wait(child: &mut Child, dir: &Path) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!("the trainer did not exit within 180 s\n{}", other(dir));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the trainer wrote to the stream that stayed open.
fn other(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("other.txt")).unwrap_or_default()
}

#[test]
fn a_closed_stream_never_stops_a_run() {
    for closed in [Closed::Stderr, Closed::Stdout] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut child = spawn(dir, closed, "6");
        let status = wait(&mut child, dir);
        assert!(
            status.success(),
            "closed {closed:?}: {status}\n{}",
            other(dir)
        );
        let run = dir.join("run");
        assert!(
            run.join("checkpoints/step-0000006/model.safetensors")
                .is_file(),
            "closed {closed:?}: no final checkpoint"
        );
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert!(metrics.contains("\"step\":6"), "{metrics}");
        assert!(run.join("loss.svg").is_file());
        assert_eq!(Trainer::resume(&run, |_| {}).unwrap().step(), 6);
    }
}

#[test]
fn a_closed_stderr_keeps_the_signals() {
    // SIGTERM: the step finishes, a checkpoint is saved, the run exits 75.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut child = spawn(dir, Closed::Stderr, "1000000");
    wait_for_steps(&dir.join("run/metrics.jsonl"), 3, &mut child, || other(dir));
    signal(&child, libc::SIGTERM);
    let status = wait(&mut child, dir);
    assert_eq!(status.code(), Some(75), "{status}\n{}", other(dir));
    assert!(other(dir).contains("== interrupted =="), "{}", other(dir));
    let t = Trainer::resume(&dir.join("run"), |_| {}).unwrap();
    assert!(t.step() >= 3, "checkpoint at step {}", t.step());

    // The signal thread survives its message to the closed stderr: a second signal still
    // exits at once.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut child = spawn(dir, Closed::Stderr, "1000000");
    wait_for_steps(&dir.join("run/metrics.jsonl"), 2, &mut child, || other(dir));
    // Two different signals: two of the same kind may merge into one before delivery.
    signal(&child, libc::SIGTERM);
    signal(&child, libc::SIGINT);
    let status = wait(&mut child, dir);
    assert_eq!(status.code(), Some(130), "{status}\n{}", other(dir));
}
