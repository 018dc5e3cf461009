//! What `prepare` is asked to do ([`PrepareOptions`]: inputs, format, vocabulary, shard
//! size, split) and what it reports ([`PrepareProgress`], [`PrepareSummary`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::format::Manifest;
use crate::error::Result;

/// How input files are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// Plain UTF-8 text: each file is one document.
    #[default]
    Text,
    /// JSON lines: each non-blank line is a document, its text in [`PrepareOptions::field`].
    Jsonl,
    /// SFT records (TRL `messages`, `prompt`/`completion`, `text`) rendered with the chat
    /// template and masked as [`SftEncoder`](crate::sft::SftEncoder) does; shards carry the loss mask. No EOS is
    /// appended (the encoder ends examples itself).
    Sft,
    /// Preference records (`prompt` / `chosen` / `rejected`, or the implicit-prompt form),
    /// one JSON object a line, tokenised as `data = preference` tokenises them; each becomes
    /// a document of the shards' pair layout (see [`super::format`]). No EOS is appended
    /// (string completions get theirs from the encoder).
    Preference,
}

impl InputFormat {
    /// The format of `inputs` (files, directories, globs) when none is given: JSON lines (a
    /// document a record, its [`PrepareOptions::field`]) when every file they name ends in
    /// `.jsonl`, `.json` or `.parquet`, else text.
    pub fn detect(inputs: &[PathBuf]) -> Result<Self> {
        let files = super::files::expand_inputs(inputs)?;
        let jsonl = files.iter().all(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("jsonl") | Some("json") | Some("parquet")
            )
        });
        Ok(match jsonl {
            true => InputFormat::Jsonl,
            false => InputFormat::Text,
        })
    }
}

named_enum!(InputFormat, "--format must be text, jsonl, sft or preference", {
    Text => "text",
    Jsonl => "jsonl",
    Sft => "sft",
    Preference => "preference",
});

/// How input files are stored (`trainer prepare --input-format`); what their records are is
/// the [`InputFormat`]. A Parquet file holds rows: with `text` and `jsonl` formats, each row
/// is a document (its [`PrepareOptions::field`] column); with `sft`, each row is a record.
///
/// ```
/// use candle_data::shards::{Container, PrepareOptions};
///
/// let opts = PrepareOptions {
///     container: "parquet".parse::<Container>().map_err(candle_data::Error::Config)?,
///     ..PrepareOptions::default()
/// };
/// assert_eq!(opts.container.to_string(), "parquet");
/// # Ok::<(), candle_data::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Container {
    /// By extension: `.parquet` files are Parquet, others text or JSON lines as the format
    /// says.
    #[default]
    Auto,
    /// Every file is Parquet.
    Parquet,
    /// Every file is JSON lines (`jsonl` and `sft` formats).
    Jsonl,
    /// Every file is plain text (`text` format).
    Text,
}

named_enum!(Container, "--input-format must be auto, parquet, jsonl or text", {
    Auto => "auto",
    Parquet => "parquet",
    Jsonl => "jsonl",
    Text => "text",
});

/// The vocabulary tokens come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VocabSpec {
    /// A Hugging Face `tokenizer.json`.
    Tokenizer(PathBuf),
    /// The sorted unique characters of the inputs (an extra pass over them).
    Char,
    /// One token a byte.
    Byte,
}

/// What `prepare` does.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Files, directories or globs, read in this order.
    pub inputs: Vec<PathBuf>,
    /// The directory shards and `manifest.json` go to.
    pub out_dir: PathBuf,
    /// What the records of the files are.
    pub format: InputFormat,
    /// How the files are stored (by extension by default).
    pub container: Container,
    /// JSONL: the field holding the text.
    pub field: String,
    /// The vocabulary.
    pub vocab: VocabSpec,
    /// The EOS token text (default: `tokenizer_config.json`'s `eos_token`, else
    /// `<|endoftext|>`, else `</s>`). Char and byte vocabularies append none.
    pub eos_token: Option<String>,
    /// Tokens a shard (the last of each split may be shorter).
    pub shard_tokens: u64,
    /// Fraction of documents held out for validation, in `[0, 1)`.
    pub val_fraction: f64,
    /// Worker threads (0: one a core). Changes nothing in the output.
    pub threads: usize,
    /// Bytes of input tokenised as one unit (part of the output's identity for text files).
    pub chunk_bytes: usize,
    /// Replace a directory prepared with other inputs or settings.
    pub overwrite: bool,
    /// JSONL and SFT: the longest line, in bytes (a longer one is refused naming `file:line`
    /// before it is read whole; see [`crate::lines`]).
    pub max_line_bytes: usize,
    /// Preference: each sequence cut to this many tokens keeping its start (TRL's
    /// `max_length`, `keep_start`), and records whose prompt alone fills it dropped (counted
    /// in [`PrepareSummary::dropped`]). `None`: whole pairs (training cuts them to its block).
    pub max_length: Option<usize>,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            inputs: Vec::new(),
            out_dir: PathBuf::from("prepared"),
            format: InputFormat::Text,
            container: Container::Auto,
            field: "text".into(),
            vocab: VocabSpec::Byte,
            eos_token: None,
            shard_tokens: 100_000_000,
            val_fraction: 0.0,
            threads: 0,
            chunk_bytes: 1 << 20,
            overwrite: false,
            max_line_bytes: crate::lines::MAX_LINE_BYTES,
            max_length: None,
        }
    }
}

/// Where `prepare` is, for a progress bar.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrepareProgress {
    /// Input bytes read so far (counting those before a resume point).
    pub bytes_done: u64,
    /// Input bytes in all.
    pub bytes_total: u64,
    /// Tokens made by this call.
    pub tokens: u64,
    /// Shards finished (both splits, resumed ones included).
    pub shards: usize,
}

/// What `prepare` did.
#[derive(Clone, Debug)]
pub struct PrepareSummary {
    /// The manifest written.
    pub manifest: Manifest,
    /// Finished shards kept from an earlier, interrupted run.
    pub resumed_shards: usize,
    /// Whether the directory was already fully prepared (nothing was done).
    pub up_to_date: bool,
    /// Input bytes read by this call.
    pub bytes_read: u64,
    /// Tokens made by this call.
    pub tokens_made: u64,
    /// Preference records this call dropped because their prompt alone fills
    /// [`PrepareOptions::max_length`].
    pub dropped: u64,
}
