//! Real signals to a real `trainer` process: SIGTERM (what schedulers and `docker stop` send)
//! and SIGINT finish the step and save a checkpoint that resumes; a second signal exits at once.
#![cfg(unix)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use trainer::train::Trainer;

mod common;
use common::process::{signal, wait_for_steps};

/// A run far longer than the test: it only ends by a signal.
fn spawn(dir: &Path) -> Child {
    spawn_eval_iters(dir, "1")
}

/// [`spawn`], each evaluation `eval_iters` batches long.
fn spawn_eval_iters(dir: &Path, eval_iters: &str) -> Child {
    let mut args = common::words(
        "train --out-dir run --max-iters 1000000 --eval-interval 1000000 --n-layer 1 \
         --n-embd 32 --n-head 2 --batch-size 8 --eval-problems 8 --eval-iters",
    );
    args.push(eval_iters);
    spawn_with(dir, &args)
}

/// The trainer with `args` in `dir`, its output in `out.txt` and `err.txt`.
fn spawn_with(dir: &Path, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(dir)
        // Files, not pipes: a pipe nobody reads could fill and block the trainer.
        .stdout(Stdio::from(
            std::fs::File::create(dir.join("out.txt")).unwrap(),
        ))
        .stderr(Stdio::from(
            std::fs::File::create(dir.join("err.txt")).unwrap(),
        ))
        .spawn()
        .expect("start the trainer binary")
}

/// Waits until the run in `dir/run` has written `run.toml` (just before its first evaluation).
fn wait_for_start(child: &mut Child, dir: &Path) {
    let start = Instant::now();
    while !dir.join("run/run.toml").is_file() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the trainer exited early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no start in 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits at most `secs` for the child to exit after a signal; kills it and fails, saying it
/// was still `doing`, otherwise.
fn exit_within(child: &mut Child, secs: u64, doing: &str) {
    let signalled = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if signalled.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the trainer was still {doing} {secs} s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`spawn`], waiting until the run has logged `n` steps (so a signal lands mid-training).
fn spawn_past(dir: &Path, n: usize) -> Child {
    let mut child = spawn(dir);
    wait_for_steps(&dir.join("run/metrics.jsonl"), n, &mut child, String::new);
    child
}

/// Waits for the child to exit (at most 120 s) and returns its status and output.
fn finish(child: Child, dir: &Path) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    let mut child = child;
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the trainer did not exit within 120 s of the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = child.wait().unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    (status, format!("{}{}", read("out.txt"), read("err.txt")))
}

#[test]
fn sigterm_and_sigint_checkpoint_and_resume() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let tmp = tempfile::tempdir().unwrap();
        let child = spawn_past(tmp.path(), 3);
        signal(&child, sig);
        let (status, out) = finish(child, tmp.path());
        // Interrupted after saving: 75 (EX_TEMPFAIL), not 0 (finished) nor 1 (failed).
        assert_eq!(status.code(), Some(75), "signal {sig}: {status}\n{out}");
        assert!(out.contains("== interrupted =="), "{out}");
        // The last evaluation (step 0) is not passed off as the interrupted step's.
        common::assert_mentions(&out, &["val loss", "(evaluated at step 0)"]);
        let run = tmp.path().join("run");
        let t = Trainer::resume(&run, |_| {}).unwrap();
        assert!(
            t.step() >= 3,
            "signal {sig}: checkpoint at step {}",
            t.step()
        );
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert!(metrics.contains(&format!("\"step\":{}", t.step())));
    }
}

#[test]
fn a_second_signal_exits_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let child = spawn_past(tmp.path(), 2);
    // Two different signals: two of the same kind may merge into one before delivery.
    signal(&child, libc::SIGTERM);
    signal(&child, libc::SIGINT);
    let (status, out) = finish(child, tmp.path());
    assert_eq!(status.code(), Some(130), "{out}");
    assert!(out.contains("second signal"), "{out}");
}

/// `child`, once started, is sent SIGTERM `after` a while and must exit within `secs` (it
/// was `doing` that), interrupted (status 75) with its checkpoint at step 0; its output.
fn cut_short(mut child: Child, dir: &Path, after: Duration, secs: u64, doing: &str) -> String {
    wait_for_start(&mut child, dir);
    std::thread::sleep(after);
    signal(&child, libc::SIGTERM);
    exit_within(&mut child, secs, doing);
    let (status, out) = finish(child, dir);
    assert_eq!(status.code(), Some(75), "{out}");
    let t = Trainer::resume(&dir.join("run"), |_| {}).unwrap();
    assert_eq!(t.step(), 0);
    out
}

/// A signal while the first evaluation's text sample is generated does not wait for its end:
/// sampling checks the stop flag between tokens. (Before: the 65536 tokens of the largest
/// sample allowed, on end after the signal.)
#[test]
fn a_signal_cuts_a_sample_short() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // A model wide enough that 65536 tokens take minutes (about 2 ms a token here).
    let args = common::words(
        "train --out-dir run --max-iters 1000000 --n-layer 4 --n-embd 256 --n-head 4 \
         --eval-iters 1 --eval-problems 8 --peak-flops 1e12 --sample-tokens 65536",
    );
    // The one-batch evaluation takes milliseconds; the sample, minutes.
    let child = spawn_with(dir, &args);
    cut_short(child, dir, Duration::from_millis(1500), 5, "sampling");
}

/// A signal during an evaluation does not wait for its end: evaluation checks the stop flag
/// between batches, and the run checkpoints and exits. (Before, the first evaluation here,
/// 100 million batches long, ran on: the test timed out.)
#[test]
fn a_signal_cuts_an_evaluation_short() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let child = spawn_eval_iters(dir, "100000000");
    let out = cut_short(child, dir, Duration::from_millis(300), 30, "evaluating");
    assert!(out.contains("== interrupted =="), "{out}");
}

/// A signal in the middle of a step of many micro-batches abandons it between two of them,
/// instead of holding the signal up for the whole step (before: `--grad-accum 60000` ignored
/// SIGTERM for minutes), and puts the data RNG back where the step found it: the checkpoint
/// then saved is the state before the step, which resumes bit-exactly.
#[test]
fn a_signal_abandons_a_long_step_and_puts_the_data_back() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |name: &str| trainer::config::TrainConfig {
        grad_accum: 60_000,
        ..common::tiny_config(&tmp.path().join(name))
    };
    let mut fresh = Trainer::new(cfg("fresh")).unwrap();
    let mut cut = Trainer::new(cfg("cut")).unwrap();
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let outcome = std::thread::scope(|s| {
        // After the counting pass over the step's draws (host only, well under a second here)
        // and inside the micro-batches (about a millisecond each: a minute in all).
        s.spawn(|| {
            std::thread::sleep(Duration::from_secs(5));
            stop.store(true, Ordering::SeqCst);
        });
        cut.train_step_until(&stop).unwrap()
    });
    assert!(outcome.is_none(), "the step ran to its end");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "abandoned only after {:?}",
        started.elapsed()
    );
    assert_eq!(cut.step(), 0);
    let state = |t: &mut Trainer| {
        let dir = t.save_checkpoint().unwrap();
        let text = std::fs::read_to_string(dir.join("trainer_state.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["rng"].clone()
    };
    assert_eq!(
        state(&mut cut),
        state(&mut fresh),
        "the data RNG was not put back"
    );
}
