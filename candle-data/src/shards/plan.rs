//! What a prepared directory was made from: the input files (path, size, content digest),
//! the settings and the vocabulary, hashed into the *plan* an earlier run is compared with;
//! and, when they differ, what changed.
//!
//! A file's content digest (CRC-32 of its bytes, with its size) is read again only when its
//! size or modification time differ from the earlier run's record, so a rerun reads nothing
//! for unchanged inputs, and a `touch` (same bytes, new time) changes nothing.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use super::format::{InputEntry, TokenizerInfo};
use crate::digest::file_crc32 as digest;
use crate::error::{Error, Result};
use crate::hash::hash_bytes;

/// The record of each of `files`: size, modification time and content digest, the digest
/// taken from `earlier` when the path, size and time are the same there.
pub(crate) fn record_inputs(files: &[PathBuf], earlier: &[InputEntry]) -> Result<Vec<InputEntry>> {
    files
        .iter()
        .map(|p| {
            let m = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
            let mtime_ns = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_nanos());
            let known = earlier
                .iter()
                .find(|e| &e.path == p && e.bytes == m.len() && e.mtime_ns == mtime_ns)
                .and_then(|e| e.digest.clone());
            let digest = match known {
                Some(d) => d,
                None => digest(p)?,
            };
            Ok(InputEntry {
                path: p.clone(),
                bytes: m.len(),
                mtime_ns,
                digest: Some(digest),
            })
        })
        .collect()
}

/// The plan: a hash of the settings, the inputs' paths, sizes and digests (not their times)
/// and the vocabulary.
pub(crate) fn plan(
    settings: &serde_json::Value,
    inputs: &[InputEntry],
    tokenizer: &TokenizerInfo,
) -> Result<String> {
    let files: Vec<(&Path, u64, &Option<String>)> = inputs
        .iter()
        .map(|i| (i.path.as_path(), i.bytes, &i.digest))
        .collect();
    let text = serde_json::to_string(&("plan 2", settings, files, tokenizer))
        .map_err(|e| Error::Config(e.to_string()))?;
    Ok(format!("{:016x}", hash_bytes(text.as_bytes())))
}

/// The plan as trainers before input digests computed it (settings, inputs with their
/// times, vocabulary), so that their finished directories stay up to date.
pub(crate) fn legacy_plan(
    settings: &serde_json::Value,
    inputs: &[InputEntry],
    tokenizer: &TokenizerInfo,
) -> Result<String> {
    let inputs: Vec<InputEntry> = inputs
        .iter()
        .map(|i| InputEntry {
            digest: None,
            ..i.clone()
        })
        .collect();
    let text = serde_json::to_string(&(settings, &inputs, tokenizer))
        .map_err(|e| Error::Config(e.to_string()))?;
    Ok(format!("{:016x}", hash_bytes(text.as_bytes())))
}

/// What an earlier run was made from.
pub(crate) struct Earlier<'a> {
    pub settings: &'a serde_json::Value,
    pub inputs: &'a [InputEntry],
    pub tokenizer: Option<&'a TokenizerInfo>,
}

/// What differs between `earlier` and now, one clause each: inputs added, removed, resized or
/// with other content (same size, another digest), settings and the vocabulary.
pub(crate) fn changes(
    earlier: &Earlier<'_>,
    settings: &serde_json::Value,
    inputs: &[InputEntry],
    tokenizer: &TokenizerInfo,
) -> String {
    let mut out = Vec::new();
    for now in inputs {
        let p = now.path.display();
        match earlier.inputs.iter().find(|e| e.path == now.path) {
            None => out.push(format!("input {p} is new")),
            Some(e) if e.bytes != now.bytes => out.push(format!(
                "input {p} changed size ({} -> {} bytes)",
                e.bytes, now.bytes
            )),
            Some(e) if e.digest.is_some() && e.digest != now.digest => out.push(format!(
                "input {p} changed content (same {} bytes, CRC-32 {} -> {})",
                now.bytes,
                e.digest.as_deref().unwrap_or_default(),
                now.digest.as_deref().unwrap_or_default()
            )),
            Some(e) if e.digest.is_none() && e.mtime_ns != now.mtime_ns => out.push(format!(
                "input {p} has another modification time (the earlier run recorded no \
                 content digest to compare)"
            )),
            Some(_) => {}
        }
    }
    for e in earlier.inputs {
        if !inputs.iter().any(|i| i.path == e.path) {
            out.push(format!("input {} is gone", e.path.display()));
        }
    }
    if let (Some(was), Some(now)) = (earlier.settings.as_object(), settings.as_object()) {
        for (k, v) in now {
            let old = was.get(k).unwrap_or(&serde_json::Value::Null);
            if k != "plan" && old != v {
                out.push(format!("setting {k} changed ({old} -> {v})"));
            }
        }
        // A setting recorded only when it is not the default (`input_format`).
        for (k, old) in was.iter().filter(|(k, _)| !now.contains_key(*k)) {
            out.push(format!("setting {k} changed ({old} -> default)"));
        }
    }
    if earlier.tokenizer.is_some_and(|t| t != tokenizer) {
        out.push("the vocabulary changed".into());
    }
    if out.is_empty() {
        out.push("the earlier run recorded too little to say what".into());
    }
    out.join("; ")
}
