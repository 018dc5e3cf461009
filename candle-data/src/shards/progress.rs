//! `prepare`'s state on disk between runs: `progress.json` (finished shards, the unfinished ones
//! saved as `partial-*.tok`, where to restart, what the run was made from), and the clean-up
//! of an earlier run's files.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::format::{self, Expect, InputEntry, ShardEntry, TokenizerInfo, MANIFEST_FILE};
use super::unit::Position;
use super::write::{shard_writer, ShardWriter};
use crate::error::{Error, Result};

/// The file recording an unfinished `prepare`.
pub const PROGRESS_FILE: &str = "progress.json";

/// One split at a progress save: its name, finished shards and open shard.
pub(super) type SplitState<'a> = (&'static str, &'a [ShardEntry], &'a ShardWriter);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Progress {
    pub plan: String,
    pub resume: Position,
    pub train: Vec<ShardEntry>,
    pub val: Vec<ShardEntry>,
    /// The unfinished train and val shards at `resume`, saved as `partial-*.tok` files (absent
    /// in progress files of older trainers, whose `resume` is where the oldest unfinished
    /// shard began).
    #[serde(default)]
    pub partial: [Option<ShardEntry>; 2],
    /// What the run was made from, to say what changed (absent in older progress files).
    #[serde(default)]
    pub inputs: Vec<InputEntry>,
    #[serde(default)]
    pub settings: serde_json::Value,
    #[serde(default)]
    pub tokenizer: Option<TokenizerInfo>,
}

/// Records the finished shards and saves the unfinished ones as
/// `partial-<split>-<NNNNN>-<tokens>.tok` (their content is a function of that name), so that a rerun restarts at `next`, the end of
/// the unit just fed, whatever the splits' fill; then `progress.json` (atomically) and then
/// the removal of older partial files.
pub(super) fn save_progress(
    dir: &Path,
    base: &Progress,
    next: Position,
    streams: [SplitState<'_>; 2],
) -> Result<()> {
    let mut partial = [None, None];
    for (slot, (name, done, writer)) in partial.iter_mut().zip(&streams) {
        if writer.is_empty() {
            continue;
        }
        let file = format!("partial-{name}-{:05}-{}.tok", done.len(), writer.len());
        *slot = Some(writer.finish_entry(dir, file)?);
    }
    let p = Progress {
        resume: next,
        train: streams[0].1.to_vec(),
        val: streams[1].1.to_vec(),
        partial,
        ..base.clone()
    };
    crate::io::write_json(&dir.join(PROGRESS_FILE), &p)?;
    let keep: Vec<&str> = p
        .partial
        .iter()
        .flatten()
        .map(|e| e.file.as_str())
        .collect();
    remove_partials(dir, &keep)
}

/// An unfinished shard saved by [`save_progress`], verified, as the writer it was.
pub(super) fn load_partial(path: &Path, expect: &Expect) -> Result<ShardWriter> {
    let shard = format::open_shard(path, expect)?;
    shard.verify()?;
    let h = shard.header();
    let starts: Vec<u64> = shard.doc_starts().collect();
    let counted: Option<Vec<bool>> = h
        .has_mask()
        .then(|| (0..shard.len()).map(|t| shard.counted(t)).collect());
    let writer = shard_writer(
        path,
        h.width,
        h.vocab,
        &shard.tokens(),
        h.has_docs().then_some(&starts[..]),
        counted.as_deref(),
    )?;
    Ok(match h.has_pairs() {
        true => writer.with_pairs(&shard.pairs().collect::<Vec<_>>()),
        false => writer,
    })
}

/// Removes the `partial-*.tok` files not in `keep`.
pub(super) fn remove_partials(dir: &Path, keep: &[&str]) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_partial(&name) && !keep.contains(&name.as_str()) {
            std::fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
        }
    }
    Ok(())
}

pub(super) fn is_partial(name: &str) -> bool {
    name.starts_with("partial-") && name.ends_with(".tok")
}

pub(super) fn verify_all(dir: &Path, list: &[ShardEntry], expect: &Expect) -> Result<()> {
    for e in list {
        let path = dir.join(&e.file);
        let h = format::verify(&path, expect)?;
        if format!("{:016x}", h.checksum) != e.checksum {
            return Err(Error::data(&path, "checksum differs from the recorded one"));
        }
    }
    Ok(())
}

/// Removes the shards, manifest and progress file of an earlier run.
pub(super) fn clear(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = (name.starts_with("train-") || name.starts_with("val-"))
            && name.ends_with(".tok")
            || is_partial(&name)
            || name == MANIFEST_FILE
            || name == PROGRESS_FILE;
        if ours {
            std::fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
        }
    }
    Ok(())
}

/// Removes temporary files a killed run left (`.<name>.tmp-<pid>-<n>`).
pub(super) fn remove_temporaries(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp-") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}
