//! A checkpoint's identity: `manifest.json`, written last into the checkpoint, records the
//! format version, the step and a digest of every other file. Loading checks it, so a
//! checkpoint is one unit: a file copied in from another checkpoint or run, an edited file
//! (the step in `trainer_state.json`, say), a file added or removed, or a directory renamed to
//! another step is an error naming the file. Later kinds of checkpoint extend what the
//! manifest records.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};
use candle_data::digest::check_format;
use candle_data::io;

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The checkpoint format this trainer writes and reads.
pub(crate) const FORMAT: u32 = 1;

/// What `manifest.json` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Checkpoint format version (`FORMAT`).
    pub format: u32,
    /// The optimiser step the checkpoint was saved after.
    pub step: usize,
    /// Every other file of the checkpoint, with the hex digest of its bytes.
    pub files: BTreeMap<String, String>,
}

/// The digest of a file's bytes (a stable 64-bit hash, read in 8 MiB chunks), shared with the
/// data crate's manifests.
pub use candle_data::digest::file_digest as digest;

/// The checkpoint's files but the manifest, sorted.
fn files_of(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name != MANIFEST_FILE {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Writes the manifest of the checkpoint in `dir` (saved after `step`), after all its other
/// files.
pub fn write(dir: &Path, step: usize) -> Result<()> {
    let mut files = BTreeMap::new();
    for name in files_of(dir)? {
        files.insert(name.clone(), digest(&dir.join(&name))?);
    }
    let manifest = Manifest {
        format: FORMAT,
        step,
        files,
    };
    io::write_json(&dir.join(MANIFEST_FILE), &manifest)
}

/// Checks that the checkpoint in `dir` is the unit its manifest describes, saved after `step`
/// (the step its `trainer_state.json` records): every listed file present with its digest, no
/// other file, the step the directory's name and the state say.
pub(crate) fn verify(dir: &Path, step: usize) -> Result<()> {
    let path = dir.join(MANIFEST_FILE);
    if !path.is_file() {
        return Err(Error::checkpoint(
            &path,
            "missing: every checkpoint records its files in manifest.json (written last); \
             without it this is an incomplete checkpoint or one from an older trainer",
        ));
    }
    let m: Manifest = io::read_json(&path)?;
    check_format("checkpoint", m.format, FORMAT, |msg| {
        candle_data::Error::checkpoint(&path, msg)
    })?;
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step-"))
        .and_then(|n| n.parse::<usize>().ok());
    if named.is_some_and(|n| n != m.step) || m.step != step {
        return Err(Error::checkpoint(
            &path,
            format!(
                "records step {} but the directory is {} and trainer_state.json says step \
                 {step}: the files come from different checkpoints",
                m.step,
                dir.display()
            ),
        ));
    }
    let present = files_of(dir)?;
    for name in &present {
        let Some(want) = m.files.get(name) else {
            return Err(Error::checkpoint(
                dir.join(name),
                "is not part of this checkpoint (not in its manifest.json)",
            ));
        };
        if digest(&dir.join(name))? != *want {
            return Err(Error::checkpoint(
                dir.join(name),
                "is not the file this checkpoint saved (its digest differs from manifest.json): \
                 copied from another checkpoint or run, or changed",
            ));
        }
    }
    if let Some(missing) = m.files.keys().find(|n| !present.contains(n)) {
        return Err(Error::checkpoint(
            dir.join(missing),
            "is missing (listed in manifest.json)",
        ));
    }
    Ok(())
}
