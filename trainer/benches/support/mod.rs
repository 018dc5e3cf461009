//! What the benches that run a case per child process share: paths, `/proc` readings and the
//! JSON line a child (or a Python anchor) prints last.
#![allow(dead_code)]

pub mod bases;
pub mod memory;
pub mod protocol;
pub mod run;

pub use memory::status_kib;

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::Value;

/// The workspace root (where `bench/`, `data/` and `.venv-py` are).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// What a program that exited successfully printed; its output and errors in the error otherwise
/// (`what` names the program).
pub fn stdout_of(out: &std::process::Output, what: &str) -> anyhow::Result<String> {
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{what} failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(text.into_owned())
}

/// The last JSON object line `out` printed (`what` names the program in errors).
pub fn last_json(out: std::process::Output, what: &str) -> anyhow::Result<Value> {
    let text = stdout_of(&out, what)?;
    let line = text
        .lines()
        .rfind(|l| l.starts_with('{'))
        .with_context(|| format!("{what} printed no result"))?;
    Ok(serde_json::from_str(line)?)
}

/// Field `k` of `v` as a number (NaN where absent).
pub fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(f64::NAN)
}

/// Resets `VmHWM` to the current RSS (Linux >= 4.0); false where the kernel refuses.
pub fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// `/proc/loadavg`'s three load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}
