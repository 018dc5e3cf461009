//! `trainer prepare --verify DIR`: every shard of a prepared directory read back and checked
//! against its header and the manifest.

use std::path::Path;

use super::format::{self, chunk_sums, HEADER_LEN};
use super::Manifest;
use crate::error::{Error, Result};

/// One shard's verdict.
#[derive(Clone, Debug)]
pub struct ShardVerdict {
    /// The file name inside the directory.
    pub file: String,
    /// `None` when the shard is sound; else what is wrong with it.
    pub problem: Option<String>,
}

/// Reads every shard `dir`'s manifest lists, both splits, and checks its header (magic,
/// version, width, vocabulary, length), its body's whole checksum and per-chunk checksums,
/// its document stream, its largest token against the vocabulary, and its token and document
/// counts against the manifest. Fails only when the manifest itself cannot be read; each bad
/// shard is a verdict with its reason.
pub fn verify_dir(dir: &Path) -> Result<Vec<ShardVerdict>> {
    let manifest = Manifest::read(dir)?;
    let expect = manifest.expect();
    let mut out = Vec::new();
    for entry in manifest.train.iter().chain(&manifest.val) {
        let path = dir.join(&entry.file);
        let problem = check_one(&path, entry, &manifest, &expect).err();
        out.push(ShardVerdict {
            file: entry.file.clone(),
            problem: problem.map(|e| match e {
                Error::Data { msg, .. } => msg,
                other => other.to_string(),
            }),
        });
    }
    Ok(out)
}

fn check_one(
    path: &Path,
    entry: &format::ShardEntry,
    manifest: &Manifest,
    expect: &format::Expect,
) -> Result<()> {
    let shard = format::open_shard(path, expect)?;
    shard.verify()?;
    let h = shard.header();
    let bad = |msg: String| Err(Error::data(path, msg));
    if h.n_tokens != entry.tokens || h.n_docs != entry.docs {
        return bad(format!(
            "{} tokens and {} documents; the manifest lists {} and {}",
            h.n_tokens, h.n_docs, entry.tokens, entry.docs
        ));
    }
    if format!("{:016x}", h.checksum) != entry.checksum {
        return bad(format!(
            "checksum {:016x}; the manifest lists {}",
            h.checksum, entry.checksum
        ));
    }
    if !entry.chunk_sums.is_empty() {
        let body = &shard.bytes()[HEADER_LEN..];
        let got = chunk_sums(body);
        if got != entry.chunk_sums {
            let chunk = (0..got.len().max(entry.chunk_sums.len()) / 8)
                .find(|&i| got.get(8 * i..8 * i + 8) != entry.chunk_sums.get(8 * i..8 * i + 8))
                .unwrap_or(0);
            return bad(format!(
                "body chunk {chunk} (bytes {}..) differs from the manifest's chunk checksum",
                chunk as u64 * format::CHECK_CHUNK
            ));
        }
    }
    let max = (0..shard.len()).map(|i| shard.token(i)).max();
    if let Some(max) = max.filter(|&m| u64::from(m) >= manifest.vocab_size) {
        return bad(format!(
            "token id {max} is not below the manifest's vocab_size {}",
            manifest.vocab_size
        ));
    }
    Ok(())
}
