//! [`DataSpec`]: which data a run trains on (the data fields of a run config), checked
//! before anything is read.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Addition, DataOrder};
use crate::error::{Error, Result};

/// Kind of data source; serialised in lowercase (`"addition"`, `"char"`, `"byte"`,
/// `"tokenizer"`, `"sft"`, `"chat-task"`, `"shards"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// The embedded multi-digit addition task (no file).
    #[default]
    Addition,
    /// Character-level vocabulary built from a UTF-8 text file.
    Char,
    /// Byte-level vocabulary (256 tokens) over any file.
    Byte,
    /// A Hugging Face `tokenizer.json` applied to a UTF-8 text file.
    Tokenizer,
    /// Supervised fine-tuning records (JSONL) with a Hugging Face tokenizer and its chat
    /// template.
    Sft,
    /// A generated chat task ([`ChatTaskKind`]) with a Hugging Face tokenizer and its chat
    /// template, trained as `sft` data (no file).
    #[serde(rename = "chat-task")]
    ChatTask,
    /// A directory of token shards `trainer prepare` wrote, or nanoGPT's `train.bin` /
    /// `val.bin`, memory-mapped (see [`ShardSource`](super::ShardSource)); one prepared with
    /// `--format preference` serves its pairs as `preference` data does
    /// ([`PreferenceSource::open_shards`](super::sft::PreferenceSource::open_shards)).
    Shards,
    /// Preference records (JSONL `prompt` / `chosen` / `rejected`) with a Hugging Face
    /// tokenizer and its chat template, served as pairs for `objective = dpo`
    /// ([`sft::PreferenceSource`](super::sft::PreferenceSource)).
    Preference,
}

impl DataKind {
    /// Whether this kind reads a Hugging Face `tokenizer.json` (`tokenizer`, `sft` and
    /// `chat-task`).
    pub fn uses_tokenizer(self) -> bool {
        matches!(
            self,
            DataKind::Tokenizer | DataKind::Sft | DataKind::ChatTask | DataKind::Preference
        )
    }

    /// Whether this kind reads a file named by `data_path` (not `addition` or `chat-task`,
    /// which generate their data).
    pub fn uses_path(self) -> bool {
        !matches!(self, DataKind::Addition | DataKind::ChatTask)
    }
}

named_enum!(DataKind, "data must be addition, char, byte, tokenizer, sft, chat-task, shards or preference", {
    Addition => "addition",
    Char => "char",
    Byte => "byte",
    Tokenizer => "tokenizer",
    Sft => "sft",
    ChatTask => "chat-task",
    Shards => "shards",
    Preference => "preference",
});

/// Which generated chat task.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ChatTaskKind {
    /// The base's pretraining mix: copy a string; the letter after / before one letter.
    #[serde(rename = "basics")]
    Basics,
    /// The fine-tuning task: the letter after each letter of a string.
    #[default]
    #[serde(rename = "after-each")]
    AfterEach,
}

named_enum!(ChatTaskKind, "chat_task must be basics or after-each", {
    Basics => "basics",
    AfterEach => "after-each",
});

/// Default number of generated examples (both splits).
pub const DEFAULT_EXAMPLES: usize = 20_000;

/// Configuration of the data source (the `[data]` section of a run config).
///
/// Every field has a default, so a config may give only the ones it changes; the default is
/// the embedded 3-digit addition task.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DataSpec {
    /// Which source to build.
    pub kind: DataKind,
    /// The text (or binary, for `byte`) file; required for `char`, `byte` and `tokenizer`,
    /// must be unset for `addition`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`; required for `tokenizer` and `sft` (whose chat
    /// template and special tokens are read from `chat_template.jinja` /
    /// `tokenizer_config.json` beside it), unused otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Fraction held out for validation, strictly between 0 and 1: the last part of a text
    /// corpus, or the fraction of (unordered) operand pairs held out for `addition`.
    pub val_fraction: f32,
    /// Where tokenised corpora are cached; `None` means `$XDG_CACHE_HOME/candle-train`, else
    /// `$HOME/.cache/candle-train`, else `.cache/candle-train`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// `addition`: number of digits of each operand (1 to 9).
    pub digits: usize,
    /// `addition`: seed of the train/held-out split and of the evaluation problems; `sft`:
    /// seed of the train/validation split of the examples.
    pub seed: u64,
    /// `sft`: pack several examples into each row (positions restart and attention stays
    /// within each example) instead of one right-padded example a row.
    pub packing: bool,
    /// `sft`: only the assistant turns / completions count in the loss; `false` trains on
    /// every token.
    pub completion_only: bool,
    /// `chat-task`: which generated task.
    pub chat_task: ChatTaskKind,
    /// `chat-task`: number of generated conversations (both splits).
    pub chat_examples: usize,
    /// Text and shard sources: random windows, or one pass per epoch in a seeded order.
    pub order: DataOrder,
    /// `shards`: packed-document rows (positions restart and attention stays within each
    /// document; needs shards with a document-start stream).
    pub doc_mask: bool,
}

impl Default for DataSpec {
    fn default() -> Self {
        DataSpec {
            kind: DataKind::Addition,
            path: None,
            tokenizer: None,
            val_fraction: 0.1,
            cache_dir: None,
            digits: Addition::DEFAULT_DIGITS,
            seed: 1337,
            packing: true,
            completion_only: true,
            chat_task: ChatTaskKind::default(),
            chat_examples: DEFAULT_EXAMPLES,
            order: DataOrder::Random,
            doc_mask: false,
        }
    }
}

impl DataSpec {
    /// Checks the fields that do not need the file system: `val_fraction` range and which paths
    /// each kind needs.
    pub fn validate(&self) -> Result<()> {
        let vf = self.val_fraction;
        if !(vf > 0.0 && vf < 1.0) {
            let subject = match &self.path {
                Some(p) => format!(" for {}", p.display()),
                None => String::new(),
            };
            return Err(Error::Config(format!(
                "val_fraction = {vf}{subject} must be strictly between 0 and 1"
            )));
        }
        match self.kind {
            DataKind::Addition => {
                if let Some(p) = &self.path {
                    return Err(Error::Config(format!(
                        "data_path = {} is set but data = addition (which needs no file); \
                         set --data to char, byte or tokenizer",
                        p.display()
                    )));
                }
                if !(1..=Addition::MAX_DIGITS).contains(&self.digits) {
                    return Err(Error::Config(format!(
                        "digits = {} must be between 1 and {}",
                        self.digits,
                        Addition::MAX_DIGITS
                    )));
                }
            }
            DataKind::ChatTask => {
                if let Some(p) = &self.path {
                    return Err(Error::Config(format!(
                        "data_path = {} is set but data = chat-task (which generates its data)",
                        p.display()
                    )));
                }
                if self.tokenizer.is_none() {
                    return Err(Error::Config(
                        "data = chat-task needs --tokenizer-path (tokenizer_path, a \
                         tokenizer.json with a chat template beside it; by default the \
                         --init-from model's)"
                            .into(),
                    ));
                }
            }
            DataKind::Char
            | DataKind::Byte
            | DataKind::Tokenizer
            | DataKind::Sft
            | DataKind::Shards
            | DataKind::Preference => {
                if self.path.is_none() {
                    let what = match self.kind {
                        DataKind::Sft => "a JSONL or Parquet file",
                        DataKind::Preference => "a JSONL file",
                        DataKind::Shards => "a directory of shards",
                        _ => "a text file",
                    };
                    return Err(Error::Config(format!(
                        "data = {} needs --data-path (data_path, {what})",
                        self.kind
                    )));
                }
                if self.kind.uses_tokenizer() && self.tokenizer.is_none() {
                    return Err(Error::Config(format!(
                        "data = {} needs --tokenizer-path (tokenizer_path, a tokenizer.json \
                         file; by default the --init-from model's)",
                        self.kind
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::open;

    #[test]
    fn default_spec_is_addition_and_valid() {
        let spec = DataSpec::default();
        assert_eq!(spec.kind, DataKind::Addition);
        spec.validate().unwrap();
        let src = open(&spec).unwrap();
        assert!(src.task().is_some());
    }

    #[test]
    fn spec_serde_round_trip_and_lowercase_kinds() {
        for kind in [
            DataKind::Addition,
            DataKind::Char,
            DataKind::Byte,
            DataKind::Tokenizer,
            DataKind::Sft,
            DataKind::ChatTask,
            DataKind::Shards,
        ] {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{kind}\""));
        }
        let spec = DataSpec {
            kind: DataKind::Char,
            path: Some("a.txt".into()),
            ..DataSpec::default()
        };
        let json = serde_json::to_string(&spec).unwrap();
        let back: DataSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
        // Missing fields take their defaults.
        let partial: DataSpec = serde_json::from_str(r#"{"kind":"byte","path":"x"}"#).unwrap();
        assert_eq!(partial.val_fraction, DataSpec::default().val_fraction);
        assert!(serde_json::from_str::<DataSpec>(r#"{"knd":"byte"}"#).is_err());
    }

    #[test]
    fn val_fraction_outside_open_interval_is_rejected() {
        for vf in [0.0, 1.0, -0.1, 1.5, f32::NAN] {
            let spec = DataSpec {
                kind: DataKind::Char,
                path: Some("corpus.txt".into()),
                val_fraction: vf,
                ..DataSpec::default()
            };
            let err = open(&spec).err().expect("must fail").to_string();
            assert!(err.contains("val_fraction"), "{err}");
            assert!(err.contains("corpus.txt"), "{err}");
        }
    }

    #[test]
    fn missing_paths_are_config_errors() {
        let no_path = DataSpec {
            kind: DataKind::Byte,
            ..DataSpec::default()
        };
        assert!(open(&no_path)
            .err()
            .unwrap()
            .to_string()
            .contains("data_path"));
        let no_tok = DataSpec {
            kind: DataKind::Tokenizer,
            path: Some("a.txt".into()),
            ..DataSpec::default()
        };
        let err = open(&no_tok).err().unwrap().to_string();
        assert!(err.contains("tokenizer_path"), "{err}");
        let addition_with_path = DataSpec {
            path: Some("a.txt".into()),
            ..DataSpec::default()
        };
        let err = open(&addition_with_path).err().unwrap().to_string();
        assert!(err.contains("a.txt"), "{err}");
        let zero_digits = DataSpec {
            digits: 0,
            ..DataSpec::default()
        };
        assert!(open(&zero_digits).is_err());
    }
}
