//! Writing a whole prepared directory from token streams already in memory: the text
//! sources' token cache, and tests. (`trainer prepare` streams large inputs instead.)

use std::path::Path;

use super::format::{
    shard_writer, width_for_vocab, Manifest, ShardEntry, TokenizerInfo, MANIFEST_FORMAT,
};
use crate::error::Result;

/// One shard to write.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShardData<'a> {
    /// The tokens.
    pub tokens: &'a [u32],
    /// Document starts (ascending token offsets), if the shard has a document stream.
    pub doc_starts: Option<&'a [u64]>,
    /// Whether each token counts as a target, if the shard has a loss-mask stream.
    pub counted: Option<&'a [bool]>,
}

/// Writes `train` and `val` shards (`train-00000.tok`, ...) into `dir` (created if needed) and
/// then their [`Manifest`] (atomically, last), and returns the manifest. The shards' header
/// vocabulary is `tokenizer.hash`; every shard must agree on having a document / mask stream.
pub fn write_prepared(
    dir: &Path,
    tokenizer: TokenizerInfo,
    vocab_size: u64,
    eos_id: Option<u32>,
    train: &[ShardData<'_>],
    val: &[ShardData<'_>],
    settings: serde_json::Value,
) -> Result<Manifest> {
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::io(dir, e))?;
    let width = width_for_vocab(vocab_size as usize);
    let vocab = u64::from_str_radix(&tokenizer.hash, 16).unwrap_or(0);
    let write = |name: &str, shards: &[ShardData<'_>]| -> Result<Vec<ShardEntry>> {
        shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let file = format!("{name}-{i:05}.tok");
                let path = dir.join(&file);
                shard_writer(&path, width, vocab, s.tokens, s.doc_starts, s.counted)?
                    .finish_entry(dir, file)
            })
            .collect()
    };
    let all = || train.iter().chain(val);
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        tokenizer,
        vocab_size,
        eos_id,
        width,
        docs: all().all(|s| s.doc_starts.is_some()) && all().next().is_some(),
        mask: all().all(|s| s.counted.is_some()) && all().next().is_some(),
        train: write("train", train)?,
        val: write("val", val)?,
        inputs: Vec::new(),
        settings,
    };
    manifest.write(dir)?;
    Ok(manifest)
}
