//! Preference records for DPO, one JSON object a line, tokenised as TRL's `DPOTrainer` does.
//!
//! - explicit prompt: `{"prompt", "chosen", "rejected"}`, all strings or all lists of
//!   messages (rendered with the model's chat template, as SFT renders them);
//! - implicit prompt: `{"chosen", "rejected"}` only: the prompt is their longest common prefix
//!   (of characters, less a trailing space, for strings; of whole messages for
//!   conversations), TRL's `extract_prompt`. An empty common prefix is refused naming
//!   `file:line` (TRL would train on an empty prompt).
//!
//! String completions get the tokenizer's EOS appended when they do not end with it; strings
//! are tokenised with the tokenizer's post-processor (its BOS), conversations without it. The
//! completion starts where the tokenised prompt and the tokenised prompt + completion diverge
//! (the shorter of the two divergences). A pair is cut to `max_length` tokens keeping the
//! start (TRL's `keep_start`); a pair whose prompt alone fills `max_length` is dropped.

use std::path::Path;

use candle_core::Device;
use minijinja::value::{Value, ValueKind};

use super::records::{at_line, messages};
use super::{layout, Example, Message, SftEncoder};
use crate::error::{Error, Result};
use crate::lines::for_each_line;
use crate::Batch;

/// One side of a preference record: text, or messages rendered with the chat template.
#[derive(Clone, Debug)]
pub enum Turns {
    /// A string.
    Text(String),
    /// A list of chat messages.
    Messages(Vec<Message>),
}

/// A preference record: a prompt and two completions, `chosen` preferred over `rejected`.
#[derive(Clone, Debug)]
pub struct Preference {
    /// The prompt (given, or the common prefix of an implicit-prompt record).
    pub prompt: Turns,
    /// The preferred completion.
    pub chosen: Turns,
    /// The other completion.
    pub rejected: Turns,
}

/// A preference record and the (1-based) line it was read from.
#[derive(Clone, Debug)]
pub struct LinePreference {
    /// Line number in the file, from 1.
    pub line: usize,
    /// The record.
    pub record: Preference,
}

/// Reads a JSONL file of preference records, one a line (see `parse_preference`; blank
/// lines skipped); errors name `file:line`.
pub fn read_preferences(path: &Path) -> Result<Vec<LinePreference>> {
    let mut out = Vec::new();
    for_each_line(path, |n, line| {
        if line.trim().is_empty() {
            return Ok(());
        }
        let at = format!("{}:{n}", path.display());
        let record = parse_preference(line).map_err(|msg| Error::data(at, msg))?;
        out.push(LinePreference { line: n, record });
        Ok(())
    })?;
    if out.is_empty() {
        return Err(Error::data(
            path,
            "no preference records (the file is empty or only blank lines); expected one JSON \
             object a line with `chosen` and `rejected` (and optionally `prompt`)",
        ));
    }
    Ok(out)
}

/// Parses one preference record; the error says what is wrong (the caller adds where).
///
/// - explicit prompt: `{"prompt", "chosen", "rejected"}`, all strings or all lists of
///   messages;
/// - implicit prompt: `{"chosen", "rejected"}` only: the prompt is their longest common prefix
///   (of characters, less a trailing space, for strings; of whole messages for
///   conversations), as TRL's `extract_prompt` splits them; an empty one is an error.
pub(crate) fn parse_preference(line: &str) -> std::result::Result<Preference, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    if value.kind() != ValueKind::Map {
        return Err(format!("expected a JSON object, found {}", value.kind()));
    }
    let get = |k: &str| {
        let v = value.get_attr(k).unwrap_or_default();
        (!v.is_undefined()).then_some(v)
    };
    let chosen = get("chosen")
        .ok_or("has no `chosen` (a preference record needs `chosen` and `rejected`)")?;
    let rejected =
        get("rejected").ok_or("has `chosen` but no `rejected` (a preference record needs both)")?;
    let side = |v: &Value, field: &str| match v.as_str() {
        Some(s) => Ok(Turns::Text(s.to_string())),
        None if v.kind() == ValueKind::Seq => Ok(Turns::Messages(messages(v, field)?)),
        None => Err(format!(
            "`{field}` must be a string or a list of messages, found {}",
            v.kind()
        )),
    };
    let (chosen, rejected) = (side(&chosen, "chosen")?, side(&rejected, "rejected")?);
    let prompt = match get("prompt") {
        Some(p) => side(&p, "prompt")?,
        None => return implicit(chosen, rejected),
    };
    match (&prompt, &chosen, &rejected) {
        (Turns::Text(_), Turns::Text(_), Turns::Text(_)) => {}
        (Turns::Messages(_), Turns::Messages(_), Turns::Messages(_)) => {}
        _ => {
            return Err(
                "`prompt`, `chosen` and `rejected` must all be strings or all lists of messages"
                    .into(),
            )
        }
    }
    Ok(Preference {
        prompt,
        chosen,
        rejected,
    })
}

/// The index TRL's `extract_prompt` splits at: the first index where the two differ (one back
/// when the item before it is a space, for strings), or the last index of the shorter when
/// one is a prefix of the other (its loop runs out).
fn split_at<T: PartialEq>(a: &[T], b: &[T], is_space: impl Fn(&T) -> bool) -> usize {
    let n = a.len().min(b.len());
    match (0..n).find(|&i| a[i] != b[i]) {
        Some(i) if i > 0 && is_space(&a[i - 1]) => i - 1,
        Some(i) => i,
        None => n.saturating_sub(1),
    }
}

/// The implicit-prompt record: the prompt is the common prefix of `chosen` and `rejected`.
fn implicit(chosen: Turns, rejected: Turns) -> std::result::Result<Preference, String> {
    let empty = "the implicit prompt (the common prefix of `chosen` and `rejected`) is empty; \
                 give the prompt in `prompt`";
    match (chosen, rejected) {
        (Turns::Text(c), Turns::Text(r)) => {
            let (cc, rc): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let i = split_at(&cc, &rc, |ch| *ch == ' ');
            if i == 0 {
                return Err(empty.into());
            }
            let text = |v: &[char]| v.iter().collect::<String>();
            Ok(Preference {
                prompt: Turns::Text(text(&cc[..i])),
                chosen: Turns::Text(text(&cc[i..])),
                rejected: Turns::Text(text(&rc[i..])),
            })
        }
        (Turns::Messages(c), Turns::Messages(r)) => {
            let (cv, rv): (Vec<&Value>, Vec<&Value>) = (
                c.iter().map(Message::value).collect(),
                r.iter().map(Message::value).collect(),
            );
            let i = split_at(&cv, &rv, |_| false);
            if i == 0 {
                return Err(empty.into());
            }
            Ok(Preference {
                prompt: Turns::Messages(c[..i].to_vec()),
                chosen: Turns::Messages(c[i..].to_vec()),
                rejected: Turns::Messages(r[i..].to_vec()),
            })
        }
        _ => Err("`chosen` and `rejected` must both be strings or both lists of messages".into()),
    }
}

/// A tokenised preference pair: the prompt's length and the two whole sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreferencePair {
    /// Tokens of the prompt at the start of both sequences.
    pub prompt_len: usize,
    /// Prompt + chosen completion.
    pub chosen: Vec<u32>,
    /// Prompt + rejected completion.
    pub rejected: Vec<u32>,
}

impl PreferencePair {
    /// The pair cut to `max_length` tokens a sequence, keeping the start; `None` when the
    /// prompt alone fills `max_length` (no completion token would be left).
    pub fn truncated(&self, max_length: usize) -> Option<PreferencePair> {
        (self.prompt_len < max_length).then(|| self.cut(max_length))
    }

    /// The pair cut to `max_length` tokens a sequence, keeping the start, even when no
    /// completion token is left.
    pub(crate) fn cut(&self, max_length: usize) -> PreferencePair {
        let cut = |v: &[u32]| v[..v.len().min(max_length)].to_vec();
        PreferencePair {
            prompt_len: self.prompt_len,
            chosen: cut(&self.chosen),
            rejected: cut(&self.rejected),
        }
    }

    /// The two rows as examples (chosen first), the completion's tokens counted.
    fn examples(&self) -> [Example; 2] {
        let ex = |tokens: &[u32]| Example {
            tokens: tokens.to_vec(),
            counted: (0..tokens.len()).map(|i| i >= self.prompt_len).collect(),
        };
        [ex(&self.chosen), ex(&self.rejected)]
    }
}

impl SftEncoder {
    /// Tokenises a preference record as TRL's `DPOTrainer` does: strings with the tokenizer's
    /// post-processor and the EOS appended to each completion, messages rendered with the chat
    /// template (the prompt with the generation prompt); the completion starts where the
    /// tokenised prompt and prompt + completion diverge (the shorter of the two
    /// divergences). A prompt that tokenises to nothing is an error (no token would precede
    /// the completion's first).
    pub fn encode_preference(&self, record: &Preference) -> Result<PreferencePair> {
        let (p, c, r) = match (&record.prompt, &record.chosen, &record.rejected) {
            (Turns::Text(p), Turns::Text(c), Turns::Text(r)) => {
                let full = |c: &str| format!("{p}{}", self.with_eos(c));
                (
                    self.tokenize(p, true)?.0,
                    self.tokenize(&full(c), true)?.0,
                    self.tokenize(&full(r), true)?.0,
                )
            }
            (Turns::Messages(p), Turns::Messages(c), Turns::Messages(r)) => {
                let chat = self.chat()?;
                let full = |c: &[Message]| {
                    let all: Vec<Message> = p.iter().chain(c).cloned().collect();
                    chat.render(&all, false)
                };
                (
                    self.tokenize(&chat.render(p, true)?, false)?.0,
                    self.tokenize(&full(c)?, false)?.0,
                    self.tokenize(&full(r)?, false)?.0,
                )
            }
            _ => {
                return Err(Error::Config(
                    "a preference record's prompt, chosen and rejected must all be strings or \
                     all messages"
                        .into(),
                ))
            }
        };
        let common = |a: &[u32]| p.iter().zip(a).take_while(|(x, y)| x == y).count();
        let prompt_len = common(&c).min(common(&r));
        if prompt_len == 0 {
            return Err(Error::data(
                self.path(),
                "the prompt tokenises to no tokens shared with its completions",
            ));
        }
        Ok(PreferencePair {
            prompt_len,
            chosen: c,
            rejected: r,
        })
    }
}

/// Tokenised preference pairs of a file, cut to a length.
#[derive(Clone, Debug)]
pub struct Preferences {
    /// The pairs kept, in file order.
    pub pairs: Vec<PreferencePair>,
    /// The line of the file each kept pair was read from.
    pub lines: Vec<usize>,
    /// How many records were dropped because their prompt alone fills `max_length`.
    pub dropped: usize,
}

impl Preferences {
    /// Tokenises `records` (read from `path`, named with the line in errors) with `encoder`,
    /// each pair cut to `max_length` tokens; pairs whose prompt fills `max_length` are dropped
    /// and counted (logged).
    pub fn encode(
        encoder: &SftEncoder,
        records: &[LinePreference],
        path: &Path,
        max_length: usize,
    ) -> Result<Self> {
        let mut out = Preferences {
            pairs: Vec::new(),
            lines: Vec::new(),
            dropped: 0,
        };
        for rec in records {
            let pair = encoder
                .encode_preference(&rec.record)
                .map_err(at_line(path, rec.line))?;
            match pair.truncated(max_length) {
                Some(p) => {
                    out.pairs.push(p);
                    out.lines.push(rec.line);
                }
                None => out.dropped += 1,
            }
        }
        if out.dropped > 0 {
            tracing::info!(
                "{}: dropped {} of {} preference records whose prompt alone fills {max_length} \
                 tokens",
                path.display(),
                out.dropped,
                records.len()
            );
        }
        if out.pairs.is_empty() {
            return Err(Error::data(
                path,
                format!("every record's prompt fills {max_length} tokens; nothing to train on"),
            ));
        }
        Ok(out)
    }
}

/// A batch of `pairs`: rows `2i` and `2i + 1` are pair `i`'s chosen and rejected sequences,
/// right-padded with `pad` to `block_size` inputs (cut to `block_size + 1` tokens), the loss
/// mask over the completions' tokens.
pub fn preference_batch(
    pairs: &[&PreferencePair],
    block_size: usize,
    pad: u32,
    device: &Device,
) -> Result<Batch> {
    let examples: Vec<Example> = pairs.iter().flat_map(|p| p.examples()).collect();
    let refs: Vec<&Example> = examples.iter().collect();
    let l = layout::padded(&refs, block_size, pad);
    let shape = (refs.len(), block_size);
    Ok(Batch::from_host(l.x, l.y, shape, device)?.with_host_mask(l.mask, device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_implicit_prompt_is_the_common_prefix() {
        let p = parse_preference(r#"{"chosen": "Q: hi? A: yes.", "rejected": "Q: hi? A: no."}"#)
            .unwrap();
        assert!(matches!(p.prompt, Turns::Text(ref t) if t == "Q: hi? A:"));
        assert!(matches!(p.chosen, Turns::Text(ref t) if t == " yes."));
        assert!(parse_preference(r#"{"prompt": "a", "chosen": "b"}"#).is_err());
    }

    fn texts(p: &Preference) -> [String; 3] {
        let t = |t: &Turns| match t {
            Turns::Text(s) => s.clone(),
            Turns::Messages(_) => panic!("messages"),
        };
        [t(&p.prompt), t(&p.chosen), t(&p.rejected)]
    }

    /// TRL's `extract_prompt` on the same strings (trl 1.16.0): a space before the split goes
    /// to the completions, characters (not bytes) are compared, and when one is a prefix of
    /// the other its loop stops one short.
    #[test]
    fn implicit_prompts_split_as_trl() {
        let cases = [
            (
                r#"{"chosen": "Q: x A: yes", "rejected": "Q: x A: no"}"#,
                ["Q: x A:", " yes", " no"],
            ),
            (
                r#"{"chosen": "héllo wörld", "rejected": "héllo wärld"}"#,
                ["héllo w", "örld", "ärld"],
            ),
            (r#"{"chosen": "ab", "rejected": "abc"}"#, ["a", "b", "bc"]),
        ];
        for (line, want) in cases {
            assert_eq!(texts(&parse_preference(line).unwrap()), want, "{line}");
        }
    }
}
