//! [`SftEncoder`]: records (conversations, prompt/completion pairs, text) tokenised into
//! [`Example`]s with the loss mask TRL's `SFTTrainer` gives them (see the [`sft`](super)
//! module docs).

use std::ops::Range;
use std::path::Path;

use super::template::CHAT_TEMPLATE_FILE;
use super::{ChatTemplate, Message, Record};
use crate::error::{Error, Result};
use crate::tokenizer::{TokenizerFile, TOKENIZER_CONFIG_FILE};

/// One tokenised training example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Whether each token counts as a target: the inputs are `tokens[..n-1]`, the targets
    /// `tokens[1..]`, and target `j` counts iff `counted[j + 1]` (`counted[0]` is never used).
    pub counted: Vec<bool>,
}

impl Example {
    /// Number of targets that count in the loss.
    pub fn counted_targets(&self) -> usize {
        self.counted.iter().skip(1).filter(|&&c| c).count()
    }
}

/// Turns records into [`Example`]s: a tokenizer, the chat template beside it (if any) and its
/// end-of-text token.
pub struct SftEncoder {
    pub(super) file: TokenizerFile,
    template: Option<ChatTemplate>,
    eos: Option<String>,
    pad: Option<u32>,
}

impl SftEncoder {
    /// Loads `tokenizer_json` and the chat template and special tokens beside it
    /// (`chat_template.jinja`, `tokenizer_config.json`; see [`ChatTemplate::from_model_dir`]).
    /// A directory without a chat template is fine for `text` and string prompt/completion
    /// records; conversations then fail with an error saying so.
    pub fn open(tokenizer_json: &Path) -> Result<Self> {
        let file = TokenizerFile::open(tokenizer_json)?;
        let eos_id = file.special_tokens().eos;
        let tokenizer = file.tokenizer();
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| Error::data(&config_path, format!("not valid JSON: {e}")))?,
            Err(_) => serde_json::Value::Null,
        };
        let has_template =
            dir.join(CHAT_TEMPLATE_FILE).is_file() || config.get("chat_template").is_some();
        let template = if has_template {
            Some(ChatTemplate::from_model_dir(dir)?)
        } else {
            None
        };
        let eos = eos_id.and_then(|id| tokenizer.id_to_token(id));
        let pad = config
            .get("pad_token")
            .and_then(|t| t.as_str().or_else(|| t.get("content")?.as_str()))
            .and_then(|t| tokenizer.token_to_id(t))
            .or(eos_id);
        Ok(SftEncoder {
            file,
            template,
            eos,
            pad,
        })
    }

    /// The tokenizer file.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The chat template, if the tokenizer's directory has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        self.file.tokenizer()
    }

    /// The id that pads rows (the tokenizer config's `pad_token`, else EOS, else 0).
    pub fn pad_id(&self) -> u32 {
        self.pad.unwrap_or(0)
    }

    pub(super) fn chat(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().ok_or_else(|| {
            Error::data(
                self.path(),
                format!(
                    "conversations need a chat template, but there is no {CHAT_TEMPLATE_FILE} \
                     and no `chat_template` in {TOKENIZER_CONFIG_FILE} beside this tokenizer"
                ),
            )
        })
    }

    /// Renders `messages` with the chat template, as `apply_chat_template(messages,
    /// add_generation_prompt=..., tokenize=False)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.chat()?.render(messages, add_generation_prompt)
    }

    /// The token ids of a conversation and which of them are assistant tokens (the loss mask
    /// `apply_chat_template(..., return_assistant_tokens_mask=True)` gives for templates with
    /// generation markers).
    pub fn encode_messages(&self, messages: &[Message]) -> Result<Example> {
        let rendered = self.chat()?.render_spans(messages)?;
        let (tokens, offsets) = self.tokenize(&rendered.text, false)?;
        let counted = counted_from_spans(&offsets, &rendered.spans);
        Ok(Example { tokens, counted })
    }

    /// Tokenises one record (see the module docs for what counts).
    pub fn encode_record(&self, record: &Record) -> Result<Example> {
        match record {
            Record::Messages(m) => self.encode_messages(m),
            Record::Text(text) => {
                let (tokens, _) = self.tokenize(&self.with_eos(text), true)?;
                let counted = vec![true; tokens.len()];
                Ok(Example { tokens, counted })
            }
            Record::PromptCompletion { prompt, completion } => {
                let (p, _) = self.tokenize(prompt, true)?;
                let full = format!("{prompt}{}", self.with_eos(completion));
                let (tokens, _) = self.tokenize(&full, true)?;
                Ok(completion_example(&p, tokens))
            }
            Record::ChatPromptCompletion { prompt, completion } => {
                let chat = self.chat()?;
                let p_text = chat.render(prompt, true)?;
                let all: Vec<Message> = prompt.iter().chain(completion).cloned().collect();
                let full = chat.render(&all, false)?;
                let (p, _) = self.tokenize(&p_text, false)?;
                let (tokens, _) = self.tokenize(&full, false)?;
                Ok(completion_example(&p, tokens))
            }
        }
    }

    /// `text` with the EOS text appended unless it already ends with it.
    pub(super) fn with_eos(&self, text: &str) -> String {
        match &self.eos {
            Some(eos) if !text.ends_with(eos.as_str()) => format!("{text}{eos}"),
            _ => text.to_string(),
        }
    }

    /// Token ids and byte offsets of `text`.
    pub(super) fn tokenize(&self, text: &str, special: bool) -> Result<(Vec<u32>, Vec<Offsets>)> {
        let enc = self
            .tokenizer()
            .encode(text, special)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", self.path().display())))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }
}

/// A token's byte range in the text it was encoded from.
pub(super) type Offsets = (usize, usize);

/// `tokens` with the tokens after their common prefix with `prompt` counted.
pub(super) fn completion_example(prompt: &[u32], tokens: Vec<u32>) -> Example {
    let common = prompt
        .iter()
        .zip(&tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let counted = (0..tokens.len()).map(|i| i >= common).collect();
    Example { tokens, counted }
}

/// Which tokens (by byte offsets) fall in `spans`: as transformers' assistant mask, every token
/// from the one holding a span's first byte to the one holding its last (a token that overlaps
/// a span counts; an empty-offset token counts when it sits inside one).
pub(super) fn counted_from_spans(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<bool> {
    offsets
        .iter()
        .map(|&(s, e)| {
            spans.iter().any(|sp| {
                if e > s {
                    s < sp.end && e > sp.start
                } else {
                    sp.start <= s && s < sp.end
                }
            })
        })
        .collect()
}
