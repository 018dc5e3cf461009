//! How token ids become text and back: the vocabularies of text corpora and prepared shards.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A vocabulary: encodes text, decodes ids, and names its identity hash.
pub(crate) enum Vocab {
    /// Sorted unique characters of a corpus; id = position.
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
    /// Bare ids without a known vocabulary (a nanoGPT `.bin` without `--tokenizer-path`):
    /// decoding shows the ids, encoding is refused.
    Ids,
}

impl Vocab {
    /// A character vocabulary over `chars` (sorted ascending, unique).
    pub(crate) fn chars(chars: Vec<char>) -> Self {
        let index = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Vocab::Char { chars, index }
    }

    /// Loads a Hugging Face `tokenizer.json`, naming it on error.
    pub(crate) fn tokenizer(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::Tokenizer(format!(
                "{}: not a valid tokenizer.json: {e}",
                path.display()
            ))
        })?;
        Ok(Vocab::Tokenizer {
            tokenizer: Box::new(tokenizer),
            path: path.to_path_buf(),
        })
    }

    /// The vocabulary's identity (the hashes `prepare` stamps in shard headers).
    pub(crate) fn hash(&self) -> u64 {
        use super::shards::format;
        match self {
            Vocab::Char { chars, .. } => format::char_vocab_hash(chars),
            Vocab::Byte => format::byte_vocab_hash(),
            Vocab::Tokenizer { tokenizer, .. } => format::tokenizer_vocab_hash(tokenizer),
            Vocab::Ids => crate::hash::hash_bytes(b"bare token ids"),
        }
    }

    /// The number of ids it defines (0 for bare ids).
    pub(crate) fn size(&self) -> usize {
        match self {
            Vocab::Char { chars, .. } => chars.len(),
            Vocab::Byte => 256,
            Vocab::Tokenizer { tokenizer, .. } => tokenizer.get_vocab_size(true),
            Vocab::Ids => 0,
        }
    }

    /// Encodes `text`; `data` names the corpus in errors.
    pub(crate) fn encode(&self, text: &str, data: &Path) -> Result<Vec<u32>> {
        match self {
            Vocab::Char { index, chars } => text
                .chars()
                .map(|c| {
                    index.get(&c).copied().ok_or_else(|| {
                        Error::data(
                            data,
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
            Vocab::Ids => Err(Error::data(
                data,
                "has no vocabulary to encode text with; give --tokenizer-path",
            )),
        }
    }

    /// Decodes `ids`, each below `vocab_size`; `data` names the corpus in errors.
    pub(crate) fn decode(&self, ids: &[u32], vocab_size: usize, data: &Path) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(Error::data(
                data,
                format!("token id {bad} is outside the vocabulary of {vocab_size}"),
            ));
        }
        match self {
            Vocab::Char { chars, .. } => Ok(ids.iter().map(|&i| chars[i as usize]).collect()),
            Vocab::Byte => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Vocab::Tokenizer { tokenizer, path } => tokenizer
                .decode(ids, false)
                .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display()))),
            Vocab::Ids => Ok(ids
                .iter()
                .map(|i| format!("<{i}>"))
                .collect::<Vec<_>>()
                .join("")),
        }
    }
}
