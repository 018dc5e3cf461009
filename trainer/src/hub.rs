//! Pretrained models from the local Hugging Face hub cache (no network access at run time).
//!
//! A model downloaded once by `huggingface-cli download openai-community/gpt2` (or by any
//! `transformers`/`hf-hub` program) lives in `$HF_HOME/hub/models--<org>--<name>/`, with
//! `refs/main` naming the snapshot that holds `config.json` and `model.safetensors`. This module
//! finds that snapshot with the `hf-hub` crate's cache reader.

use std::path::{Path, PathBuf};

use crate::checkpoint::{CONFIG_FILE, MODEL_FILE};
use crate::load::INDEX_FILE;
use crate::{Error, Result};

/// The cache `hf-hub` uses by default: `$HF_HOME/hub`, or `~/.cache/huggingface/hub`.
pub fn default_cache() -> hf_hub::Cache {
    hf_hub::Cache::from_env()
}

/// The snapshot directory of model `id` (e.g. `openai-community/gpt2`) in `cache`, checked to
/// hold `config.json` and `model.safetensors` (or a sharded model's
/// `model.safetensors.index.json`).
///
/// ```
/// let cache = hf_hub::Cache::new(std::env::temp_dir().join("no-such-hf-cache"));
/// let err = trainer::hub::snapshot_dir(&cache, "openai-community/gpt2").unwrap_err();
/// assert!(err.to_string().contains("not in the local Hugging Face cache"));
/// ```
pub fn snapshot_dir(cache: &hf_hub::Cache, id: &str) -> Result<PathBuf> {
    let repo = cache.model(id.to_string());
    let missing = |file: &str| {
        Error::checkpoint(
            cache.path(),
            format!(
                "`{file}` of model `{id}` is not in the local Hugging Face cache (nothing is \
                 downloaded at run time: fetch it first, e.g. `huggingface-cli download {id}`, \
                 or point HF_HOME at a cache that has it)"
            ),
        )
    };
    let config = repo.get(CONFIG_FILE).ok_or_else(|| missing(CONFIG_FILE))?;
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| missing(CONFIG_FILE))?;
    // One model.safetensors, else an index (its shards are checked when the weights are
    // read: a missing one is named then).
    let (name, weights) = match repo.get(MODEL_FILE) {
        Some(p) => (MODEL_FILE, p),
        None => (
            INDEX_FILE,
            repo.get(INDEX_FILE).ok_or_else(|| missing(MODEL_FILE))?,
        ),
    };
    if weights.parent() != Some(dir.as_path()) {
        return Err(Error::checkpoint(
            &dir,
            format!("config.json and {name} are in different snapshots"),
        ));
    }
    Ok(dir)
}
