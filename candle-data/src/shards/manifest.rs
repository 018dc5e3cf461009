//! `manifest.json`: what a prepared directory holds (re-exported by [`super::format`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::format::{Expect, MANIFEST_FILE, MANIFEST_FORMAT};
use crate::digest::check_format;
use crate::error::{Error, Result};
use crate::hash::Hasher64;
use crate::Split;

/// How the vocabulary of a prepared directory was made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// `"tokenizer"` (a `tokenizer.json`), `"char"` or `"byte"`.
    pub kind: String,
    /// The `tokenizer.json` as given to `prepare` (tokenizer kind only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The vocabulary hash of every shard, as 16 hex digits.
    pub hash: String,
    /// The characters of a `char` vocabulary, in id order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chars: Option<String>,
}

/// One shard as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the prepared directory (`train-00000.tok`).
    pub file: String,
    /// Number of tokens.
    pub tokens: u64,
    /// Documents starting in the shard.
    pub docs: u64,
    /// The shard header's checksum, as 16 hex digits.
    pub checksum: String,
    /// CRC-32 of each `CHECK_CHUNK`-byte chunk of the body, 8
    /// hex digits each, concatenated (see `chunk_sums`). Empty
    /// in manifests of older trainers: their shards are verified whole, by the header's
    /// checksum, when first read.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chunk_sums: String,
}

/// One input file of `prepare`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputEntry {
    /// The path as found.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its modification time, nanoseconds since the Unix epoch, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtime_ns: Option<u128>,
    /// CRC-32 of its bytes, 8 hex digits (absent in manifests of older trainers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// `manifest.json`: what a prepared directory holds. Written last, atomically.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `MANIFEST_FORMAT`.
    pub format: u32,
    /// The vocabulary.
    pub tokenizer: TokenizerInfo,
    /// Number of ids the model must embed (every token is below it).
    pub vocab_size: u64,
    /// The EOS id appended after each document (`None` for SFT examples, which carry their
    /// own ending, and vocabularies without one).
    pub eos_id: Option<u32>,
    /// Token width of every shard (2 or 4).
    pub width: u32,
    /// Whether the shards carry the document-start stream.
    pub docs: bool,
    /// Whether the shards carry the loss-mask stream.
    pub mask: bool,
    /// Whether the shards carry the pair table: each document is a preference pair
    /// (`trainer prepare --format preference`; see [`super::format`]'s pair layout).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pairs: bool,
    /// Training shards, in order.
    pub train: Vec<ShardEntry>,
    /// Validation shards, in order.
    pub val: Vec<ShardEntry>,
    /// The input files, in the order they were read.
    pub inputs: Vec<InputEntry>,
    /// The settings the shards were made with (shard size, field, val rule...).
    pub settings: serde_json::Value,
}

impl Manifest {
    /// Reads `<dir>/manifest.json`, naming the file on error.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| Error::data(&path, format!("not a valid manifest: {e}")))?;
        check_format("manifest", m.format, MANIFEST_FORMAT, |msg| {
            Error::data(&path, msg)
        })?;
        Ok(m)
    }

    /// Writes `<dir>/manifest.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        crate::io::write_json(&dir.join(MANIFEST_FILE), self)
    }

    /// The shards of `split`.
    pub fn shards(&self, split: Split) -> &[ShardEntry] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Tokens in `split`.
    pub fn tokens(&self, split: Split) -> u64 {
        self.shards(split).iter().map(|s| s.tokens).sum()
    }

    /// The vocabulary hash as a number (`None` if the manifest's is not 16 hex digits).
    pub fn vocab_hash(&self) -> Option<u64> {
        u64::from_str_radix(&self.tokenizer.hash, 16).ok()
    }

    /// What every shard of this directory must match.
    pub fn expect(&self) -> Expect {
        Expect {
            vocab: self.vocab_hash(),
            width: Some(self.width),
        }
    }

    /// The identity of the prepared data: a hash of the split sizes and every shard's
    /// checksum, in order.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Hasher64::new();
        for list in [&self.train, &self.val] {
            h.update(&(list.len() as u64).to_le_bytes());
            for s in list {
                h.update(s.checksum.as_bytes());
            }
        }
        h.finish()
    }
}
