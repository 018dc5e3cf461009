//! How token ids become text and back: the vocabularies of text corpora and prepared shards.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::tokenizer::TokenizerFile;

/// A vocabulary: encodes text, decodes ids, and names its identity hash.
pub(crate) enum Vocab {
    /// Sorted unique characters of a corpus; id = position.
    Char {
        chars: Vec<char>,
        index: HashMap<char, u32>,
    },
    /// One token per byte.
    Byte,
    /// A Hugging Face `tokenizer.json`.
    Tokenizer(Box<TokenizerFile>),
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
        Ok(Vocab::Tokenizer(Box::new(TokenizerFile::open(path)?)))
    }

    /// The vocabulary's identity (the hashes `prepare` stamps in shard headers).
    pub(crate) fn hash(&self) -> u64 {
        use super::shards::format;
        match self {
            Vocab::Char { chars, .. } => format::char_vocab_hash(chars),
            Vocab::Byte => format::byte_vocab_hash(),
            Vocab::Tokenizer(file) => format::tokenizer_vocab_hash(file.tokenizer()),
            Vocab::Ids => crate::hash::hash_bytes(b"bare token ids"),
        }
    }

    /// The number of ids it defines (0 for bare ids).
    pub(crate) fn size(&self) -> usize {
        match self {
            Vocab::Char { chars, .. } => chars.len(),
            Vocab::Byte => 256,
            Vocab::Tokenizer(file) => file.vocab_size(),
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
            Vocab::Tokenizer(file) => file.encode(text),
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
            Vocab::Tokenizer(file) => file.decode(ids),
            Vocab::Ids => Ok(ids
                .iter()
                .map(|i| format!("<{i}>"))
                .collect::<Vec<_>>()
                .join("")),
        }
    }
}
