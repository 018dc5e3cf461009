//! Turning a unit of `prepare`'s input ([`super::input`]) into document pieces: the
//! vocabulary's encoder, the texts or SFT records of a unit, and their tokens.

use std::path::{Path, PathBuf};

use super::format::{
    byte_vocab_hash, char_vocab_hash, tokenizer_vocab_hash, PairEntry, TokenizerInfo,
};
use super::input::unit_reader;
use super::options::{InputFormat, PrepareOptions, VocabSpec};
use super::unit::{start, Unit};
use crate::error::{Error, Result};
use crate::parquet::RowRecord;
use crate::sft::preference::parse_preference;
use crate::sft::{parse_line, Record, SftEncoder};
use crate::tokenizer::TokenizerFile;
use crate::vocab::Vocab;

/// Part of a document: a whole record, or a unit of a text file (whose document is the file).
#[derive(Default)]
pub(crate) struct Piece {
    /// Whether a document starts with this piece.
    pub starts: bool,
    pub tokens: Vec<u32>,
    /// Loss-mask flags (SFT), one a token.
    pub counted: Option<Vec<bool>>,
    /// The preference pair the document is (preference records; `tokens` its chosen then
    /// rejected sequence).
    pub pair: Option<PairEntry>,
    /// A preference record dropped because its prompt alone fills the maximum length (no
    /// tokens).
    pub dropped: bool,
}

/// How text becomes tokens.
pub(crate) enum Encoder {
    /// A vocabulary (a tokenizer's, the inputs' characters, or bytes); `eos` appended after
    /// each document.
    Vocab { vocab: Vocab, eos: Option<u32> },
    /// SFT records rendered and masked by [`SftEncoder`].
    Sft(Box<SftEncoder>),
    /// Preference records tokenised by [`SftEncoder::encode_preference`], each pair cut to
    /// `max_length` tokens a sequence (and dropped when its prompt fills them).
    Preference {
        encoder: Box<SftEncoder>,
        max_length: Option<usize>,
    },
}

/// The `path:line` of a unit's `i`-th line.
fn at(path: &Path, line: u64) -> PathBuf {
    PathBuf::from(format!("{}:{line}", path.display()))
}

fn utf8<'b>(bytes: &'b [u8], path: &Path, unit: &Unit) -> Result<&'b str> {
    std::str::from_utf8(bytes).map_err(|e| {
        Error::data(
            path,
            format!(
                "not valid UTF-8 (first invalid byte at offset {}); use --vocab byte for binary \
                 files",
                unit.at.offset + e.valid_up_to() as u64
            ),
        )
    })
}

/// The texts of a unit, each with where it is (`path:line`, or the Parquet row): for text,
/// the unit itself; for JSONL, `field` of each non-blank line; for Parquet, the rows' strings.
pub(crate) fn texts(
    unit: &Unit,
    path: &Path,
    format: InputFormat,
    field: &str,
) -> Result<Vec<(PathBuf, String)>> {
    if let Some(rows) = &unit.rows {
        return Ok(rows
            .iter()
            .filter_map(|r| match &r.record {
                RowRecord::Text(t) => Some((r.at.name(path), t.clone())),
                RowRecord::Sft(_) => None,
            })
            .collect());
    }
    let text = utf8(&unit.bytes, path, unit)?;
    match format {
        InputFormat::Text => Ok(vec![(at(path, unit.at.line), text.to_string())]),
        InputFormat::Sft | InputFormat::Preference => Ok(Vec::new()),
        InputFormat::Jsonl => {
            let mut out = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let n = unit.at.line + i as u64;
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| Error::data(at(path, n), format!("not JSON: {e}")))?;
                let s = match v.get(field) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    Some(other) => {
                        return Err(Error::data(
                            at(path, n),
                            format!("field `{field}` is not a string: {other}"),
                        ))
                    }
                    None => {
                        let keys: Vec<&String> = v
                            .as_object()
                            .map(|o| o.keys().collect())
                            .unwrap_or_default();
                        return Err(Error::data(
                            at(path, n),
                            format!("no field `{field}` (keys {keys:?}); choose one with --field"),
                        ));
                    }
                };
                out.push((at(path, n), s));
            }
            Ok(out)
        }
    }
}

/// The piece of one SFT record read at `here` (what errors name).
fn sft_piece(enc: &SftEncoder, record: &Record, here: &Path) -> Result<Piece> {
    let ex = enc.encode_record(record).map_err(|e| match e {
        Error::Data { msg, .. } => Error::data(here, msg),
        other => other,
    })?;
    Ok(Piece {
        starts: true,
        tokens: ex.tokens,
        counted: Some(ex.counted),
        ..Piece::default()
    })
}

/// The piece of the preference record on line `line` (`text`) of `path`: its pair's chosen
/// then rejected sequence, cut to `max_length`; a dropped piece when its prompt fills that.
fn preference_piece(
    enc: &SftEncoder,
    text: &str,
    max_length: Option<usize>,
    path: &Path,
    line: u64,
) -> Result<Piece> {
    let here = at(path, line);
    let record = parse_preference(text).map_err(|msg| Error::data(&here, msg))?;
    let pair = enc.encode_preference(&record).map_err(|e| match e {
        Error::Data { path: p, msg } => Error::data(&here, format!("{}: {msg}", p.display())),
        other => other,
    })?;
    let pair = match max_length {
        Some(max) => match pair.truncated(max) {
            Some(p) => p,
            None => {
                return Ok(Piece {
                    dropped: true,
                    ..Piece::default()
                })
            }
        },
        None => pair,
    };
    let entry = PairEntry {
        prompt_len: pair.prompt_len as u64,
        chosen_len: pair.chosen.len() as u64,
        rejected_len: pair.rejected.len() as u64,
        line,
    };
    let mut tokens = pair.chosen;
    tokens.extend(pair.rejected);
    Ok(Piece {
        starts: true,
        tokens,
        pair: Some(entry),
        ..Piece::default()
    })
}

impl Encoder {
    /// The tokens of `text`, read at `here` (what errors name).
    fn encode(&self, text: &str, here: &Path) -> Result<Vec<u32>> {
        match self {
            Encoder::Vocab { vocab, .. } => vocab.encode(text, here),
            Encoder::Sft(_) | Encoder::Preference { .. } => {
                unreachable!("SFT and preference records are encoded by encode_unit")
            }
        }
    }

    /// The token appended after each document, if any.
    pub(crate) fn eos(&self) -> Option<u32> {
        match self {
            Encoder::Vocab { eos, .. } => *eos,
            Encoder::Sft(_) | Encoder::Preference { .. } => None,
        }
    }

    /// The document pieces of `unit` (of the file `path`), in order.
    pub(crate) fn encode_unit(
        &self,
        unit: &Unit,
        path: &Path,
        format: InputFormat,
        field: &str,
    ) -> Result<Vec<Piece>> {
        if let (Encoder::Sft(enc), Some(rows)) = (self, &unit.rows) {
            let mut out = Vec::with_capacity(rows.len());
            for row in rows {
                let RowRecord::Sft(record) = &row.record else {
                    unreachable!("SFT rows hold SFT records")
                };
                out.push(sft_piece(enc, record, &row.at.name(path))?);
            }
            return Ok(out);
        }
        if let Encoder::Preference {
            encoder,
            max_length,
        } = self
        {
            let text = utf8(&unit.bytes, path, unit)?;
            let lines = text.lines().enumerate();
            return lines
                .filter(|(_, line)| !line.trim().is_empty())
                .map(|(i, line)| {
                    let n = unit.at.line + i as u64;
                    preference_piece(encoder, line, *max_length, path, n)
                })
                .collect();
        }
        if let Encoder::Sft(enc) = self {
            let text = utf8(&unit.bytes, path, unit)?;
            let mut out = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let n = unit.at.line + i as u64;
                let record: Record =
                    parse_line(line).map_err(|msg| Error::data(at(path, n), msg))?;
                out.push(sft_piece(enc, &record, &at(path, n))?);
            }
            return Ok(out);
        }
        // A Parquet row is a document whatever the format.
        let records = format != InputFormat::Text || unit.rows.is_some();
        let bytes_vocab = matches!(
            self,
            Encoder::Vocab {
                vocab: Vocab::Byte,
                ..
            }
        ) && !records;
        let mut out = Vec::new();
        if bytes_vocab {
            out.push(Piece {
                starts: unit.at.offset == 0,
                tokens: unit.bytes.iter().map(|&b| u32::from(b)).collect(),
                ..Piece::default()
            });
        } else {
            for (here, text) in texts(unit, path, format, field)? {
                let tokens = self.encode(&text, &here)?;
                out.push(Piece {
                    starts: records || unit.at.offset == 0,
                    tokens,
                    ..Piece::default()
                });
            }
        }
        if let Some(eos) = self.eos() {
            for p in out.iter_mut() {
                // A text file is one document (EOS after its last unit); a record is one.
                if records || unit.eof {
                    p.tokens.push(eos);
                }
            }
        }
        Ok(out)
    }
}

/// The encoder, vocabulary description and vocabulary size `opts` asks for.
pub(crate) fn build_encoder(
    opts: &PrepareOptions,
    files: &[PathBuf],
) -> Result<(Encoder, TokenizerInfo, u64)> {
    match (&opts.vocab, opts.format) {
        (VocabSpec::Tokenizer(path), InputFormat::Sft | InputFormat::Preference) => {
            let enc = Box::new(SftEncoder::open(path)?);
            let hash = tokenizer_vocab_hash(enc.tokenizer());
            let size = enc.tokenizer().get_vocab_size(true) as u64;
            let info = tok_info("tokenizer", Some(path.clone()), hash, None);
            let encoder = match opts.format {
                InputFormat::Sft => Encoder::Sft(enc),
                _ => Encoder::Preference {
                    encoder: enc,
                    max_length: opts.max_length,
                },
            };
            Ok((encoder, info, size))
        }
        (_, InputFormat::Sft | InputFormat::Preference) => Err(Error::Config(format!(
            "--format {} needs a tokenizer.json (--tokenizer) with its chat template",
            opts.format
        ))),
        (VocabSpec::Tokenizer(path), _) => {
            let file = TokenizerFile::open(path)?;
            let default_eos = file.special_tokens().eos;
            let eos = match &opts.eos_token {
                Some(t) => Some(file.tokenizer().token_to_id(t).ok_or_else(|| {
                    Error::Tokenizer(format!("{}: no token {t:?} (--eos-token)", path.display()))
                })?),
                None => default_eos,
            };
            let Some(eos) = eos else {
                return Err(Error::Tokenizer(format!(
                    "{}: no EOS token (no eos_token in tokenizer_config.json, no <|endoftext|> \
                     or </s>); name one with --eos-token",
                    path.display()
                )));
            };
            let hash = tokenizer_vocab_hash(file.tokenizer());
            let size = file.vocab_size() as u64;
            let info = tok_info("tokenizer", Some(path.clone()), hash, None);
            let enc = Encoder::Vocab {
                vocab: Vocab::Tokenizer(Box::new(file)),
                eos: Some(eos),
            };
            Ok((enc, info, size))
        }
        (VocabSpec::Byte, _) => Ok((
            Encoder::Vocab {
                vocab: Vocab::Byte,
                eos: None,
            },
            tok_info("byte", None, byte_vocab_hash(), None),
            256,
        )),
        (VocabSpec::Char, _) => {
            let chars = scan_chars(opts, files)?;
            let info = tok_info(
                "char",
                None,
                char_vocab_hash(&chars),
                Some(chars.iter().collect()),
            );
            let size = chars.len() as u64;
            let enc = Encoder::Vocab {
                vocab: Vocab::chars(chars),
                eos: None,
            };
            Ok((enc, info, size))
        }
    }
}

fn tok_info(kind: &str, path: Option<PathBuf>, hash: u64, chars: Option<String>) -> TokenizerInfo {
    TokenizerInfo {
        kind: kind.into(),
        path,
        hash: format!("{hash:016x}"),
        chars,
    }
}

/// The sorted unique characters of every document (one streaming pass).
fn scan_chars(opts: &PrepareOptions, files: &[PathBuf]) -> Result<Vec<char>> {
    let mut reader = unit_reader(opts, files, start())?;
    let mut set = std::collections::BTreeSet::new();
    while let Some(unit) = reader.next_unit()? {
        for (_, t) in texts(&unit, &files[unit.at.file], opts.format, &opts.field)? {
            set.extend(t.chars());
        }
    }
    if set.is_empty() {
        return Err(Error::data(&opts.out_dir, "the inputs hold no characters"));
    }
    Ok(set.into_iter().collect())
}
