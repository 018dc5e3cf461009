//! Writing shards: [`ShardWriter`], one shard built in memory and written atomically (what
//! `trainer prepare` streams its splits into), and [`write_prepared`], a whole prepared
//! directory from token streams already in memory (the text sources' token cache, and tests).

use std::path::Path;

use super::format::{
    checksum, chunk_sums, width_for_vocab, Manifest, PairEntry, ShardEntry, ShardHeader,
    TokenizerInfo, FLAG_DOCS, FLAG_MASK, FLAG_PAIRS, HEADER_LEN, MANIFEST_FORMAT,
};
use crate::error::{Error, Result};

/// Builds one shard in memory: tokens (stored at the shard's width), document starts and mask
/// bits, then [`ShardWriter::finish_entry`] writes it atomically.
#[derive(Clone, Debug)]
pub(crate) struct ShardWriter {
    width: u32,
    vocab: u64,
    flags: u32,
    tokens: Vec<u8>,
    n_tokens: u64,
    docs: Vec<u64>,
    mask: Vec<u8>,
    /// The pair table's bytes (with [`FLAG_PAIRS`]).
    pairs: Vec<u8>,
    max_token: u32,
}

impl ShardWriter {
    /// An empty shard of `width` (2 or 4) bytes a token for the vocabulary `vocab`, with a
    /// document-start stream if `docs` and a loss-mask stream if `mask`.
    pub fn new(width: u32, vocab: u64, docs: bool, mask: bool) -> Self {
        let flags = if docs { FLAG_DOCS } else { 0 } | if mask { FLAG_MASK } else { 0 };
        ShardWriter {
            width: if width == 2 { 2 } else { 4 },
            vocab,
            flags,
            tokens: Vec::new(),
            n_tokens: 0,
            docs: Vec::new(),
            mask: Vec::new(),
            pairs: Vec::new(),
            max_token: 0,
        }
    }

    /// The same writer with a pair table ([`FLAG_PAIRS`]; it needs the document stream),
    /// holding `entries` (those of the documents already pushed, in order).
    pub fn with_pairs(mut self, entries: &[PairEntry]) -> Self {
        self.flags |= FLAG_PAIRS | FLAG_DOCS;
        self.pairs = entries.iter().flat_map(PairEntry::to_bytes).collect();
        self
    }

    /// Marks the next pushed token as the start of a document that is the preference pair
    /// `entry` (its tokens pushed next); the entry is recorded only with a pair table.
    pub fn start_pair(&mut self, entry: &PairEntry) {
        self.start_doc();
        if self.flags & FLAG_PAIRS != 0 {
            self.pairs.extend_from_slice(&entry.to_bytes());
        }
    }

    /// Tokens so far.
    pub fn len(&self) -> u64 {
        self.n_tokens
    }

    /// Whether no token was pushed.
    pub fn is_empty(&self) -> bool {
        self.n_tokens == 0
    }

    /// Marks the next pushed token as the start of a document (recorded only with a document
    /// stream).
    pub fn start_doc(&mut self) {
        if self.flags & FLAG_DOCS != 0 && self.docs.last() != Some(&self.n_tokens) {
            self.docs.push(self.n_tokens);
        }
    }

    /// Appends `tokens`; `counted[i]` is the mask bit of `tokens[i]` (`None`: every token
    /// counts). Ignored without a mask stream. `counted`, when given, must be as long as
    /// `tokens` (missing flags count as `true`).
    pub fn push(&mut self, tokens: &[u32], counted: Option<&[bool]>) {
        for &t in tokens {
            self.max_token = self.max_token.max(t);
        }
        if self.width == 2 {
            self.tokens
                .extend(tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()));
        } else {
            self.tokens
                .extend(tokens.iter().flat_map(|&t| t.to_le_bytes()));
        }
        if self.flags & FLAG_MASK != 0 {
            for i in 0..tokens.len() {
                let bit = counted.is_none_or(|c| c.get(i).copied().unwrap_or(true));
                let t = self.n_tokens + i as u64;
                if t.is_multiple_of(8) {
                    self.mask.push(0);
                }
                if bit {
                    *self.mask.last_mut().expect("pushed above") |= 1 << (t % 8);
                }
            }
        }
        self.n_tokens += tokens.len() as u64;
    }

    /// The header and the body bytes (without writing anything). Fails, naming `path`, if a
    /// token does not fit the width.
    pub fn to_bytes(&self, path: &Path) -> Result<(ShardHeader, Vec<u8>)> {
        if self.width == 2 && self.max_token > u32::from(u16::MAX) {
            return Err(Error::data(
                path,
                format!(
                    "token id {} does not fit a 2-byte shard (vocabulary over 65536 ids needs \
                     width 4)",
                    self.max_token
                ),
            ));
        }
        let mut body =
            Vec::with_capacity(self.tokens.len() + 8 * self.docs.len() + self.mask.len());
        body.extend_from_slice(&self.tokens);
        if self.flags & FLAG_DOCS != 0 {
            body.extend(self.docs.iter().flat_map(|d| d.to_le_bytes()));
        }
        if self.flags & FLAG_MASK != 0 {
            body.extend_from_slice(&self.mask);
        }
        if self.flags & FLAG_PAIRS != 0 {
            body.extend_from_slice(&self.pairs);
        }
        let header = ShardHeader {
            width: self.width,
            n_tokens: self.n_tokens,
            n_docs: if self.flags & FLAG_DOCS != 0 {
                self.docs.len() as u64
            } else {
                0
            },
            flags: self.flags,
            checksum: checksum(&body),
            vocab: self.vocab,
        };
        let mut bytes = Vec::with_capacity(HEADER_LEN + body.len());
        bytes.extend_from_slice(&header.to_bytes());
        bytes.extend_from_slice(&body);
        Ok((header, bytes))
    }

    /// Writes the shard as `dir/file` atomically (temporary file, fsync, rename) and returns
    /// its manifest entry, with the checksums of its body's chunks.
    pub fn finish_entry(&self, dir: &Path, file: String) -> Result<ShardEntry> {
        let path = dir.join(&file);
        let (h, bytes) = self.to_bytes(&path)?;
        crate::io::write_atomic(&path, &bytes)?;
        Ok(ShardEntry {
            file,
            tokens: h.n_tokens,
            docs: h.n_docs,
            checksum: format!("{:016x}", h.checksum),
            chunk_sums: chunk_sums(&bytes[HEADER_LEN..]),
        })
    }
}

/// The [`ShardWriter`] holding `tokens`, optional document starts (ascending offsets) and
/// optional mask flags (one a token); `path` is named in errors.
pub(crate) fn shard_writer(
    path: &Path,
    width: u32,
    vocab: u64,
    tokens: &[u32],
    doc_starts: Option<&[u64]>,
    counted: Option<&[bool]>,
) -> Result<ShardWriter> {
    let mut w = ShardWriter::new(width, vocab, doc_starts.is_some(), counted.is_some());
    let starts = doc_starts.unwrap_or(&[]);
    let mut cut = 0usize;
    for (i, &s) in starts.iter().enumerate() {
        let s = (s as usize).min(tokens.len());
        if s < cut || (i > 0 && s == cut) {
            return Err(Error::data(
                path,
                "document starts must be strictly ascending",
            ));
        }
        w.push(
            &tokens[cut..s],
            counted.map(|c| &c[cut.min(c.len())..s.min(c.len())]),
        );
        w.start_doc();
        cut = s;
    }
    w.push(&tokens[cut..], counted.map(|c| &c[cut.min(c.len())..]));
    Ok(w)
}

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
        pairs: false,
        train: write("train", train)?,
        val: write("val", val)?,
        inputs: Vec::new(),
        settings,
    };
    manifest.write(dir)?;
    Ok(manifest)
}
