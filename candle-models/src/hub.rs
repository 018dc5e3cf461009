//! Pretrained models from the local Hugging Face hub cache (no network access at run time).
//!
//! A model downloaded once by `huggingface-cli download openai-community/gpt2` (or by any
//! `transformers`/`hf-hub` program) lives in the hub cache ([`cache_dir`]) under
//! `models--<org>--<name>/`, with `refs/main` naming the snapshot that holds `config.json` and
//! `model.safetensors`. This module finds that snapshot with the `hf-hub` crate's cache reader.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::load::{CONFIG_FILE, INDEX_FILE, MODEL_FILE};
use crate::{Error, Result};

/// The hub cache as transformers finds it ([`cache_dir`]).
pub(crate) fn default_cache() -> hf_hub::Cache {
    hf_hub::Cache::new(cache_dir())
}

/// The hub cache directory as `huggingface_hub` (and so transformers) finds it, from the
/// process environment: see [`cache_dir_in`].
pub fn cache_dir() -> PathBuf {
    cache_dir_in(|name| std::env::var_os(name))
}

/// The hub cache directory as `huggingface_hub`'s `constants.py` computes it, with `var`
/// reading the environment: `HF_HUB_CACHE`, else the older `HUGGINGFACE_HUB_CACHE`, else
/// `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
/// A leading `~` is the home directory (`HOME`), as Python's `expanduser` makes it; a variable set to the empty string counts as
/// unset (`$VAR`s inside values are not expanded).
///
/// ```
/// use std::path::PathBuf;
/// let env = |vars: &'static [(&'static str, &'static str)]| {
///     move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.into())
/// };
/// let dir = candle_models::hub::cache_dir_in(env(&[("HOME", "/h"), ("HF_HOME", "~/hf")]));
/// assert_eq!(dir, PathBuf::from("/h/hf/hub"));
/// let dir = candle_models::hub::cache_dir_in(env(&[("HF_HOME", "/a"), ("HF_HUB_CACHE", "/b")]));
/// assert_eq!(dir, PathBuf::from("/b"));
/// ```
pub fn cache_dir_in(var: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    let get = |name: &str| var(name).filter(|v| !v.is_empty());
    let home = || {
        get("HOME")
            .map(PathBuf::from)
            .or_else(std::env::home_dir)
            .unwrap_or_default()
    };
    let expand = |v: OsString| -> PathBuf {
        let p = PathBuf::from(v);
        match p.strip_prefix("~") {
            Ok(rest) => home().join(rest),
            Err(_) => p,
        }
    };
    if let Some(v) = get("HF_HUB_CACHE").or_else(|| get("HUGGINGFACE_HUB_CACHE")) {
        return expand(v);
    }
    let hf_home = get("HF_HOME").unwrap_or_else(|| {
        let xdg = get("XDG_CACHE_HOME").map_or_else(|| home().join(".cache"), PathBuf::from);
        xdg.join("huggingface").into_os_string()
    });
    expand(hf_home).join("hub")
}

/// The snapshot directory of model `id` (e.g. `openai-community/gpt2`) in `cache`, checked to
/// hold `config.json` and `model.safetensors` (or a sharded model's
/// `model.safetensors.index.json`).
///
/// ```
/// let cache = hf_hub::Cache::new(std::env::temp_dir().join("no-such-hf-cache"));
/// let err = candle_models::hub::snapshot_dir(&cache, "openai-community/gpt2").unwrap_err();
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
                 or point HF_HUB_CACHE or HF_HOME at a cache that has it)"
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
