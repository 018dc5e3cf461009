//! On-disk cache of tokenised corpora, so that a second run starts without re-tokenising.
//!
//! An entry is a **prepared shard directory** (see [`crate::shards`]), read through the
//! same memory-mapped reader as `--data shards`: `<cache_dir>/<stem>-<kind>-<key hash>/` holds
//! `train-00000.tok` (the first `1 - val_fraction` of the tokens), `val-00000.tok` (the rest)
//! and `manifest.json`, whose `settings` record the key and the corpus fingerprint. The key is
//! a text line holding the data file's canonical path, size and modification time, the
//! encoding kind, the tokenizer identity (hash of the `tokenizer.json` bytes) and the
//! validation fraction; it is compared verbatim on load.
//!
//! An entry that fails any check (no or another manifest, another key, a shard that does not
//! match the manifest or fails its checksum) is ignored with a warning and rebuilt. An entry
//! is written into a temporary directory beside it (shards, then the manifest, each fsynced)
//! and renamed into place.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use std::sync::atomic::{AtomicU64, Ordering};

use super::shards::format::{self, TokenizerInfo, MANIFEST_FILE};
use super::shards::view::ShardView;
use super::shards::{write_prepared, Manifest, ShardData};
use super::Fingerprint;
use crate::error::{Error, Result};
use crate::hash::hash_bytes;

/// Bumped whenever the way text is turned into tokens changes, to invalidate old caches.
const TOKENIZATION_VERSION: u32 = 2;

/// The default cache directory: `$XDG_CACHE_HOME/candle-train`, else
/// `$HOME/.cache/candle-train`, else `.cache/candle-train` under the current directory.
///
/// Never next to the data file, which may be read-only.
pub(crate) fn default_cache_dir() -> PathBuf {
    let non_empty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty());
    if let Some(xdg) = non_empty("XDG_CACHE_HOME") {
        PathBuf::from(xdg).join("candle-train")
    } else if let Some(home) = non_empty("HOME") {
        PathBuf::from(home).join(".cache").join("candle-train")
    } else {
        PathBuf::from(".cache").join("candle-train")
    }
}

/// Identity of a cached tokenisation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CacheKey {
    /// The full key line stored in (and compared against) the cache file.
    pub text: String,
    /// Directory name of the cache entry.
    pub file_name: String,
}

impl CacheKey {
    /// Builds the key for `data_path` encoded as `kind`, with `tokenizer_hash` identifying the
    /// tokenizer (0 when there is none), split at `val_fraction`. Fails only if the data file
    /// cannot be stat'ed.
    pub(crate) fn new(
        data_path: &Path,
        kind: &str,
        tokenizer_hash: u64,
        val_fraction: f32,
    ) -> Result<Self> {
        let canonical = fs::canonicalize(data_path).map_err(|e| Error::io(data_path, e))?;
        let meta = fs::metadata(&canonical).map_err(|e| Error::io(data_path, e))?;
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let text = format!(
            "tokenization v{TOKENIZATION_VERSION}; kind {kind}; file {}; size {}; mtime_ns \
             {mtime_ns}; tokenizer {tokenizer_hash:016x}; val_fraction {val_fraction}",
            canonical.display(),
            meta.len()
        );
        let stem: String = data_path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .take(48)
            .collect();
        let file_name = format!("{stem}-{kind}-{:016x}", hash_bytes(text.as_bytes()));
        Ok(CacheKey { text, file_name })
    }
}

/// A tokenised corpus to store: its tokens, split point, vocabulary and fingerprint.
pub(crate) struct Entry<'a> {
    /// Every token of the corpus.
    pub tokens: &'a [u32],
    /// Tokens in the training split (the rest are validation).
    pub n_train: usize,
    /// The vocabulary, as a prepared directory's manifest records it.
    pub tokenizer: TokenizerInfo,
    /// Number of ids (every token is below it).
    pub vocab_size: u64,
    /// The corpus fingerprint (the token stream's, as text sources have always computed it).
    pub fingerprint: Fingerprint,
}

/// A cache entry found valid: its manifest, its two shards mapped, its fingerprint.
pub(crate) struct Hit {
    pub manifest: Manifest,
    pub train: ShardView,
    pub val: ShardView,
    pub fingerprint: Fingerprint,
}

/// Loads the cache entry for `key` from `dir`, or `None` if it is absent or invalid (an
/// invalid entry is reported with a warning and will be rebuilt). Every shard's checksum is
/// verified (text corpora are small enough to read once).
pub(crate) fn load(dir: &Path, key: &CacheKey) -> Option<Hit> {
    let entry = dir.join(&key.file_name);
    if !entry.join(MANIFEST_FILE).is_file() {
        tracing::debug!("no token cache at {}", entry.display());
        return None;
    }
    match check(&entry, key) {
        Ok(hit) => {
            tracing::debug!("token cache hit: {}", entry.display());
            Some(hit)
        }
        Err(msg) => {
            tracing::warn!(
                "ignoring invalid token cache {}: {msg}; rebuilding",
                entry.display()
            );
            None
        }
    }
}

fn check(entry: &Path, key: &CacheKey) -> std::result::Result<Hit, String> {
    let manifest = Manifest::read(entry).map_err(|e| e.to_string())?;
    let setting = |name: &str| manifest.settings.get(name).and_then(|v| v.as_str());
    if setting("key") != Some(key.text.as_str()) {
        return Err("key mismatch (a different file, version or tokenizer)".into());
    }
    let fingerprint = Fingerprint {
        tokens: setting("fingerprint_tokens")
            .unwrap_or_default()
            .to_string(),
        vocab: manifest.tokenizer.hash.clone(),
    };
    let (Some(train), Some(val), 1, 1) = (
        manifest.train.first(),
        manifest.val.first(),
        manifest.train.len(),
        manifest.val.len(),
    ) else {
        return Err("not one train and one val shard".into());
    };
    let expect = manifest.expect();
    let open = |e: &crate::shards::ShardEntry| -> Result<ShardView> {
        let path = entry.join(&e.file);
        let header = format::verify(&path, &expect)?;
        if header.n_tokens != e.tokens || format!("{:016x}", header.checksum) != e.checksum {
            return Err(Error::data(&path, "does not match the manifest"));
        }
        // Verified whole just above.
        ShardView::open_tok(&path, &expect, None)
    };
    let train = open(train).map_err(|e| e.to_string())?;
    let val = open(val).map_err(|e| e.to_string())?;
    Ok(Hit {
        manifest,
        train,
        val,
        fingerprint,
    })
}

/// Writes the cache entry for `key` into `dir`: a prepared directory built beside it, then
/// renamed into place (an older entry of the same key is replaced). Returns its path.
pub(crate) fn store(dir: &Path, key: &CacheKey, entry: &Entry<'_>) -> Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let path = dir.join(&key.file_name);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        key.file_name,
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let settings = serde_json::json!({
        "key": key.text,
        "fingerprint_tokens": entry.fingerprint.tokens,
        "n_train": entry.n_train,
    });
    let shard = |tokens| {
        [ShardData {
            tokens,
            ..ShardData::default()
        }]
    };
    let written = write_prepared(
        &tmp,
        entry.tokenizer.clone(),
        entry.vocab_size,
        None,
        &shard(&entry.tokens[..entry.n_train]),
        &shard(&entry.tokens[entry.n_train..]),
        settings,
    )
    .and_then(|_| {
        if path.exists() {
            fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        }
        fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
    });
    if written.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    written.map(|()| path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_tracks_content_changes_tokenizer_and_split() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let p = file.path().to_path_buf();
        fs::write(&p, b"hello").unwrap();
        let k1 = CacheKey::new(&p, "char", 0, 0.1).unwrap();
        assert_eq!(k1, CacheKey::new(&p, "char", 0, 0.1).unwrap());
        assert_ne!(k1, CacheKey::new(&p, "tokenizer", 0, 0.1).unwrap());
        assert_ne!(k1, CacheKey::new(&p, "char", 0, 0.2).unwrap());
        assert_ne!(
            CacheKey::new(&p, "tokenizer", 1, 0.1).unwrap(),
            CacheKey::new(&p, "tokenizer", 2, 0.1).unwrap()
        );
        fs::write(&p, b"hello world").unwrap();
        assert_ne!(k1, CacheKey::new(&p, "char", 0, 0.1).unwrap());
        assert!(CacheKey::new(&p.with_extension("missing"), "char", 0, 0.1).is_err());
    }

    #[test]
    fn hash_is_stable_and_sensitive() {
        assert_eq!(hash_bytes(b"abc"), hash_bytes(b"abc"));
        assert_ne!(hash_bytes(b"a"), hash_bytes(b"a\0"));
        assert_ne!(hash_bytes(b"abcdefgh1"), hash_bytes(b"abcdefgh2"));
        assert_ne!(crate::hash::splitmix64(1), crate::hash::splitmix64(2));
    }
}
