//! Writes the test vectors for the Triton kernels (`candle-fused/triton/<family>.py`): inputs
//! and this crate's CPU kernel outputs and gradients, as safetensors files named
//! `<family>.<dtype>.<case>.safetensors`, one module per family.
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

mod adamw;
mod attention;
#[path = "../common/mod.rs"]
mod common;
mod cross_entropy;
mod dropout;
mod embedding;
mod gelu;
mod layer_norm;
mod rms_norm;
mod rope;
mod swiglu;

use anyhow::Result;
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::PathBuf;

/// The directory named by `WRITE_TRITON_VECTORS` (relative to the workspace root), created;
/// `None` when unset.
pub fn out_dir() -> Result<Option<PathBuf>> {
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

/// Writes `tensors` to `<dir>/<family>.<dtype>.<case>.safetensors`.
pub fn write(dir: &std::path::Path, stem: &str, tensors: Vec<(&str, Tensor)>) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| (k.to_string(), t))
        .collect();
    let path = dir.join(format!("{stem}.safetensors"));
    candle_core::safetensors::save(&map, &path)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
