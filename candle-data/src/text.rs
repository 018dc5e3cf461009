//! Text-file sources: character, byte and Hugging Face tokenizer vocabularies.

use std::fs;
use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;

use super::cache::{self, CacheKey, Entry};
use super::shards::format::{self, TokenizerInfo};
use super::shards::view::ShardView;
use super::shards::{ShardOptions, ShardSource};
use super::vocab::Vocab;
use super::{decimal_f64, Batch, BatchRequest, DataKind, DataSource, DataSpec, Fingerprint, Split};
use crate::error::{Error, Result};

/// Text is handed to the tokenizer in pieces of about this many bytes (cut before a line that
/// starts with a non-space character) to bound the memory of the intermediate encodings.
const TOKENIZER_CHUNK_BYTES: usize = 1 << 20;

/// A corpus read from a file: the first `1 - val_fraction` of its tokens are the training
/// split, the rest the validation split, and batches are windows of `block_size + 1` tokens
/// (random, or in epoch order: [`DataSpec::order`]).
///
/// A special case of [`ShardSource`]: the tokens are read through the same memory-mapped
/// shard reader. Char and tokenizer encodings are tokenised once into a prepared shard
/// directory in [`DataSpec::cache_dir`] (one shard a split, see `cache::default_cache_dir`)
/// and mapped from there; a byte corpus is its own token list, mapped as it is (a 1-byte-wide
/// shard a split). A cache that cannot be written only produces a warning (the tokens are then
/// served from memory).
///
/// Built by [`super::open`] for [`DataKind::Char`], [`DataKind::Byte`] and
/// [`DataKind::Tokenizer`].
pub struct TextSource {
    path: PathBuf,
    inner: ShardSource,
    n_tokens: usize,
    val_fraction: f32,
    description: String,
    fingerprint: Fingerprint,
}

use super::shards::human;

/// Reads `path` as UTF-8 text, naming the file and the offset of the first bad byte on error.
fn read_utf8(path: &Path) -> Result<String> {
    let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| {
        Error::data(
            path,
            format!(
                "not valid UTF-8 (first invalid byte at offset {}); use --data byte (data = \"byte\") for \
                 binary or non-UTF-8 files",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// Splits text for the tokenizer at line starts that follow a newline and are not whitespace,
/// so no pre-tokenizer token spans a cut.
fn tokenizer_chunks(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        let target = start + TOKENIZER_CHUNK_BYTES;
        let end = if target >= bytes.len() {
            bytes.len()
        } else {
            (target..bytes.len() - 1)
                .find(|&i| bytes[i] == b'\n' && !bytes[i + 1].is_ascii_whitespace())
                .map_or(bytes.len(), |i| i + 1)
        };
        out.push(&text[start..end]);
        start = end;
    }
    out
}

/// What a text file became: the two splits' shard views and the vocabulary.
struct Tokenised {
    train: ShardView,
    val: ShardView,
    vocab: Vocab,
    vocab_size: usize,
    fingerprint: Fingerprint,
    /// How the vocabulary reads in the description (`chars, char vocab 65`...).
    what: String,
    /// `cache hit`, `tokenised, cached`... (empty for bytes).
    note: String,
}

impl TextSource {
    /// Reads, tokenises (or maps from the cache) and splits the file of `spec`.
    ///
    /// `spec.kind` must be `char`, `byte` or `tokenizer` and `spec.path` set (as checked by
    /// [`DataSpec::validate`]).
    pub fn open(spec: &DataSpec) -> Result<Self> {
        spec.validate()?;
        let path = spec
            .path
            .clone()
            .ok_or_else(|| Error::Config("--data-path (data_path) is required".into()))?;
        let meta = fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
        if meta.is_dir() {
            return Err(Error::data(&path, "is a directory, expected a text file"));
        }
        if meta.len() == 0 {
            return Err(Error::data(&path, "file is empty"));
        }
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let t = match spec.kind {
            DataKind::Byte => open_bytes(&path, meta.len() as usize, spec.val_fraction)?,
            DataKind::Char | DataKind::Tokenizer => open_cached(spec, &path)?,
            DataKind::Addition
            | DataKind::Sft
            | DataKind::ChatTask
            | DataKind::Shards
            | DataKind::Preference => {
                return Err(Error::Config(format!(
                    "data = {} is not a text file source",
                    spec.kind
                )))
            }
        };
        let (n_train, n_val) = (t.train.len(), t.val.len());
        let n = n_train + n_val;
        let size = if spec.kind == DataKind::Char {
            n
        } else {
            meta.len() as usize
        };
        let note = if t.note.is_empty() {
            t.note
        } else {
            format!(" ({})", t.note)
        };
        let description = format!(
            "{name}: {} {}, {n_train} train / {n_val} val tokens{note}",
            human(size),
            t.what
        );
        let options = ShardOptions {
            order: spec.order,
            doc_mask: spec.doc_mask,
            tokenizer: None,
        };
        let parts = (t.vocab, t.vocab_size, t.what, t.fingerprint.clone());
        let inner = ShardSource::assemble(
            &path,
            vec![t.train],
            vec![t.val],
            options,
            false,
            false,
            parts,
        )?;
        Ok(TextSource {
            path,
            inner,
            n_tokens: n,
            val_fraction: spec.val_fraction,
            description,
            fingerprint: t.fingerprint,
        })
    }

    /// The token ids of `split` (read from the mapped shard).
    pub fn tokens(&self, split: Split) -> Result<Vec<u32>> {
        self.inner.read(split, 0, 0, self.inner.len(split))
    }
}

/// nanoGPT's `int(n * 0.9)` for val_fraction 0.1.
fn split_point(n: usize, val_fraction: f32) -> usize {
    ((n as f64) * (1.0 - decimal_f64(val_fraction))).floor() as usize
}

/// A byte corpus: the file mapped as it is, one token a byte, in two ranges.
fn open_bytes(path: &Path, n: usize, val_fraction: f32) -> Result<Tokenised> {
    let n_train = split_point(n, val_fraction);
    let train = ShardView::open_raw(path, 1, 0..n_train)?;
    let val = ShardView::open_raw(path, 1, n_train..n)?;
    // The fingerprint text sources have always had: every token as a little-endian u32.
    let mut h = crate::hash::Hasher64::new();
    h.update(&(n_train as u64).to_le_bytes());
    let mut buf = Vec::with_capacity(4 * 4096);
    let mut ids = Vec::with_capacity(4096);
    let mut at = 0;
    while at < n {
        let len = 4096.min(n - at);
        ids.clear();
        for (view, start) in [(&train, 0), (&val, n_train)] {
            let (a, b) = (at.max(start), (at + len).min(start + view.len()));
            if a < b {
                view.read(a - start, b - a, &mut ids)?;
            }
        }
        buf.clear();
        buf.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
        h.update(&buf);
        at += len;
    }
    let fingerprint = Fingerprint {
        tokens: format!("{:016x}", h.finish()),
        vocab: format!("{:016x}", format::byte_vocab_hash()),
    };
    Ok(Tokenised {
        train,
        val,
        vocab: Vocab::Byte,
        vocab_size: 256,
        fingerprint,
        what: "bytes, byte vocab 256".into(),
        note: String::new(),
    })
}

/// A char or tokenizer corpus: mapped from its cache entry, tokenised into one on a miss.
fn open_cached(spec: &DataSpec, path: &Path) -> Result<Tokenised> {
    let cache_dir = spec
        .cache_dir
        .clone()
        .unwrap_or_else(cache::default_cache_dir);
    let tok_path = match spec.kind {
        DataKind::Tokenizer => Some(spec.tokenizer.clone().ok_or_else(|| {
            Error::Config("data `tokenizer` needs --tokenizer-path (tokenizer_path)".into())
        })?),
        _ => None,
    };
    let (kind, tok_hash, vocab) = match &tok_path {
        Some(p) => {
            let bytes = fs::read(p).map_err(|e| Error::io(p, e))?;
            (
                "tokenizer",
                crate::hash::hash_bytes(&bytes),
                Some(Vocab::tokenizer(p)?),
            )
        }
        None => ("char", 0, None),
    };
    let key = CacheKey::new(path, kind, tok_hash, spec.val_fraction)?;
    let mut found = match cache::load(&cache_dir, &key) {
        Some(hit) => from_cache(hit, vocab),
        None => {
            let (tokens, vocab) = tokenise(path, vocab, tok_path.as_deref())?;
            let slot = (cache_dir.as_path(), &key);
            let tokenizer = (kind, tok_path.as_deref());
            store_tokens(path, tokens, vocab, tokenizer, spec.val_fraction, slot)
        }
    };
    found.what = match &found.vocab {
        Vocab::Char { chars, .. } => format!("chars, char vocab {}", chars.len()),
        _ => {
            let tp = tok_path.as_deref().unwrap_or(path);
            let file = tp
                .file_name()
                .map_or_else(|| tp.display().to_string(), |n| n.to_string_lossy().into());
            format!("bytes, tokenizer {file} vocab {}", found.vocab_size)
        }
    };
    Ok(found)
}

/// A cache hit, with the tokenizer's vocabulary when there is one (else the characters the
/// cache recorded).
fn from_cache(hit: cache::Hit, vocab: Option<Vocab>) -> Tokenised {
    let vocab = match vocab {
        Some(v) => v,
        None => {
            let chars = hit.manifest.tokenizer.chars.as_deref().unwrap_or_default();
            Vocab::chars(chars.chars().collect())
        }
    };
    Tokenised {
        train: hit.train,
        val: hit.val,
        vocab,
        vocab_size: hit.manifest.vocab_size as usize,
        fingerprint: hit.fingerprint,
        what: String::new(),
        note: "cache hit".into(),
    }
}

/// The freshly tokenised `tokens` of `path` (`kind` `char` or `tokenizer`, from the file
/// `tok_path`), split, stored as the cache entry `slot` (the cache directory and the key) and
/// mapped from it; served from memory, with a warning, when the entry cannot be written.
fn store_tokens(
    path: &Path,
    tokens: Vec<u32>,
    vocab: Vocab,
    (kind, tok_path): (&str, Option<&Path>),
    val_fraction: f32,
    (cache_dir, key): (&Path, &CacheKey),
) -> Tokenised {
    let n_train = split_point(tokens.len(), val_fraction);
    let vocab_size = match &vocab {
        Vocab::Tokenizer(file) => vocab_size_of(file.tokenizer(), &tokens),
        v => v.size(),
    };
    let hash = vocab.hash();
    let fingerprint = Fingerprint::of_tokens(&tokens, n_train, hash);
    let tokenizer = TokenizerInfo {
        kind: kind.to_string(),
        path: tok_path.map(Path::to_path_buf),
        hash: format!("{hash:016x}"),
        chars: match &vocab {
            Vocab::Char { chars, .. } => Some(chars.iter().collect()),
            _ => None,
        },
    };
    let entry = Entry {
        tokens: &tokens,
        n_train,
        tokenizer,
        vocab_size: vocab_size as u64,
        fingerprint: fingerprint.clone(),
    };
    let stored = cache::store(cache_dir, key, &entry).and_then(|dir| {
        tracing::debug!("wrote token cache {}", dir.display());
        cache::load(cache_dir, key)
            .ok_or_else(|| Error::data(&dir, "token cache unreadable after writing"))
    });
    let (train, val, note) = match stored {
        Ok(hit) => (hit.train, hit.val, "tokenised, cached"),
        Err(e) => {
            tracing::warn!("could not write the token cache: {e}");
            let width = format::width_for_vocab(vocab_size) as usize;
            let train = ShardView::in_memory(path, &tokens[..n_train], width);
            let val = ShardView::in_memory(path, &tokens[n_train..], width);
            (train, val, "tokenised, cache not written")
        }
    };
    Tokenised {
        train,
        val,
        vocab,
        vocab_size,
        fingerprint,
        what: String::new(),
        note: note.into(),
    }
}

/// Tokenises the text file `path` with `vocab` (a char vocabulary is built from the file when
/// `None`).
fn tokenise(
    path: &Path,
    vocab: Option<Vocab>,
    tok_path: Option<&Path>,
) -> Result<(Vec<u32>, Vocab)> {
    let text = read_utf8(path)?;
    match vocab {
        None => {
            let mut chars: Vec<char> = text.chars().collect();
            chars.sort_unstable();
            chars.dedup();
            let vocab = Vocab::chars(chars);
            let Vocab::Char { index, .. } = &vocab else {
                unreachable!("a char vocabulary")
            };
            let tokens = text.chars().map(|c| index[&c]).collect();
            Ok((tokens, vocab))
        }
        Some(vocab) => {
            let Vocab::Tokenizer(file) = &vocab else {
                return Err(Error::Config("expected a tokenizer vocabulary".into()));
            };
            let tok_name = tok_path.unwrap_or(path).display().to_string();
            let mut tokens = Vec::new();
            for chunk in tokenizer_chunks(&text) {
                let enc = file.tokenizer().encode(chunk, false).map_err(|e| {
                    Error::Tokenizer(format!("{tok_name} failed on {}: {e}", path.display()))
                })?;
                tokens.extend_from_slice(enc.get_ids());
            }
            if tokens.is_empty() {
                return Err(Error::data(path, format!("{tok_name} produced no tokens")));
            }
            Ok((tokens, vocab))
        }
    }
}

/// The tokenizer's vocabulary size (with added tokens), raised if a produced id exceeds it.
fn vocab_size_of(tokenizer: &tokenizers::Tokenizer, tokens: &[u32]) -> usize {
    let max_id = tokens.iter().max().map_or(0, |&m| m as usize + 1);
    tokenizer.get_vocab_size(true).max(max_id)
}

impl DataSource for TextSource {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    source_methods!(wraps inner);

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        self.check_block_size(want.block_size)?;
        self.inner.draw(want, rng)
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        let need = block_size + 1;
        let n = self.n_tokens;
        for (split, which) in [
            (Split::Train, "train split (the first"),
            (Split::Val, "val split (the last"),
        ] {
            let have = self.inner.len(split);
            let pct = match split {
                Split::Train => 100.0 * (1.0 - self.val_fraction),
                Split::Val => 100.0 * self.val_fraction,
            };
            if have < need {
                return Err(Error::data(
                    &self.path,
                    format!(
                        "corpus too short for block_size {block_size}: the {which} {pct:.0}% \
                         of {n} tokens) has {have} tokens, but one window needs block_size + 1 \
                         = {need}; use a longer file, a smaller block_size or another \
                         val_fraction"
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "text_tests.rs"]
mod tests;
