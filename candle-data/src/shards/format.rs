//! One token shard file (`<split>-<NNNNN>.tok`) and the dataset manifest (`manifest.json`).
//!
//! # Shard layout (little-endian)
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0  | 8 | magic `b"CTTOKEN1"` |
//! | 8  | 4 | format version ([`VERSION`], 1) |
//! | 12 | 4 | token width in bytes: 2 (`u16`) or 4 (`u32`), see `width_for_vocab` |
//! | 16 | 8 | `n_tokens` |
//! | 24 | 8 | `n_docs`: documents *starting* in this shard (0 without a document stream) |
//! | 32 | 4 | flags: bit 0 (`FLAG_DOCS`) document-start stream, bit 1 (`FLAG_MASK`) loss mask, bit 2 (`FLAG_PAIRS`) pair table |
//! | 36 | 4 | reserved, 0 |
//! | 40 | 8 | checksum: [`checksum`] of every byte after the header |
//! | 48 | 8 | vocabulary hash (`tokenizer_vocab_hash`, `char_vocab_hash`, [`byte_vocab_hash`]) |
//! | 56 | 8 | reserved, 0 |
//! | 64 | … | body |
//!
//! Body: the tokens (`n_tokens * width` bytes); then, with `FLAG_DOCS`, `n_docs` `u64`
//! token offsets (strictly ascending, each `< n_tokens`) where documents start; then, with
//! `FLAG_MASK`, `ceil(n_tokens / 8)` bytes of loss mask, LSB first: bit `t` (byte `t / 8`, bit
//! `t % 8`) says whether token `t` counts *as a target*, i.e. whether predicting token `t` from
//! the tokens before it counts in the loss. This is exactly
//! [`Example::counted`](crate::sft::Example::counted) laid end to end; bit 0 of a shard
//! concerns the prediction of its first token from the previous shard's last one (a reader that
//! does not cross shards ignores it). Unused bits of the last byte are 0.
//!
//! # Pair layout (`trainer prepare --format preference`)
//!
//! With `FLAG_PAIRS` (always with `FLAG_DOCS`) each document is one preference pair: its
//! prompt + chosen sequence, then its prompt + rejected sequence, tokenised as `data =
//! preference` tokenises them ([`PreferencePair`](crate::sft::PreferencePair)); no EOS
//! is appended between documents. After the mask stream the body holds `n_docs` [`PairEntry`]s
//! of `PAIR_ENTRY_LEN` bytes, one per document starting in the shard, in order: four
//! little-endian `u64`s, the prompt's length (the tokens at the start of both sequences that
//! do not count), the chosen sequence's length, the rejected sequence's length (the document's
//! length is their sum: the chosen sequence ends and the rejected one starts at its start +
//! the chosen length), and the 1-based line of the input file the record was read from (what
//! `dpo_reference.json` keys the pair's reference values by).
//!
//! Documents are separated by the tokenizer's EOS id, appended after each document (it belongs
//! to the document it ends). A document may continue from one shard into the next; only the
//! shard where it starts lists it.
//!
//! Because the header is 64 bytes and a memory map is page aligned, the token array of a
//! mapped shard is aligned for its width.
//!
//! # Dataset directory
//!
//! `train-00000.tok`, `train-00001.tok`, …, `val-00000.tok`, … and [`MANIFEST_FILE`]
//! (a [`Manifest`], written last and atomically: a directory without it is unfinished).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::hash::hash_bytes;

pub use super::manifest::{InputEntry, Manifest, ShardEntry, TokenizerInfo};

/// The first 8 bytes of every shard.
pub const MAGIC: &[u8; 8] = b"CTTOKEN1";
/// The shard format version this code writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header before the body.
pub const HEADER_LEN: usize = 64;
/// Header flag: the body holds the document-start stream.
pub(crate) const FLAG_DOCS: u32 = 1;
/// Header flag: the body holds the loss-mask stream.
pub(crate) const FLAG_MASK: u32 = 2;
/// Header flag: the body holds the pair table (one [`PairEntry`] a document; see the module
/// docs' pair layout).
pub(crate) const FLAG_PAIRS: u32 = 4;
/// Bytes of one [`PairEntry`] in a shard's pair table.
pub(crate) const PAIR_ENTRY_LEN: usize = 32;
/// The manifest's file name in a prepared directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The manifest format this code writes and reads.
pub(crate) const MANIFEST_FORMAT: u32 = 1;
/// Body bytes covered by one checksum of [`ShardEntry::chunk_sums`]: a window read during
/// training verifies only the chunks it touches (once each), so opening a corpus reads none
/// of it and a flipped byte is still never trained on. 1 MiB: about 0.1 ms of CRC-32 per
/// chunk, 8 hex digits a MiB in the manifest.
pub(crate) const CHECK_CHUNK: u64 = 1 << 20;

/// The token width (bytes per token) for a vocabulary of `vocab_size` ids: 2 when every id
/// fits in a `u16` (`vocab_size <= 65536`), else 4.
pub(crate) fn width_for_vocab(vocab_size: usize) -> u32 {
    if vocab_size <= 1 << 16 {
        2
    } else {
        4
    }
}

/// The checksum stored in a shard header: the crate's `Hasher64` over `body` as one call.
///
/// Feeding the same bytes in pieces whose lengths are multiples of 8 (all but the last) gives
/// the same value, which is how the shard writer streams it.
pub fn checksum(body: &[u8]) -> u64 {
    hash_bytes(body)
}

/// The CRC-32 of every `CHECK_CHUNK`-byte chunk of `body` (the last may be shorter), as
/// [`ShardEntry::chunk_sums`] records them: 8 hex digits each, concatenated.
pub(crate) fn chunk_sums(body: &[u8]) -> String {
    body.chunks(CHECK_CHUNK as usize)
        .map(|c| format!("{:08x}", crc32fast::hash(c)))
        .collect()
}

/// Vocabulary hash of a Hugging Face tokenizer: the hash of its canonical JSON
/// (`Tokenizer::to_string(false)`: model, vocab, merges, added tokens), independent of the
/// file's formatting. The same value as a tokenizer-encoded text source's fingerprint
/// vocabulary.
pub(crate) fn tokenizer_vocab_hash(tokenizer: &tokenizers::Tokenizer) -> u64 {
    hash_bytes(tokenizer.to_string(false).unwrap_or_default().as_bytes())
}

/// Vocabulary hash of a character vocabulary (`chars` sorted ascending, id = position), as
/// a text source computes it.
pub(crate) fn char_vocab_hash(chars: &[char]) -> u64 {
    hash_bytes(chars.iter().collect::<String>().as_bytes())
}

/// Vocabulary hash of the byte vocabulary (256 ids), as a text source computes it.
pub fn byte_vocab_hash() -> u64 {
    hash_bytes(b"byte vocabulary")
}

/// One preference pair of a shard's pair table: the document starting at the matching
/// document start holds `chosen_len` tokens of prompt + chosen completion, then `rejected_len`
/// tokens of prompt + rejected completion, both starting with the `prompt_len` prompt tokens.
///
/// ```
/// use candle_data::shards::format::PairEntry;
/// let e = PairEntry { prompt_len: 3, chosen_len: 5, rejected_len: 6, line: 7 };
/// let bytes = e.to_bytes();
/// assert_eq!((bytes.len(), e.len()), (32, 11)); // four little-endian u64
/// assert_eq!(PairEntry::from_bytes(&bytes), e);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairEntry {
    /// Tokens of the prompt at the start of both sequences.
    pub prompt_len: u64,
    /// Tokens of the prompt + chosen sequence.
    pub chosen_len: u64,
    /// Tokens of the prompt + rejected sequence.
    pub rejected_len: u64,
    /// The 1-based line of the input file the record was read from.
    pub line: u64,
}

impl PairEntry {
    /// The entry's `PAIR_ENTRY_LEN` bytes.
    pub fn to_bytes(&self) -> [u8; PAIR_ENTRY_LEN] {
        let mut b = [0u8; PAIR_ENTRY_LEN];
        let fields = [
            self.prompt_len,
            self.chosen_len,
            self.rejected_len,
            self.line,
        ];
        for (i, v) in fields.iter().enumerate() {
            b[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// The entry of `bytes` (`PAIR_ENTRY_LEN` of them).
    pub fn from_bytes(bytes: &[u8]) -> PairEntry {
        let at =
            |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        PairEntry {
            prompt_len: at(0),
            chosen_len: at(1),
            rejected_len: at(2),
            line: at(3),
        }
    }

    /// Tokens of the document (both sequences).
    pub fn len(&self) -> u64 {
        self.chosen_len + self.rejected_len
    }

    /// Whether the document holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The fixed-size header of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardHeader {
    /// Bytes per token: 2 or 4.
    pub width: u32,
    /// Number of tokens.
    pub n_tokens: u64,
    /// Number of documents starting in this shard (0 without a document stream).
    pub n_docs: u64,
    /// `FLAG_DOCS` | `FLAG_MASK` | `FLAG_PAIRS`.
    pub flags: u32,
    /// [`checksum`] of the body.
    pub checksum: u64,
    /// Hash identifying the vocabulary the tokens belong to.
    pub vocab: u64,
}

impl ShardHeader {
    /// Whether the body holds the document-start stream.
    pub fn has_docs(&self) -> bool {
        self.flags & FLAG_DOCS != 0
    }

    /// Whether the body holds the loss-mask stream.
    pub fn has_mask(&self) -> bool {
        self.flags & FLAG_MASK != 0
    }

    /// Byte offset of the document-start stream (just after the tokens).
    pub fn docs_offset(&self) -> u64 {
        HEADER_LEN as u64 + self.n_tokens * u64::from(self.width)
    }

    /// Byte offset of the loss-mask stream (just after the document starts).
    pub fn mask_offset(&self) -> u64 {
        self.docs_offset() + if self.has_docs() { 8 * self.n_docs } else { 0 }
    }

    /// Whether the body holds the pair table.
    pub fn has_pairs(&self) -> bool {
        self.flags & FLAG_PAIRS != 0
    }

    /// Byte offset of the pair table (just after the loss mask).
    pub fn pairs_offset(&self) -> u64 {
        self.mask_offset()
            + if self.has_mask() {
                self.n_tokens.div_ceil(8)
            } else {
                0
            }
    }

    /// The length the whole file must have.
    pub fn file_len(&self) -> u64 {
        self.pairs_offset()
            + if self.has_pairs() {
                PAIR_ENTRY_LEN as u64 * self.n_docs
            } else {
                0
            }
    }

    /// The 64 header bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.width.to_le_bytes());
        b[16..24].copy_from_slice(&self.n_tokens.to_le_bytes());
        b[24..32].copy_from_slice(&self.n_docs.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[40..48].copy_from_slice(&self.checksum.to_le_bytes());
        b[48..56].copy_from_slice(&self.vocab.to_le_bytes());
        b
    }

    /// Parses and checks a header read from `path` (named in errors): magic, version, width,
    /// flags, reserved fields, and that the document count fits the token count.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<ShardHeader> {
        let bad = |msg: String| Error::data(path, msg);
        if bytes.len() < HEADER_LEN {
            return Err(bad(format!(
                "not a token shard: {} bytes, shorter than the {HEADER_LEN}-byte header \
                 (truncated?)",
                bytes.len()
            )));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        if &bytes[0..8] != MAGIC {
            return Err(bad(format!(
                "not a token shard (magic {:?}, expected {:?})",
                String::from_utf8_lossy(&bytes[0..8]),
                String::from_utf8_lossy(MAGIC)
            )));
        }
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "shard format version {version}; this trainer reads version {VERSION}"
            )));
        }
        let h = ShardHeader {
            width: u32_at(12),
            n_tokens: u64_at(16),
            n_docs: u64_at(24),
            flags: u32_at(32),
            checksum: u64_at(40),
            vocab: u64_at(48),
        };
        if h.width != 2 && h.width != 4 {
            return Err(bad(format!("token width {} (expected 2 or 4)", h.width)));
        }
        let known = FLAG_DOCS | FLAG_MASK | FLAG_PAIRS;
        if h.flags & !known != 0 || u32_at(36) != 0 || u64_at(56) != 0 {
            return Err(bad(
                "unknown flags or non-zero reserved header fields".into()
            ));
        }
        if h.has_pairs() && !h.has_docs() {
            return Err(bad("a pair table without a document stream".into()));
        }
        if (!h.has_docs() && h.n_docs != 0) || h.n_docs > h.n_tokens {
            return Err(bad(format!(
                "header lists {} documents for {} tokens",
                h.n_docs, h.n_tokens
            )));
        }
        Ok(h)
    }
}

/// What a reader expects of a shard; `None` fields are not checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Expect {
    /// The vocabulary hash (a shard of another tokenizer is refused).
    pub vocab: Option<u64>,
    /// The token width.
    pub width: Option<u32>,
}

impl Expect {
    /// Checks `header` of `path` against the expectations.
    pub fn check(&self, header: &ShardHeader, path: &Path) -> Result<()> {
        if let Some(v) = self.vocab {
            if header.vocab != v {
                return Err(Error::data(
                    path,
                    format!(
                        "shard was tokenised with another vocabulary (hash {:016x}, expected \
                         {v:016x}); prepare the data again with this tokenizer",
                        header.vocab
                    ),
                ));
            }
        }
        if let Some(w) = self.width {
            if header.width != w {
                return Err(Error::data(
                    path,
                    format!(
                        "token width {} bytes, expected {w} (the manifest's)",
                        header.width
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A shard opened for reading, memory-mapped (nothing is copied until asked).
pub struct Shard {
    path: PathBuf,
    header: ShardHeader,
    map: memmap2::Mmap,
}

/// Opens `path`: parses the header, checks it against `expect` and that the file length
/// matches the header (a truncated or extended file is refused). The checksum is not read
/// here (that reads the whole file): see [`Shard::verify`] and [`verify`].
pub fn open_shard(path: &Path, expect: &Expect) -> Result<Shard> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < HEADER_LEN as u64 {
        return Err(Error::data(
            path,
            format!(
                "truncated token shard: {len} bytes, shorter than its {HEADER_LEN}-byte header"
            ),
        ));
    }
    // SAFETY: the file is opened read-only; like every memory-mapped reader we rely on nobody
    // truncating it while mapped (prepared shards are never rewritten in place: new versions
    // are renamed over them).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let header = ShardHeader::parse(&map[..HEADER_LEN], path)?;
    expect.check(&header, path)?;
    if len != header.file_len() {
        return Err(Error::data(
            path,
            format!(
                "{} token shard: {len} bytes, but its header ({} tokens, {} documents, flags \
                 {}) needs {}",
                if len < header.file_len() {
                    "truncated"
                } else {
                    "oversized"
                },
                header.n_tokens,
                header.n_docs,
                header.flags,
                header.file_len()
            ),
        ));
    }
    Ok(Shard {
        path: path.to_path_buf(),
        header,
        map,
    })
}

/// Opens `path` (as [`open_shard`]) and checks everything: the checksum over the body, and
/// that the document starts are strictly ascending and inside the shard. Returns the header.
pub fn verify(path: &Path, expect: &Expect) -> Result<ShardHeader> {
    let shard = open_shard(path, expect)?;
    shard.verify()?;
    Ok(shard.header)
}

impl Shard {
    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header.
    pub fn header(&self) -> &ShardHeader {
        &self.header
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.header.n_tokens as usize
    }

    /// Whether the shard holds no token.
    pub fn is_empty(&self) -> bool {
        self.header.n_tokens == 0
    }

    /// The whole file, mapped.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Checks the body's checksum and the document stream (see [`verify`]).
    pub fn verify(&self) -> Result<()> {
        let got = checksum(&self.map[HEADER_LEN..]);
        if got != self.header.checksum {
            return Err(Error::data(
                &self.path,
                format!(
                    "corrupt token shard: checksum {got:016x} of its body does not match the \
                     header's {:016x}",
                    self.header.checksum
                ),
            ));
        }
        let mut prev: Option<u64> = None;
        for d in self.doc_starts() {
            if d >= self.header.n_tokens || prev.is_some_and(|p| d <= p) {
                return Err(Error::data(
                    &self.path,
                    format!(
                        "corrupt document stream: start {d} after {prev:?} (of {} tokens)",
                        self.header.n_tokens
                    ),
                ));
            }
            prev = Some(d);
        }
        self.verify_pairs()
    }

    /// Checks the pair table against the document starts: each pair's prompt inside both
    /// sequences, and each document as long as the distance to the next start (the last one
    /// at least reaching the shard's end).
    fn verify_pairs(&self) -> Result<()> {
        let starts: Vec<u64> = self.doc_starts().collect();
        for (i, (p, &s)) in self.pairs().zip(&starts).enumerate() {
            let end = starts.get(i + 1).copied();
            let fits = match end {
                Some(e) => s + p.len() == e,
                None => s + p.len() >= self.header.n_tokens,
            };
            if p.prompt_len > p.chosen_len.min(p.rejected_len) || !fits {
                return Err(Error::data(
                    &self.path,
                    format!(
                        "corrupt pair table: pair {i} (line {}) at token {s} has prompt {}, \
                         chosen {} and rejected {} tokens, which its document (up to {}) \
                         does not hold",
                        p.line,
                        p.prompt_len,
                        p.chosen_len,
                        p.rejected_len,
                        end.map_or("the shard's end".into(), |e| format!("token {e}"))
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The token bytes (`len() * width`, little-endian).
    pub fn token_bytes(&self) -> &[u8] {
        &self.map[HEADER_LEN..self.header.docs_offset() as usize]
    }

    /// Token `i` (panics if `i >= len()`).
    pub fn token(&self, i: usize) -> u32 {
        let b = self.token_bytes();
        match self.header.width {
            2 => u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            _ => u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        }
    }

    /// Appends tokens `start..start + len` to `out` as `u32` (panics if out of range).
    pub fn read_tokens(&self, start: usize, len: usize, out: &mut Vec<u32>) {
        let w = self.header.width as usize;
        let b = &self.token_bytes()[start * w..(start + len) * w];
        if w == 2 {
            out.extend(
                b.chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            );
        } else {
            out.extend(
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
    }

    /// All tokens as `u32`.
    pub fn tokens(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        self.read_tokens(0, self.len(), &mut out);
        out
    }

    /// The document starts (token offsets, ascending); empty without a document stream.
    pub fn doc_starts(&self) -> impl Iterator<Item = u64> + '_ {
        let (a, b) = (
            self.header.docs_offset() as usize,
            self.header.mask_offset() as usize,
        );
        self.map[a..b]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
    }

    /// The raw mask bytes (bit `t % 8` of byte `t / 8` for token `t`); `None` without a mask.
    pub fn mask_bytes(&self) -> Option<&[u8]> {
        let end = self.header.pairs_offset() as usize;
        self.header
            .has_mask()
            .then(|| &self.map[self.header.mask_offset() as usize..end])
    }

    /// The pair table (one entry a document starting here, in order); empty without one.
    pub fn pairs(&self) -> impl Iterator<Item = PairEntry> + '_ {
        let table = match self.header.has_pairs() {
            true => &self.map[self.header.pairs_offset() as usize..],
            false => &[][..],
        };
        table
            .chunks_exact(PAIR_ENTRY_LEN)
            .map(PairEntry::from_bytes)
    }

    /// Whether token `t` counts as a target (`true` for every token without a mask stream).
    pub fn counted(&self, t: usize) -> bool {
        self.mask_bytes()
            .is_none_or(|m| m[t / 8] & (1 << (t % 8)) != 0)
    }

    /// Appends the mask flags of tokens `start..start + len` to `out`.
    pub fn read_counted(&self, start: usize, len: usize, out: &mut Vec<bool>) {
        out.extend((start..start + len).map(|t| self.counted(t)));
    }
}

#[cfg(test)]
#[path = "format_tests.rs"]
mod tests;
