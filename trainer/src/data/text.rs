//! Text-file sources: character, byte and Hugging Face tokenizer vocabularies.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Device;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::cache::{self, CacheKey, Cached};
use super::{
    check_shape, decimal_f64, rows_to_batch, Batch, DataKind, DataSource, DataSpec, Fingerprint,
    Split,
};
use crate::error::{Error, Result};

/// Text is handed to the tokenizer in pieces of about this many bytes (cut before a line that
/// starts with a non-space character) to bound the memory of the intermediate encodings.
const TOKENIZER_CHUNK_BYTES: usize = 1 << 20;

/// How text becomes token ids.
enum Vocab {
    /// Sorted unique characters of the file; id = position.
    Char {
        chars: Vec<char>,
        index: HashMap<char, u32>,
    },
    /// One token per byte.
    Byte,
    /// A Hugging Face tokenizer loaded from `path`.
    Tokenizer {
        tokenizer: Box<tokenizers::Tokenizer>,
        path: PathBuf,
    },
}

/// A corpus read from a file: the first `1 - val_fraction` of its tokens are the training
/// split, the rest the validation split, and batches are random windows of `block_size + 1`
/// tokens.
///
/// Built by [`super::open`] for [`DataKind::Char`], [`DataKind::Byte`] and
/// [`DataKind::Tokenizer`]. Char and tokenizer encodings are cached in
/// [`DataSpec::cache_dir`]; a cache that cannot be written only produces a warning.
pub struct TextSource {
    path: PathBuf,
    vocab: Vocab,
    vocab_size: usize,
    tokens: Vec<u32>,
    n_train: usize,
    val_fraction: f32,
    description: String,
    fingerprint: Fingerprint,
}

/// `1234567` -> `"1.2M"`, for log lines.
fn human(n: usize) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1}k", n as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}G", n as f64 / 1e9),
    }
}

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

fn char_vocab(chars: Vec<char>) -> Vocab {
    let index = chars
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, i as u32))
        .collect();
    Vocab::Char { chars, index }
}

impl TextSource {
    /// Reads, tokenises (or loads from the cache) and splits the file of `spec`.
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
        let cache_dir = spec
            .cache_dir
            .clone()
            .unwrap_or_else(cache::default_cache_dir);
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );

        let (vocab, tokens, what, cache_note) = match spec.kind {
            DataKind::Byte => {
                let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
                let tokens: Vec<u32> = bytes.into_iter().map(u32::from).collect();
                (Vocab::Byte, tokens, "bytes".to_string(), String::new())
            }
            DataKind::Char => {
                let key = CacheKey::new(&path, "char", 0)?;
                let hit = cache::load(&cache_dir, &key).and_then(|c| {
                    let chars: Vec<char> = String::from_utf8(c.extra).ok()?.chars().collect();
                    let sorted = chars.windows(2).all(|w| w[0] < w[1]);
                    (sorted && chars.len() as u64 == c.vocab_size).then_some((chars, c.tokens))
                });
                let (chars, tokens, note) = match hit {
                    Some((chars, tokens)) => (chars, tokens, "cache hit".to_string()),
                    None => {
                        let text = read_utf8(&path)?;
                        let mut chars: Vec<char> = text.chars().collect();
                        chars.sort_unstable();
                        chars.dedup();
                        let index: HashMap<char, u32> = chars
                            .iter()
                            .enumerate()
                            .map(|(i, &c)| (c, i as u32))
                            .collect();
                        let tokens: Vec<u32> = text.chars().map(|c| index[&c]).collect();
                        let cached = Cached {
                            tokens,
                            vocab_size: chars.len() as u64,
                            extra: chars.iter().collect::<String>().into_bytes(),
                        };
                        let note = save(&cache_dir, &key, &cached);
                        (chars, cached.tokens, note)
                    }
                };
                let what = format!("chars, char vocab {}", chars.len());
                (char_vocab(chars), tokens, what, note)
            }
            DataKind::Tokenizer => {
                let tok_path = spec.tokenizer.clone().ok_or_else(|| {
                    Error::Config("data `tokenizer` needs --tokenizer-path (tokenizer_path)".into())
                })?;
                let tok_bytes = fs::read(&tok_path).map_err(|e| Error::io(&tok_path, e))?;
                let tokenizer = tokenizers::Tokenizer::from_bytes(&tok_bytes).map_err(|e| {
                    Error::Tokenizer(format!(
                        "{}: not a valid tokenizer.json: {e}",
                        tok_path.display()
                    ))
                })?;
                let key = CacheKey::new(&path, "tokenizer", crate::hash::hash_bytes(&tok_bytes))?;
                let (tokens, note) = match cache::load(&cache_dir, &key) {
                    Some(c) => (c.tokens, "cache hit".to_string()),
                    None => {
                        let text = read_utf8(&path)?;
                        let mut tokens = Vec::new();
                        for chunk in tokenizer_chunks(&text) {
                            let enc = tokenizer.encode(chunk, false).map_err(|e| {
                                Error::Tokenizer(format!(
                                    "{} failed on {}: {e}",
                                    tok_path.display(),
                                    path.display()
                                ))
                            })?;
                            tokens.extend_from_slice(enc.get_ids());
                        }
                        if tokens.is_empty() {
                            return Err(Error::data(
                                &path,
                                format!("{} produced no tokens", tok_path.display()),
                            ));
                        }
                        let vocab_size = vocab_size_of(&tokenizer, &tokens) as u64;
                        let cached = Cached {
                            tokens,
                            vocab_size,
                            extra: Vec::new(),
                        };
                        let note = save(&cache_dir, &key, &cached);
                        (cached.tokens, note)
                    }
                };
                let what = format!(
                    "bytes, tokenizer {} vocab {}",
                    tok_path.file_name().map_or_else(
                        || tok_path.display().to_string(),
                        |n| n.to_string_lossy().into()
                    ),
                    vocab_size_of(&tokenizer, &tokens)
                );
                (
                    Vocab::Tokenizer {
                        tokenizer: Box::new(tokenizer),
                        path: tok_path,
                    },
                    tokens,
                    what,
                    note,
                )
            }
            DataKind::Addition | DataKind::Sft | DataKind::Shards => {
                return Err(Error::Config(format!(
                    "data = {} is not a text file source",
                    spec.kind
                )))
            }
        };

        let vocab_size = match &vocab {
            Vocab::Char { chars, .. } => chars.len(),
            Vocab::Byte => 256,
            Vocab::Tokenizer { tokenizer, .. } => vocab_size_of(tokenizer, &tokens),
        };
        let n = tokens.len();
        // nanoGPT's `int(n * 0.9)` for val_fraction 0.1.
        let n_train = ((n as f64) * (1.0 - decimal_f64(spec.val_fraction))).floor() as usize;
        let size = if spec.kind == DataKind::Char {
            n
        } else {
            meta.len() as usize
        };
        let kind_note = if spec.kind == DataKind::Byte {
            ", byte vocab 256".to_string()
        } else {
            String::new()
        };
        let cache_note = if cache_note.is_empty() {
            cache_note
        } else {
            format!(" ({cache_note})")
        };
        let description = format!(
            "{name}: {} {what}{kind_note}, {n_train} train / {} val tokens{cache_note}",
            human(size),
            n - n_train
        );
        let vocab_hash = match &vocab {
            Vocab::Char { chars, .. } => {
                crate::hash::hash_bytes(chars.iter().collect::<String>().as_bytes())
            }
            Vocab::Byte => crate::hash::hash_bytes(b"byte vocabulary"),
            Vocab::Tokenizer { tokenizer, .. } => {
                // The tokenizer's identity as it encodes (model, vocab, merges, added tokens),
                // independent of the JSON's formatting.
                crate::hash::hash_bytes(tokenizer.to_string(false).unwrap_or_default().as_bytes())
            }
        };
        let fingerprint = Fingerprint::of_tokens(&tokens, n_train, vocab_hash);
        Ok(TextSource {
            path,
            vocab,
            vocab_size,
            tokens,
            n_train,
            val_fraction: spec.val_fraction,
            description,
            fingerprint,
        })
    }

    /// The token ids of `split`.
    pub fn tokens(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.tokens[..self.n_train],
            Split::Val => &self.tokens[self.n_train..],
        }
    }

    /// The data file this source was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The tokenizer's vocabulary size (with added tokens), raised if a produced id exceeds it.
fn vocab_size_of(tokenizer: &tokenizers::Tokenizer, tokens: &[u32]) -> usize {
    let max_id = tokens.iter().max().map_or(0, |&m| m as usize + 1);
    tokenizer.get_vocab_size(true).max(max_id)
}

/// Writes a cache entry, turning failure into a warning (the cache is only an optimisation).
fn save(dir: &Path, key: &CacheKey, cached: &Cached) -> String {
    match cache::store(dir, key, cached) {
        Ok(p) => {
            tracing::debug!("wrote token cache {}", p.display());
            "tokenised, cached".to_string()
        }
        Err(e) => {
            tracing::warn!("could not write the token cache: {e}");
            "tokenised, cache not written".to_string()
        }
    }
}

impl DataSource for TextSource {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn batch(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        rng: &mut ChaCha8Rng,
        device: &Device,
    ) -> Result<Batch> {
        check_shape(batch_size, block_size)?;
        self.check_block_size(block_size)?;
        let data = self.tokens(split);
        let w = block_size + 1;
        let last_start = (data.len() - w) as u64;
        let mut rows = Vec::with_capacity(batch_size * w);
        for _ in 0..batch_size {
            let start = rng.random_range(0..=last_start) as usize;
            rows.extend_from_slice(&data[start..start + w]);
        }
        rows_to_batch(&rows, None, batch_size, block_size, device)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.vocab {
            Vocab::Char { index, chars } => text
                .chars()
                .map(|c| {
                    index.get(&c).copied().ok_or_else(|| {
                        Error::data(
                            &self.path,
                            format!(
                                "character {c:?} (U+{:04X}) is not in the vocabulary of {} \
                                 characters built from this file",
                                c as u32,
                                chars.len()
                            ),
                        )
                    })
                })
                .collect(),
            Vocab::Byte => Ok(text.bytes().map(u32::from).collect()),
            Vocab::Tokenizer { tokenizer, path } => tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display()))),
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::data(
                &self.path,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        match &self.vocab {
            Vocab::Char { chars, .. } => Ok(ids.iter().map(|&i| chars[i as usize]).collect()),
            Vocab::Byte => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Vocab::Tokenizer { tokenizer, path } => tokenizer
                .decode(ids, false)
                .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display()))),
        }
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        let need = block_size + 1;
        let n = self.tokens.len();
        for (split, which) in [
            (Split::Train, "train split (the first"),
            (Split::Val, "val split (the last"),
        ] {
            let have = self.tokens(split).len();
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
