//! On-disk cache of tokenised corpora, so that a second run starts without re-tokenising.
//!
//! One file per (data file, encoding): `<cache_dir>/<stem>-<kind>-<key hash>.tokens`. The key
//! is a text line holding the data file's canonical path, size and modification time, the
//! encoding kind and the tokenizer identity (hash of the `tokenizer.json` bytes); it is stored
//! in the file and compared verbatim on load.
//!
//! Layout (little-endian):
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0  | 8 | magic `b"CTTOKENS"` |
//! | 8  | 4 | format version (1) |
//! | 12 | 4 | bytes per token (2 if the vocabulary fits in `u16`, else 4) |
//! | 16 | 4 | key length |
//! | 20 | 4 | extra length (the char vocabulary as UTF-8, or empty) |
//! | 24 | 8 | number of tokens |
//! | 32 | 8 | vocabulary size |
//! | 40 | 8 | checksum of every other byte of the file |
//! | 48 | … | key, extra, tokens |
//!
//! A file that fails any check (short, wrong magic/version/key, bad checksum, a token outside
//! the vocabulary) is ignored with a warning and rebuilt. Writes go to a temporary file in the
//! same directory, are fsynced, then renamed over the target.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::error::{Error, Result};
use crate::hash::{hash_bytes, Hasher64};

const MAGIC: &[u8; 8] = b"CTTOKENS";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 48;
/// Bumped whenever the way text is turned into tokens changes, to invalidate old caches.
const TOKENIZATION_VERSION: u32 = 1;

/// The default cache directory: `$XDG_CACHE_HOME/candle-train`, else
/// `$HOME/.cache/candle-train`, else `.cache/candle-train` under the current directory.
///
/// Never next to the data file, which may be read-only.
pub fn default_cache_dir() -> PathBuf {
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
    /// File name of the cache entry.
    pub file_name: String,
}

impl CacheKey {
    /// Builds the key for `data_path` encoded as `kind`, with `tokenizer_hash` identifying the
    /// tokenizer (0 when there is none). Fails only if the data file cannot be stat'ed.
    pub(crate) fn new(data_path: &Path, kind: &str, tokenizer_hash: u64) -> Result<Self> {
        let canonical = fs::canonicalize(data_path).map_err(|e| Error::io(data_path, e))?;
        let meta = fs::metadata(&canonical).map_err(|e| Error::io(data_path, e))?;
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let text = format!(
            "tokenization v{TOKENIZATION_VERSION}; kind {kind}; file {}; size {}; mtime_ns \
             {mtime_ns}; tokenizer {tokenizer_hash:016x}",
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
        let file_name = format!("{stem}-{kind}-{:016x}.tokens", hash_bytes(text.as_bytes()));
        Ok(CacheKey { text, file_name })
    }
}

/// A tokenised corpus as stored in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cached {
    /// The token ids of the whole file.
    pub tokens: Vec<u32>,
    /// Vocabulary size (every token is below it).
    pub vocab_size: u64,
    /// Source-specific extra data (the char vocabulary as UTF-8).
    pub extra: Vec<u8>,
}

fn width_for(vocab_size: u64) -> usize {
    if vocab_size <= 1 << 16 {
        2
    } else {
        4
    }
}

/// Serialises `cached` under `key` into the cache file format.
pub(crate) fn to_bytes(key: &CacheKey, cached: &Cached) -> Vec<u8> {
    let width = width_for(cached.vocab_size);
    let key_bytes = key.text.as_bytes();
    let mut out = Vec::with_capacity(
        HEADER_LEN + key_bytes.len() + cached.extra.len() + width * cached.tokens.len(),
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(width as u32).to_le_bytes());
    out.extend_from_slice(&(key_bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(&(cached.extra.len() as u32).to_le_bytes());
    out.extend_from_slice(&(cached.tokens.len() as u64).to_le_bytes());
    out.extend_from_slice(&cached.vocab_size.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]); // checksum, filled below
    out.extend_from_slice(key_bytes);
    out.extend_from_slice(&cached.extra);
    if width == 2 {
        for &t in &cached.tokens {
            out.extend_from_slice(&(t as u16).to_le_bytes());
        }
    } else {
        for &t in &cached.tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
    }
    let sum = checksum(&out);
    out[40..48].copy_from_slice(&sum.to_le_bytes());
    out
}

fn checksum(file: &[u8]) -> u64 {
    let mut h = Hasher64::new();
    h.update(&file[..40]);
    h.update(&file[HEADER_LEN..]);
    h.finish()
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Parses and validates a cache file's bytes against `key`; the error says what is wrong.
pub(crate) fn from_bytes(key: &CacheKey, b: &[u8]) -> std::result::Result<Cached, String> {
    if b.len() < HEADER_LEN {
        return Err(format!("only {} bytes, shorter than the header", b.len()));
    }
    if &b[..8] != MAGIC {
        return Err("bad magic".into());
    }
    let version = read_u32(b, 8);
    if version != VERSION {
        return Err(format!("format version {version}, expected {VERSION}"));
    }
    let width = read_u32(b, 12) as usize;
    let key_len = read_u32(b, 16) as usize;
    let extra_len = read_u32(b, 20) as usize;
    let n = read_u64(b, 24);
    let vocab_size = read_u64(b, 32);
    if width != width_for(vocab_size) {
        return Err(format!("token width {width} for vocab size {vocab_size}"));
    }
    let expected_len = (n as u128) * (width as u128)
        + (HEADER_LEN as u128)
        + (key_len as u128)
        + (extra_len as u128);
    if expected_len != b.len() as u128 {
        return Err(format!(
            "{} bytes, header says {expected_len} (truncated or padded)",
            b.len()
        ));
    }
    if checksum(b) != read_u64(b, 40) {
        return Err("checksum mismatch".into());
    }
    let key_end = HEADER_LEN + key_len;
    if &b[HEADER_LEN..key_end] != key.text.as_bytes() {
        return Err("key mismatch (a different file, version or tokenizer)".into());
    }
    let extra = b[key_end..key_end + extra_len].to_vec();
    let payload = &b[key_end + extra_len..];
    let tokens: Vec<u32> = if width == 2 {
        payload
            .chunks_exact(2)
            .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
            .collect()
    } else {
        payload
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    if let Some(bad) = tokens.iter().find(|&&t| u64::from(t) >= vocab_size) {
        return Err(format!(
            "token {bad} outside the vocabulary of {vocab_size}"
        ));
    }
    Ok(Cached {
        tokens,
        vocab_size,
        extra,
    })
}

/// Loads the cache entry for `key` from `dir`, or `None` if it is absent or invalid (an
/// invalid entry is reported with a warning and will be rebuilt).
pub(crate) fn load(dir: &Path, key: &CacheKey) -> Option<Cached> {
    let path = dir.join(&key.file_name);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::debug!("no token cache at {}", path.display());
            return None;
        }
        Err(e) => {
            tracing::warn!(
                "cannot read token cache {}: {e}; rebuilding",
                path.display()
            );
            return None;
        }
    };
    match from_bytes(key, &bytes) {
        Ok(c) => {
            tracing::debug!("token cache hit: {}", path.display());
            Some(c)
        }
        Err(msg) => {
            tracing::warn!(
                "ignoring invalid token cache {}: {msg}; rebuilding",
                path.display()
            );
            None
        }
    }
}

/// Writes the cache entry for `key` into `dir` atomically (temporary file in the same
/// directory, fsync, rename, then fsync of the directory where supported).
pub(crate) fn store(dir: &Path, key: &CacheKey, cached: &Cached) -> Result<PathBuf> {
    let path = dir.join(&key.file_name);
    crate::io::write_atomic(&path, &to_bytes(key, cached))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(vocab_size: u64, n: u32) -> Cached {
        Cached {
            tokens: (0..n).map(|i| (i * 7919) % vocab_size as u32).collect(),
            vocab_size,
            extra: "abc\u{e9}".as_bytes().to_vec(),
        }
    }

    fn key_for(dir: &Path, name: &str) -> CacheKey {
        let p = dir.join(name);
        fs::write(&p, b"hello").unwrap();
        CacheKey::new(&p, "char", 0).unwrap()
    }

    #[test]
    fn round_trip_u16_and_u32() {
        let dir = tempfile::tempdir().unwrap();
        let key = key_for(dir.path(), "a.txt");
        for vocab in [65u64, 1 << 16, (1 << 16) + 1, 200_000] {
            let c = sample(vocab, 1000);
            let bytes = to_bytes(&key, &c);
            let width = if vocab <= 65536 { 2 } else { 4 };
            assert_eq!(
                bytes.len(),
                HEADER_LEN + key.text.len() + c.extra.len() + width * 1000
            );
            assert_eq!(from_bytes(&key, &bytes).unwrap(), c);
            store(dir.path(), &key, &c).unwrap();
            assert_eq!(load(dir.path(), &key).unwrap(), c);
        }
    }

    #[test]
    fn every_corruption_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let key = key_for(dir.path(), "a.txt");
        let bytes = to_bytes(&key, &sample(300, 50));
        // Truncation at every length.
        for len in 0..bytes.len() {
            assert!(from_bytes(&key, &bytes[..len]).is_err(), "len {len}");
        }
        // A flipped bit anywhere.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(from_bytes(&key, &b).is_err(), "byte {i}");
        }
        // Trailing garbage.
        let mut b = bytes.clone();
        b.push(0);
        assert!(from_bytes(&key, &b).is_err());
        // Another file's key.
        let other = key_for(dir.path(), "b.txt");
        assert!(from_bytes(&other, &bytes).unwrap_err().contains("key"));
    }

    #[test]
    fn key_tracks_content_changes_and_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        fs::write(&p, b"hello").unwrap();
        let k1 = CacheKey::new(&p, "char", 0).unwrap();
        assert_eq!(k1, CacheKey::new(&p, "char", 0).unwrap());
        assert_ne!(k1, CacheKey::new(&p, "tokenizer", 0).unwrap());
        assert_ne!(
            CacheKey::new(&p, "tokenizer", 1).unwrap(),
            CacheKey::new(&p, "tokenizer", 2).unwrap()
        );
        fs::write(&p, b"hello world").unwrap();
        assert_ne!(k1, CacheKey::new(&p, "char", 0).unwrap());
        assert!(CacheKey::new(&dir.path().join("missing"), "char", 0).is_err());
    }

    #[test]
    fn hash_is_stable_and_sensitive() {
        assert_eq!(hash_bytes(b"abc"), hash_bytes(b"abc"));
        assert_ne!(hash_bytes(b"a"), hash_bytes(b"a\0"));
        assert_ne!(hash_bytes(b"abcdefgh1"), hash_bytes(b"abcdefgh2"));
        assert_ne!(crate::hash::splitmix64(1), crate::hash::splitmix64(2));
    }
}
