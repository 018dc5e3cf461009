//! Memory-mapped, read-only views of token shards: a prepared `<split>-<NNNNN>.tok` file (see
//! [`super::format`]), a nanoGPT raw `train.bin` / `val.bin` (bare little-endian `u16`s), or
//! a range of a byte corpus (each byte a token).
//!
//! Nothing is copied at open: tokens, the document-start offsets and the loss-mask bits are read
//! from the mapping as windows are drawn, so a process's anonymous memory does not grow with
//! the corpus (the kernel's page cache holds what was read, and can drop it).

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::Mmap;

use super::format::{checksum, Expect, ShardHeader, CHECK_CHUNK, HEADER_LEN};
use crate::error::{Error, Result};

/// What a shard body's bytes are checked against before they are first read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BodySums {
    /// The CRC-32 of each [`CHECK_CHUNK`]-byte chunk (the manifest's `chunk_sums`, parsed).
    Chunks(Vec<u32>),
    /// Only the header's checksum of the whole body (a manifest from an older trainer): the
    /// whole body is verified when the shard is first read.
    Whole,
}

impl BodySums {
    /// Parses a manifest entry's `chunk_sums` (empty: [`BodySums::Whole`]).
    pub(crate) fn parse(hex: &str, path: &Path) -> Result<Self> {
        if hex.is_empty() {
            return Ok(BodySums::Whole);
        }
        let bad = || {
            Error::data(
                path,
                "the manifest's chunk_sums are not 8-hex-digit CRC-32s",
            )
        };
        if !hex.len().is_multiple_of(8) {
            return Err(bad());
        }
        (0..hex.len() / 8)
            .map(|i| {
                let digits = hex.get(8 * i..8 * i + 8).ok_or_else(bad)?;
                u32::from_str_radix(digits, 16).map_err(|_| bad())
            })
            .collect::<Result<_>>()
            .map(BodySums::Chunks)
    }
}

/// Lazy verification of a shard body: each chunk is checked the first time a read touches it.
struct Check {
    sums: BodySums,
    /// The header's whole-body checksum ([`BodySums::Whole`]).
    whole: u64,
    /// Body bytes per chunk.
    chunk: usize,
    /// Which chunks were verified.
    done: Box<[AtomicBool]>,
}

/// The bytes a view reads: a file's mapping, or (when a token cache cannot be written) the
/// tokens in memory.
enum Bytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One memory-mapped shard (or a token range of a raw file).
pub(crate) struct ShardView {
    path: PathBuf,
    map: Bytes,
    width: usize,
    /// Byte offset of the first token.
    tokens_at: usize,
    n_tokens: usize,
    /// Byte offset and number of the document-start offsets (`u64` each), if present.
    docs: Option<(usize, usize)>,
    /// Byte offset of the loss-mask bits, if present.
    mask_at: Option<usize>,
    /// The shard's checksum (its header's; 0 for a raw file).
    pub(crate) checksum: u64,
    /// Verification of the body before it is read (`None`: raw files and bytes in memory).
    check: Option<Check>,
}

impl std::fmt::Debug for ShardView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (path, n, width) = (self.path.display(), self.n_tokens, self.width);
        write!(f, "ShardView({path}: {n} tokens of {width} bytes)")
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only and private to this process. A shard rewritten in place
    // while a run reads it would change the tokens under it (not memory safety of Rust values:
    // only plain bytes are read from it); `prepare` writes new files and renames them, which
    // leaves existing mappings intact.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    #[cfg(unix)]
    {
        // Windows are read at random places: no read-ahead beyond the pages touched.
        let _ = map.advise(memmap2::Advice::Random);
    }
    Ok(map)
}

impl ShardView {
    /// Maps a prepared shard file, checking its header and that its size matches it. Nothing
    /// of the body is read here: with `sums`, every read first verifies the chunks it touches
    /// (once each) and fails, naming the file and the bytes, on a mismatch; without, the body
    /// is trusted (the caller verified it whole).
    pub(crate) fn open_tok(path: &Path, expect: &Expect, sums: Option<BodySums>) -> Result<Self> {
        let map = map_file(path)?;
        let header = ShardHeader::parse(&map[..map.len().min(HEADER_LEN)], path)?;
        expect.check(&header, path)?;
        if header.file_len() != map.len() as u64 {
            return Err(Error::data(
                path,
                format!(
                    "{} bytes, but its header ({} tokens, {} documents, flags {}) describes {} \
                     (truncated or padded)",
                    map.len(),
                    header.n_tokens,
                    header.n_docs,
                    header.flags,
                    header.file_len()
                ),
            ));
        }
        let n_tokens = usize::try_from(header.n_tokens)
            .map_err(|_| Error::data(path, "too many tokens for this machine"))?;
        let body = map.len() - HEADER_LEN;
        let check = match sums {
            None => None,
            Some(sums) => {
                let (chunk, n) = match &sums {
                    BodySums::Chunks(c) => (CHECK_CHUNK as usize, c.len()),
                    BodySums::Whole => (body.max(1), 1),
                };
                if matches!(sums, BodySums::Chunks(_)) && n != body.div_ceil(chunk) {
                    return Err(Error::data(
                        path,
                        format!(
                            "the manifest lists {n} chunk checksums for a body of {body} bytes \
                             ({} expected); prepare the directory again",
                            body.div_ceil(chunk)
                        ),
                    ));
                }
                Some(Check {
                    sums,
                    whole: header.checksum,
                    chunk,
                    done: (0..n).map(|_| AtomicBool::new(false)).collect(),
                })
            }
        };
        Ok(ShardView {
            check,
            path: path.to_path_buf(),
            width: header.width as usize,
            tokens_at: HEADER_LEN,
            n_tokens,
            docs: header
                .has_docs()
                .then(|| (header.docs_offset() as usize, header.n_docs as usize)),
            mask_at: header.has_mask().then(|| header.mask_offset() as usize),
            checksum: header.checksum,
            map: Bytes::Map(map),
        })
    }

    /// Maps a nanoGPT raw token file: little-endian `u16`s, no header.
    pub(crate) fn open_raw_u16(path: &Path) -> Result<Self> {
        let len = std::fs::metadata(path)
            .map_err(|e| Error::io(path, e))?
            .len();
        if len % 2 != 0 {
            return Err(Error::data(
                path,
                format!(
                    "{len} bytes is not a whole number of uint16 tokens (a nanoGPT .bin file \
                     holds little-endian uint16s)"
                ),
            ));
        }
        Self::open_raw(path, 2, 0..(len / 2) as usize)
    }

    /// Maps tokens `range` of a headerless file of `width`-byte little-endian tokens (a byte
    /// corpus is its own token list at width 1).
    pub(crate) fn open_raw(
        path: &Path,
        width: usize,
        range: std::ops::Range<usize>,
    ) -> Result<Self> {
        let map = map_file(path)?;
        if range.end * width > map.len() {
            return Err(Error::data(
                path,
                format!("shorter than {} tokens of {width} bytes", range.end),
            ));
        }
        Ok(ShardView {
            path: path.to_path_buf(),
            width,
            tokens_at: range.start * width,
            n_tokens: range.len(),
            docs: None,
            mask_at: None,
            checksum: 0,
            check: None,
            map: Bytes::Map(map),
        })
    }

    /// A view of `tokens` held in memory at `width` bytes a token (`path` names it in logs).
    pub(crate) fn in_memory(path: &Path, tokens: &[u32], width: usize) -> Self {
        let bytes = match width {
            2 => tokens
                .iter()
                .flat_map(|&t| (t as u16).to_le_bytes())
                .collect(),
            _ => tokens.iter().flat_map(|&t| t.to_le_bytes()).collect(),
        };
        ShardView {
            path: path.to_path_buf(),
            width: if width == 2 { 2 } else { 4 },
            tokens_at: 0,
            n_tokens: tokens.len(),
            docs: None,
            mask_at: None,
            checksum: 0,
            check: None,
            map: Bytes::Owned(bytes),
        }
    }

    /// The file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens.
    pub(crate) fn len(&self) -> usize {
        self.n_tokens
    }

    /// Whether the shard has a loss-mask stream.
    pub(crate) fn has_mask(&self) -> bool {
        self.mask_at.is_some()
    }

    /// Whether the shard has a document-start stream.
    pub(crate) fn has_docs(&self) -> bool {
        self.docs.is_some()
    }

    /// The token bytes, `width` bytes a token.
    fn token_bytes(&self) -> &[u8] {
        &self.map[self.tokens_at..self.tokens_at + self.n_tokens * self.width]
    }

    /// The mapped bytes `range` (file offsets), after verifying the body chunks they lie in
    /// (each once); `what` names the read in the error.
    fn bytes(&self, range: Range<usize>, what: impl Fn() -> String) -> Result<&[u8]> {
        if let Some(check) = self.check.as_ref().filter(|c| !c.done.is_empty()) {
            let body = &self.map[HEADER_LEN..];
            let (a, b) = (range.start - HEADER_LEN, range.end - HEADER_LEN);
            let last = if b > a {
                (b - 1) / check.chunk
            } else {
                a / check.chunk
            };
            for i in a / check.chunk..=last.min(check.done.len() - 1) {
                if check.done[i].load(Ordering::Acquire) {
                    continue;
                }
                let span = i * check.chunk..((i + 1) * check.chunk).min(body.len());
                let (got, want) = match &check.sums {
                    BodySums::Chunks(sums) => (
                        u64::from(crc32fast::hash(&body[span.clone()])),
                        u64::from(sums[i]),
                    ),
                    BodySums::Whole => (checksum(body), check.whole),
                };
                if got != want {
                    return Err(Error::data(
                        &self.path,
                        format!(
                            "corrupt token shard: {} lies in body bytes {}..{} (file offset \
                             {}), whose checksum {got:x} is not the recorded {want:x}; nothing \
                             was trained on it. Run `trainer prepare --verify {}` to list the \
                             bad shards, then prepare the data again",
                            what(),
                            span.start,
                            span.end,
                            HEADER_LEN + span.start,
                            self.path.parent().unwrap_or(Path::new(".")).display()
                        ),
                    ));
                }
                check.done[i].store(true, Ordering::Release);
            }
        }
        Ok(&self.map[range])
    }

    /// Appends tokens `start..start + len` to `out`, after verifying the bytes they lie in.
    /// Panics if the range is out of bounds (the callers draw in-bounds windows).
    pub(crate) fn read(&self, start: usize, len: usize, out: &mut Vec<u32>) -> Result<()> {
        let w = self.width;
        let at = self.tokens_at;
        let bytes = self.bytes(at + start * w..at + (start + len) * w, || {
            format!("the window of tokens {start}..{}", start + len)
        })?;
        if w == 1 {
            out.extend(bytes.iter().map(|&b| u32::from(b)));
        } else if w == 2 {
            out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            );
        } else {
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(())
    }

    /// Calls `f` on every token id in order, a chunk at a time (for scans: the largest id,
    /// a content hash).
    pub(crate) fn for_each_chunk(&self, mut f: impl FnMut(&[u8], usize)) {
        for chunk in self.token_bytes().chunks(1 << 20) {
            f(chunk, self.width);
        }
    }

    /// Whether token `t` counts as a target (its mask bit; every token without a mask stream).
    pub(crate) fn counts(&self, t: usize) -> Result<bool> {
        match self.mask_at {
            None => Ok(true),
            Some(at) => {
                let b = self.bytes(at + t / 8..at + t / 8 + 1, || {
                    format!("the loss-mask bit of token {t}")
                })?;
                Ok(b[0] >> (t % 8) & 1 == 1)
            }
        }
    }

    /// Document-start offset number `i`.
    fn doc_start(&self, at: usize, i: usize) -> Result<u64> {
        let b = self.bytes(at + 8 * i..at + 8 * i + 8, || {
            format!("document start number {i}")
        })?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// The documents starting in `start..end` (ascending token offsets), found by binary
    /// search in the mapped document-start stream; empty without one.
    pub(crate) fn doc_starts_in(&self, start: usize, end: usize) -> Result<Vec<usize>> {
        let Some((at, n)) = self.docs else {
            return Ok(Vec::new());
        };
        // First index whose offset is >= start.
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.doc_start(at, mid)? < start as u64 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let mut out = Vec::new();
        for i in lo..n {
            let d = self.doc_start(at, i)? as usize;
            if d >= end {
                break;
            }
            out.push(d);
        }
        Ok(out)
    }
}

/// The fingerprint word of a raw file's contents (size and every byte), computed by one pass
/// over its mapping, and its largest token id.
pub(crate) fn scan_raw(view: &ShardView) -> (u64, u32) {
    let mut h = crate::hash::Hasher64::new();
    h.update(&(view.len() as u64).to_le_bytes());
    let mut max = 0u32;
    view.for_each_chunk(|bytes, _| {
        h.update(bytes);
        for c in bytes.chunks_exact(2) {
            max = max.max(u32::from(u16::from_le_bytes([c[0], c[1]])));
        }
    });
    (h.finish(), max)
}
