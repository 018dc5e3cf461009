//! A step's memory does not grow with `grad_accum` (#32): micro-batches are drawn one at a
//! time, not all up front (10^12 of them were, until the OOM killer). A run of 65 536
//! micro-batches a step (the most `grad_accum` allows; 64 rows of 16 tokens each: 537 MB of
//! inputs and targets drawn up front) must keep its peak resident memory small while it runs.
#![cfg(target_os = "linux")]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Peak RSS the run may reach, in KiB (the binary, Candle, the model and one micro-batch).
const MAX_RSS_KIB: u64 = 300 << 10;

/// The process's peak resident memory (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_step_holds_one_micro_batch_whatever_grad_accum() {
    let tmp = tempfile::tempdir().unwrap();
    let args = common::words(
        "train --out-dir run --grad-accum 65536 --batch-size 64 --block-size 16 \
         --n-layer 1 --n-head 2 --n-embd 16 --digits 2 --peak-flops 1e12",
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The first step's micro-batches: seconds to draw them all, far longer to train on them.
    let start = Instant::now();
    let mut peak = 0;
    while start.elapsed() < Duration::from_secs(6) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended");
        peak = peak.max(peak_rss_kib(child.id()));
        if peak > MAX_RSS_KIB {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(peak > 0, "no /proc status read");
    assert!(
        peak <= MAX_RSS_KIB,
        "a run of 65536 micro-batches a step reached {peak} KiB"
    );
}
