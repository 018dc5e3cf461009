//! A model directory's `tokenizer.json`: encoding prompts, decoding samples, and the
//! vocabulary's beginning/end-of-text tokens.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The Hugging Face tokenizer file name in a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// `transformers`' tokenizer settings file, which names the special tokens.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The beginning- and end-of-text token ids of a vocabulary (`None`: it has no such token).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token_id`.
    pub bos: Option<u32>,
    /// `eos_token_id`.
    pub eos: Option<u32>,
}

/// A Hugging Face `tokenizer.json`, loaded.
pub struct TokenizerFile {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
}

impl TokenizerFile {
    /// Loads the tokenizer at `path`; an unreadable or invalid file is an error naming it.
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::Tokenizer(format!(
                "{}: not a valid tokenizer.json: {e}",
                path.display()
            ))
        })?;
        Ok(TokenizerFile {
            tokenizer,
            path: path.to_path_buf(),
        })
    }

    /// The loaded `tokenizers` tokenizer.
    pub fn into_inner(self) -> tokenizers::Tokenizer {
        self.tokenizer
    }

    /// The loaded `tokenizers` tokenizer, borrowed.
    pub(crate) fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// The file this tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The vocabulary's hash, as a run's data fingerprint records it
    /// ([`crate::Fingerprint::vocab`]).
    pub fn vocab_fingerprint(&self) -> String {
        format!(
            "{:016x}",
            crate::shards::format::tokenizer_vocab_hash(&self.tokenizer)
        )
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Encodes `text` (without the post-processor's special tokens; ids only, no offsets).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", self.path.display())))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids` (special tokens included, so that `<|endoftext|>` shows).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", self.path.display())))
    }

    /// The vocabulary's beginning- and end-of-text tokens.
    ///
    /// Taken from `tokenizer_config.json` next to the tokenizer when it names them
    /// (`bos_token` / `eos_token`, as `transformers` writes it); otherwise from well-known
    /// tokens of the vocabulary: GPT-2's `<|endoftext|>` (both), else `<s>` / `</s>`.
    pub fn special_tokens(&self) -> SpecialTokens {
        let named = self.configured_tokens();
        let id = |t: &str| self.tokenizer.token_to_id(t);
        let (bos, eos) = match id("<|endoftext|>") {
            Some(e) => (Some(e), Some(e)),
            None => (id("<s>"), id("</s>")),
        };
        SpecialTokens {
            bos: named.bos.or(bos),
            eos: named.eos.or(eos),
        }
    }

    /// The tokens `tokenizer_config.json` names, if that file exists and names them.
    fn configured_tokens(&self) -> SpecialTokens {
        let Some(path) = self.path.parent().map(|d| d.join(TOKENIZER_CONFIG_FILE)) else {
            return SpecialTokens::default();
        };
        let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        else {
            return SpecialTokens::default();
        };
        // A plain string, or an AddedToken object with its text in `content`.
        let token = |k: &str| -> Option<u32> {
            let t = v.get(k)?;
            let text = t.as_str().or_else(|| t.get("content")?.as_str())?;
            self.tokenizer.token_to_id(text)
        };
        SpecialTokens {
            bos: token("bos_token"),
            eos: token("eos_token"),
        }
    }
}

/// A word-level tokenizer over `words` (id `i` is `words[i]`, `words[0]` the unknown token),
/// splitting on whitespace and punctuation, with `special` added as special tokens: a small
/// vocabulary for tests and toy corpora, built without a download.
pub fn word_level(words: &[&str], special: &[&str]) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    let Some(unk) = words.first() else {
        return Err(Error::Tokenizer(
            "a word-level vocabulary needs at least one word".into(),
        ));
    };
    let vocab = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token(unk.to_string())
        .build()
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace));
    let special: Vec<_> = special
        .iter()
        .map(|s| tokenizers::AddedToken::from(s.to_string(), true))
        .collect();
    tok.add_special_tokens(&special);
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, words: &[&str]) -> PathBuf {
        let p = dir.join(TOKENIZER_FILE);
        word_level(words, &[]).unwrap().save(&p, false).unwrap();
        p
    }

    #[test]
    fn special_tokens_from_the_config_then_well_known_names() {
        let tmp = tempfile::tempdir().unwrap();
        let p = write(tmp.path(), &["<unk>", "<s>", "</s>", "<|endoftext|>", "x"]);
        let t = TokenizerFile::open(&p).unwrap();
        let both = SpecialTokens {
            bos: Some(3),
            eos: Some(3),
        };
        assert_eq!(t.special_tokens(), both);
        std::fs::write(
            tmp.path().join(TOKENIZER_CONFIG_FILE),
            r#"{"bos_token": "<s>", "eos_token": {"content": "</s>", "special": true}}"#,
        )
        .unwrap();
        let named = SpecialTokens {
            bos: Some(1),
            eos: Some(2),
        };
        assert_eq!(t.special_tokens(), named);

        let tmp = tempfile::tempdir().unwrap();
        let p = write(tmp.path(), &["<unk>", "a", "b"]);
        let t = TokenizerFile::open(&p).unwrap();
        assert_eq!(t.special_tokens(), SpecialTokens::default());
        assert_eq!(t.encode("a").unwrap(), vec![1]);
        let bad = tmp.path().join("bad.json");
        std::fs::write(&bad, "{}").unwrap();
        let err = TokenizerFile::open(&bad).err().unwrap().to_string();
        assert!(err.contains("bad.json"), "{err}");
    }
}
