//! Memory-mapped, read-only views of token shards: a prepared `<split>-<NNNNN>.tok` file (see
//! [`super::format`]), a nanoGPT raw `train.bin` / `val.bin` (bare little-endian `u16`s), or
//! a range of a byte corpus (each byte a token).
//!
//! Nothing is copied at open: tokens, the document-start offsets and the loss-mask bits are read
//! from the mapping as windows are drawn, so a process's anonymous memory does not grow with
//! the corpus (the kernel's page cache holds what was read, and can drop it).

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::format::{Expect, ShardHeader, HEADER_LEN};
use crate::error::{Error, Result};

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
}

impl std::fmt::Debug for ShardView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardView")
            .field("path", &self.path)
            .field("width", &self.width)
            .field("n_tokens", &self.n_tokens)
            .finish()
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
    /// Maps a prepared shard file, checking its header and that its size matches it (the
    /// checksum over the body is not recomputed here: see [`format`]'s verification).
    pub(crate) fn open_tok(path: &Path, expect: &Expect) -> Result<Self> {
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
        Ok(ShardView {
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

    /// Appends tokens `start..start + len` to `out`. Panics if the range is out of bounds (the
    /// callers draw in-bounds windows).
    pub(crate) fn read(&self, start: usize, len: usize, out: &mut Vec<u32>) {
        let w = self.width;
        let bytes = &self.token_bytes()[start * w..(start + len) * w];
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
    }

    /// Calls `f` on every token id in order, a chunk at a time (for scans: the largest id,
    /// a content hash).
    pub(crate) fn for_each_chunk(&self, mut f: impl FnMut(&[u8], usize)) {
        for chunk in self.token_bytes().chunks(1 << 20) {
            f(chunk, self.width);
        }
    }

    /// Whether token `t` counts as a target (its mask bit; every token without a mask stream).
    pub(crate) fn counts(&self, t: usize) -> bool {
        match self.mask_at {
            None => true,
            Some(at) => self.map[at + t / 8] >> (t % 8) & 1 == 1,
        }
    }

    /// Document-start offset number `i`.
    fn doc_start(&self, at: usize, i: usize) -> u64 {
        let b = &self.map[at + 8 * i..at + 8 * i + 8];
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    }

    /// The documents starting in `start..end` (ascending token offsets), found by binary
    /// search in the mapped document-start stream; empty without one.
    pub(crate) fn doc_starts_in(&self, start: usize, end: usize) -> Vec<usize> {
        let Some((at, n)) = self.docs else {
            return Vec::new();
        };
        // First index whose offset is >= start.
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.doc_start(at, mid) < start as u64 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (lo..n)
            .map(|i| self.doc_start(at, i) as usize)
            .take_while(|&d| d < end)
            .collect()
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
