//! A real `trainer` process driven by a test: waiting for its steps, sending it signals.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

/// Waits (at most 120 s) until the run's `metrics.jsonl` holds `n` logged steps; panics when the
/// child exits first, with `output()` (what the test has of its output) in the message.
pub fn wait_for_steps(metrics: &Path, n: usize, child: &mut Child, output: impl Fn() -> String) {
    let start = Instant::now();
    loop {
        let steps = std::fs::read_to_string(metrics)
            .map(|t| t.lines().filter(|l| l.contains("\"loss\"")).count())
            .unwrap_or(0);
        if steps >= n {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the trainer exited early: {status}\n{}", output());
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no progress in 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `sig` to the child.
pub fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child this test owns; no memory is involved.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill failed");
}
