//! The preference pairs of a prepared directory with the pair layout (`trainer prepare
//! --format preference`; see [`super::format`]'s pair layout), read whole: each split's
//! shards verified (checksums, document starts, pair table) and their pairs put back
//! together, a pair that continues from one shard into the next included.

use std::path::{Path, PathBuf};

use super::format::{open_shard, Manifest, PairEntry, MANIFEST_FILE};
use crate::error::{Error, Result};
use crate::sft::PreferencePair;
use crate::Split;

/// A pair and the line of the input file its record was read from.
pub(crate) type LinePair = (usize, PreferencePair);

/// The pairs of `split` of the prepared directory `dir` (whose manifest is `manifest`), in
/// order.
pub(crate) fn read_pairs(dir: &Path, manifest: &Manifest, split: Split) -> Result<Vec<LinePair>> {
    let expect = manifest.expect();
    let mut tokens: Vec<u32> = Vec::new();
    // (first token in the split's stream, entry, shard file) of each pair
    let mut docs: Vec<(usize, PairEntry, PathBuf)> = Vec::new();
    for entry in manifest.shards(split) {
        let path = dir.join(&entry.file);
        let shard = open_shard(&path, &expect)?;
        shard.verify()?;
        let sum = format!("{:016x}", shard.header().checksum);
        if sum != entry.checksum || !shard.header().has_pairs() {
            return Err(Error::data(
                &path,
                format!(
                    "does not match {} (checksum {sum}, listed {}; pair table: {}); prepare \
                     the directory again",
                    dir.join(MANIFEST_FILE).display(),
                    entry.checksum,
                    shard.header().has_pairs()
                ),
            ));
        }
        let base = tokens.len();
        for (s, pair) in shard.doc_starts().zip(shard.pairs()) {
            docs.push((base + s as usize, pair, path.clone()));
        }
        tokens.extend(shard.tokens());
    }
    if docs.first().is_some_and(|d| d.0 != 0) {
        return Err(Error::data(
            &docs[0].2,
            "the first shard of the split does not start with a pair",
        ));
    }
    let ends = docs.iter().skip(1).map(|d| d.0).chain([tokens.len()]);
    docs.iter()
        .zip(ends)
        .map(|((s, p, path), end)| {
            let (s, c) = (*s, p.chosen_len as usize);
            if s + p.len() as usize != end {
                return Err(Error::data(
                    path,
                    format!(
                        "the pair of line {} holds {} tokens from token {s} of the split, but \
                         the next pair starts at {end}",
                        p.line,
                        p.len()
                    ),
                ));
            }
            let pair = PreferencePair {
                prompt_len: p.prompt_len as usize,
                chosen: tokens[s..s + c].to_vec(),
                rejected: tokens[s + c..end].to_vec(),
            };
            Ok((p.line as usize, pair))
        })
        .collect()
}
