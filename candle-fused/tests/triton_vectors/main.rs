//! Writes the test vectors for the Triton kernels (`candle-fused/triton/<family>.py`): inputs
//! and this crate's CPU kernel outputs and gradients, as safetensors files named
//! `<family>.<dtype>.<case>.safetensors`, one trial `<family>::write_vectors` per family of
//! the registry (`tests/families`).
//!
//! A no-op unless `WRITE_TRITON_VECTORS=DIR` is set:
//!
//! ```text
//! WRITE_TRITON_VECTORS=candle-fused/triton/vectors \
//!     cargo test -p candle-fused --release --test triton_vectors [family]
//! ```
//!
//! (a relative DIR is taken from the workspace root). After regenerating, rerun
//! `scripts/python/triton_interpret_check.py` (the record test checks the files' sha256).

#[path = "../common/mod.rs"]
mod common;
#[path = "../families/mod.rs"]
mod families;

use anyhow::Result;
use libtest_mimic::{Arguments, Trial};
use std::path::PathBuf;

/// The directory named by `WRITE_TRITON_VECTORS` (relative to the workspace root), created;
/// `None` when unset.
fn out_dir() -> Result<Option<PathBuf>> {
    let Some(dir) = std::env::var_os("WRITE_TRITON_VECTORS") else {
        return Ok(None);
    };
    let mut dir = PathBuf::from(dir);
    if dir.is_relative() {
        // integration tests run in the crate directory; take DIR from the workspace root
        dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(dir);
    }
    std::fs::create_dir_all(&dir)?;
    Ok(Some(dir))
}

fn main() {
    let args = Arguments::from_args();
    let trials = families::FAMILIES
        .iter()
        .filter_map(|f| Some((f.name, f.write_vectors?)))
        .map(|(name, write)| {
            Trial::test(format!("{name}::write_vectors"), move || {
                let Some(dir) = out_dir()? else {
                    return Ok(());
                };
                write(&dir).map_err(|e| format!("{e:#}").into())
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}
