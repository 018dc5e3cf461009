//! [`ShardSource`]: training batches read from memory-mapped token shards.

use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;

use super::format::{Manifest, MANIFEST_FILE};
use super::order::{self, DataOrder, Window};
use super::view::{scan_raw, BodySums, ShardView};
use crate::error::{Error, Result};
use crate::vocab::Vocab;
use crate::Rows;
use crate::{Batch, BatchRequest, DataSource, Fingerprint, Split};

/// How a [`ShardSource`] reads its shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardOptions {
    /// Random windows or one pass per epoch.
    pub order: DataOrder,
    /// Give each row its documents' positions (restarting at every document start) and ids,
    /// so attention stays within a document (needs shards with a document-start stream).
    pub doc_mask: bool,
    /// The `tokenizer.json` to decode with (default: the manifest's); for nanoGPT `.bin`
    /// files, the vocabulary of the ids.
    pub tokenizer: Option<PathBuf>,
}

/// Batches of windows read from a directory of token shards, memory-mapped: a directory
/// `trainer prepare` wrote (`manifest.json`, `train-*.tok`, `val-*.tok`) or nanoGPT's
/// `train.bin` / `val.bin` (bare `u16` tokens).
///
/// Windows of `block_size + 1` tokens never cross a shard boundary. The order
/// ([`DataOrder`]) is random windows weighted by shard size, or one pass per epoch over
/// non-overlapping windows in a seeded order; either way the batch is a pure function of the
/// generator passed to [`DataSource::batch`], whose position is also the epoch-order cursor
/// (see the `shards::order` module), so a checkpoint's generator state resumes the data stream exactly.
///
/// With a loss-mask stream (SFT shards) the batch carries [`Batch::mask`] (target `j` of a row
/// counts when its token's mask bit is set); with [`ShardOptions::doc_mask`] it carries the
/// rows' document positions and ids ([`Batch::rows`]).
pub struct ShardSource {
    /// What errors name: the directory, or the text file a token cache was made from.
    dir: PathBuf,
    train: Vec<ShardView>,
    val: Vec<ShardView>,
    options: ShardOptions,
    mask: bool,
    vocab: Vocab,
    vocab_size: usize,
    description: String,
    fingerprint: Fingerprint,
}

/// `1234567` -> `"1.2M"`, for log lines.
pub(crate) fn human(n: usize) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1}k", n as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}G", n as f64 / 1e9),
    }
}

/// Errors when `manifest` (of `dir`) lists preference pairs, which a [`ShardSource`] does not
/// serve.
fn refuse_pairs(manifest: &Manifest, dir: &Path) -> Result<()> {
    if !manifest.pairs {
        return Ok(());
    }
    Err(Error::data(
        dir,
        "holds preference pairs (prepared with --format preference), not windows of tokens: \
         open it with trainer::data::open (--data shards), which serves its pairs",
    ))
}

impl ShardSource {
    /// Opens `dir`: a prepared directory (its `manifest.json`), else nanoGPT's raw
    /// `train.bin` and `val.bin`. Every shard is mapped and its header checked against the
    /// manifest (sizes, checksums, vocabulary). The bodies are not read here: each read
    /// verifies the 1 MiB chunks it touches against the manifest's checksums first, once each
    /// (`trainer prepare --verify DIR` checks a whole directory).
    pub fn open(dir: &Path, options: ShardOptions) -> Result<Self> {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
        if !meta.is_dir() {
            return Err(Error::data(
                dir,
                "is not a directory; --data shards reads a directory `trainer prepare` wrote \
                 (manifest.json + train-*.tok + val-*.tok) or one holding nanoGPT's train.bin \
                 and val.bin",
            ));
        }
        if dir.join(MANIFEST_FILE).is_file() {
            Self::open_prepared(dir, options)
        } else if dir.join("train.bin").is_file() {
            Self::open_nanogpt(dir, options)
        } else {
            Err(Error::data(
                dir,
                "holds neither a manifest.json (an unfinished or foreign directory? run \
                 `trainer prepare`) nor nanoGPT's train.bin / val.bin",
            ))
        }
    }

    fn open_prepared(dir: &Path, options: ShardOptions) -> Result<Self> {
        let manifest = Manifest::read(dir)?;
        refuse_pairs(&manifest, dir)?;
        let expect = manifest.expect();
        let open_split = |split: Split| -> Result<Vec<ShardView>> {
            manifest
                .shards(split)
                .iter()
                .map(|entry| {
                    let path = dir.join(&entry.file);
                    let sums = BodySums::parse(&entry.chunk_sums, &dir.join(MANIFEST_FILE))?;
                    let view = ShardView::open_tok(&path, &expect, Some(sums))?;
                    let sum = format!("{:016x}", view.checksum);
                    if view.len() as u64 != entry.tokens || sum != entry.checksum {
                        return Err(Error::data(
                            &path,
                            format!(
                                "does not match {}: {} tokens with checksum {sum}, the \
                                 manifest lists {} with {}; prepare the directory again",
                                dir.join(MANIFEST_FILE).display(),
                                view.len(),
                                entry.tokens,
                                entry.checksum
                            ),
                        ));
                    }
                    Ok(view)
                })
                .collect()
        };
        let (train, val) = (open_split(Split::Train)?, open_split(Split::Val)?);
        if manifest
            .train
            .iter()
            .chain(&manifest.val)
            .any(|e| e.chunk_sums.is_empty())
        {
            tracing::warn!(
                "{} has no per-chunk checksums (prepared by an older trainer): each shard is \
                 verified whole when first read; prepare it again for per-window checks",
                dir.join(MANIFEST_FILE).display()
            );
        }
        let info = &manifest.tokenizer;
        let vocab = match info.kind.as_str() {
            "byte" => Vocab::Byte,
            "char" => {
                let chars = info.chars.as_deref().unwrap_or_default();
                Vocab::chars(chars.chars().collect())
            }
            "tokenizer" => {
                let path = options.tokenizer.clone().or_else(|| info.path.clone());
                match path {
                    Some(p) => Vocab::tokenizer(&p)?,
                    None => {
                        return Err(Error::data(
                            dir.join(MANIFEST_FILE),
                            "names no tokenizer.json; give --tokenizer-path",
                        ))
                    }
                }
            }
            other => {
                return Err(Error::data(
                    dir.join(MANIFEST_FILE),
                    format!("unknown tokenizer kind `{other}` (expected tokenizer, char or byte)"),
                ))
            }
        };
        let hash = format!("{:016x}", vocab.hash());
        if hash != info.hash {
            return Err(Error::data(
                dir,
                format!(
                    "was prepared with another vocabulary (hash {}) than the {} one given \
                     (hash {hash}); prepare it again or give its tokenizer",
                    info.hash, info.kind
                ),
            ));
        }
        let fingerprint = Fingerprint {
            tokens: format!("{:016x}", manifest.fingerprint()),
            vocab: info.hash.clone(),
        };
        let vocab_size = (manifest.vocab_size as usize).max(vocab.size());
        let what = format!("prepared shards, {} vocab {vocab_size}", info.kind);
        Self::assemble(
            dir,
            train,
            val,
            options,
            manifest.mask,
            manifest.docs,
            (vocab, vocab_size, what, fingerprint),
        )
    }

    fn open_nanogpt(dir: &Path, options: ShardOptions) -> Result<Self> {
        let val_path = dir.join("val.bin");
        if !val_path.is_file() {
            return Err(Error::data(
                &val_path,
                "missing: a nanoGPT data directory holds train.bin and val.bin",
            ));
        }
        let train = ShardView::open_raw_u16(&dir.join("train.bin"))?;
        let val = ShardView::open_raw_u16(&val_path)?;
        let vocab = match &options.tokenizer {
            Some(p) => Vocab::tokenizer(p)?,
            None => Vocab::Ids,
        };
        // One pass over each file: the content hash and the largest id.
        let (train_hash, train_max) = scan_raw(&train);
        let (val_hash, val_max) = scan_raw(&val);
        let vocab_size = vocab.size().max(train_max.max(val_max) as usize + 1);
        let fingerprint = Fingerprint {
            tokens: format!(
                "{:016x}",
                crate::hash::splitmix64(train_hash) ^ val_hash.rotate_left(17)
            ),
            vocab: format!("{:016x}", vocab.hash()),
        };
        let what = format!("nanoGPT train.bin/val.bin, vocab {vocab_size}");
        let parts = (vocab, vocab_size, what, fingerprint);
        Self::assemble(dir, vec![train], vec![val], options, false, false, parts)
    }

    /// A source over already-opened shards (the text sources' cache); `what` describes the
    /// vocabulary in [`DataSource::describe`].
    pub(crate) fn assemble(
        dir: &Path,
        train: Vec<ShardView>,
        val: Vec<ShardView>,
        options: ShardOptions,
        mask: bool,
        docs: bool,
        (vocab, vocab_size, what, fingerprint): (Vocab, usize, String, Fingerprint),
    ) -> Result<Self> {
        if options.doc_mask && !(docs && train.iter().chain(&val).all(ShardView::has_docs)) {
            return Err(Error::data(
                dir,
                "--doc-mask needs shards with a document-start stream (prepare the data \
                 with documents)",
            ));
        }
        let mask = mask && train.iter().chain(&val).all(ShardView::has_mask);
        let count = |v: &[ShardView]| v.iter().map(ShardView::len).sum::<usize>();
        let description = format!(
            "{}: {what}, {} train tokens in {} shard(s) / {} val tokens in {}, {} order",
            dir.display(),
            human(count(&train)),
            train.len(),
            human(count(&val)),
            val.len(),
            options.order
        );
        Ok(ShardSource {
            dir: dir.to_path_buf(),
            train,
            val,
            options,
            mask,
            vocab,
            vocab_size,
            description,
            fingerprint,
        })
    }

    /// The shards of `split`.
    fn shards(&self, split: Split) -> &[ShardView] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// The files of `split`'s shards, in order.
    pub fn shard_paths(&self, split: Split) -> Vec<PathBuf> {
        self.shards(split)
            .iter()
            .map(|s| s.path().to_path_buf())
            .collect()
    }

    /// Tokens `start..start + len` of shard `shard` of `split` (panics out of range), after
    /// verifying the bytes they lie in.
    pub fn read(&self, split: Split, shard: usize, start: usize, len: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(len);
        self.shards(split)[shard].read(start, len, &mut out)?;
        Ok(out)
    }

    /// Number of tokens in `split`.
    pub fn len(&self, split: Split) -> usize {
        self.shards(split).iter().map(ShardView::len).sum()
    }

    /// Whether `split` holds no token.
    pub fn is_empty(&self, split: Split) -> bool {
        self.len(split) == 0
    }

    /// The `count` windows of `block_size + 1` tokens (shard index, first token) the next
    /// batch of `split` reads, moving `rng` as [`DataSource::batch`] does.
    pub fn windows(
        &self,
        split: Split,
        count: usize,
        block_size: usize,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<Window>> {
        let lens: Vec<usize> = self.shards(split).iter().map(ShardView::len).collect();
        let w = block_size + 1;
        let windows = match self.options.order {
            DataOrder::Random => order::random_windows(&lens, w, count, rng),
            DataOrder::Epoch => {
                let key = match split {
                    Split::Train => 0x7261_696e,
                    Split::Val => 0x0076_616c,
                };
                order::epoch_windows(&lens, w, count, key, rng)
            }
        };
        windows.ok_or_else(|| self.too_short(split, block_size))
    }

    fn too_short(&self, split: Split, block_size: usize) -> Error {
        let longest = self
            .shards(split)
            .iter()
            .map(ShardView::len)
            .max()
            .unwrap_or(0);
        let msg =
            match split {
                Split::Val if longest == 0 && self.dir.join(MANIFEST_FILE).is_file() => {
                    "holds no validation tokens: it was prepared without a validation split \
                 (`trainer prepare --val-fraction 0`, the default); prepare it again with one, \
                 e.g. --val-fraction 0.005"
                        .to_string()
                }
                Split::Val if longest == 0 => {
                    "holds no validation tokens (an empty val.bin, or a corpus too small for its \
                 --val-fraction)"
                        .to_string()
                }
                Split::Train if longest == 0 => "holds no training tokens".to_string(),
                _ => {
                    format!(
                "no {} shard holds one window of block_size + 1 = {} tokens (the longest has \
                 {longest}); use a smaller block_size, or prepare again with larger shards{}",
                if split == Split::Train { "train" } else { "val" },
                block_size + 1,
                if split == Split::Val {
                    " or a larger --val-fraction"
                } else {
                    ""
                }
            )
                }
            };
        Error::data(&self.dir, msg)
    }

    /// Positions (restarting at each document start) and document ids (0, 1, ... within the
    /// row) of the inputs of window `(shard, start)`.
    fn doc_rows(
        &self,
        shard: &ShardView,
        start: usize,
        block_size: usize,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let mut positions = Vec::with_capacity(block_size);
        let mut doc_ids = Vec::with_capacity(block_size);
        let starts = shard.doc_starts_in(start + 1, start + block_size)?;
        let (mut next, mut doc, mut pos) = (starts.into_iter().peekable(), 0u32, 0u32);
        for t in start..start + block_size {
            if next.peek() == Some(&t) {
                next.next();
                doc += 1;
                pos = 0;
            }
            positions.push(pos);
            doc_ids.push(doc);
            pos += 1;
        }
        Ok((positions, doc_ids))
    }
}

impl DataSource for ShardSource {
    source_methods!(fields);

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        let (split, batch_size, block_size) = (want.split, want.batch_size, want.block_size);
        let windows = self.windows(split, batch_size, block_size, rng)?;
        let shards = self.shards(split);
        let w = block_size + 1;
        let mut rows = Vec::with_capacity(batch_size * w);
        for &(s, t) in &windows {
            shards[s].read(t, w, &mut rows)?;
        }
        let mask = match self.mask {
            true => Some(
                windows
                    .iter()
                    .flat_map(|&(s, t)| (t + 1..t + w).map(move |i| (s, i)))
                    .map(|(s, i)| Ok(f32::from(u8::from(shards[s].counts(i)?))))
                    .collect::<Result<Vec<f32>>>()?,
            ),
            false => None,
        };
        let mut batch = want.batch_of(&rows, mask)?;
        if self.options.doc_mask {
            let (mut positions, mut doc_ids) = (Vec::new(), Vec::new());
            for &(s, t) in &windows {
                let (p, d) = self.doc_rows(&shards[s], t, block_size)?;
                positions.extend(p);
                doc_ids.extend(d);
            }
            let shape = (batch_size, block_size);
            batch.rows = Rows {
                positions: Some(crate::transfer::upload(positions, shape, want.device)?),
                doc_ids: Some(crate::transfer::upload(doc_ids, shape, want.device)?),
                tokens: batch.rows.tokens.take(),
            };
        }
        Ok(batch)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.vocab.encode(text, &self.dir)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.vocab.decode(ids, self.vocab_size, &self.dir)
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        let w = block_size + 1;
        for split in [Split::Train, Split::Val] {
            if !self.shards(split).iter().any(|s| s.len() >= w) {
                return Err(self.too_short(split, block_size));
            }
        }
        Ok(())
    }

    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }
}

#[cfg(test)]
#[path = "source_tests.rs"]
mod tests;
