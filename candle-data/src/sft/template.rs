//! Chat templates: rendering conversations as `transformers`' `apply_chat_template` does, and
//! finding the assistant's part of the rendered text.
//!
//! The template comes from a model directory: `chat_template.jinja` when present (what
//! transformers 5 writes; it takes priority over the config, as in transformers), else the
//! `chat_template` key of `tokenizer_config.json` (a string, or the legacy list of
//! `{"name", "template"}` of which `"default"` is used).
//!
//! Rendering follows transformers' environment: `trim_blocks` and `lstrip_blocks`, loop
//! controls, `raise_exception`, `strftime_now`, a `tojson` filter that writes like Python's
//! `json.dumps` (no HTML escaping, `ensure_ascii=False`, `indent`, `separators`, `sort_keys`),
//! Python string/dict methods (`.strip()`, `.startswith()`, `.items()`...), and the variables
//! `messages`, `add_generation_prompt` and the special tokens of `tokenizer_config.json`
//! (`bos_token`, `eos_token`, ...).
//!
//! Assistant spans (what the loss covers) come from `{% generation %}...{% endgeneration %}`
//! markers when the template has them, else from rendering prefixes of the conversation (see
//! [`ChatTemplate::render_spans`]).

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::value::Value;
use minijinja::{AutoEscape, Environment};

use super::jinja::{raise_exception, strftime_now, tojson};
use super::records::{Message, Role};
use crate::error::{Error, Result};
use crate::tokenizer::TOKENIZER_CONFIG_FILE;

/// The file transformers 5 writes a model's chat template to.
pub(crate) const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// Marks the start of a `{% generation %}` block in the rendered text (a private-use code
/// point, removed before tokenising).
const GEN_START: char = '\u{E000}';
/// Marks the end of a `{% generation %}` block.
const GEN_END: char = '\u{E001}';

/// The special-token keys of `tokenizer_config.json` passed to templates.
const SPECIAL_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

/// Name of the compiled template in its environment.
const NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: PathBuf,
    generation: bool,
    special: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("generation", &self.generation)
            .field("special", &self.special)
            .finish()
    }
}

/// A rendered conversation and the byte ranges of its assistant parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    /// The text the template produced.
    pub text: String,
    /// Byte ranges of `text` that the loss covers (assistant turns with their end-of-turn
    /// text), in order and disjoint.
    pub spans: Vec<Range<usize>>,
}

/// The special tokens named by a `tokenizer_config.json` value: strings, or AddedToken objects
/// with the text in `content`.
fn special_tokens(config: &serde_json::Value) -> Vec<(String, String)> {
    SPECIAL_KEYS
        .iter()
        .filter_map(|&k| {
            let t = config.get(k)?;
            let text = t.as_str().or_else(|| t.get("content")?.as_str())?;
            Some((k.to_string(), text.to_string()))
        })
        .collect()
}

impl ChatTemplate {
    /// The template of a model directory: `chat_template.jinja` if present, else the
    /// `chat_template` of `tokenizer_config.json`; special tokens from the latter.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let jinja = dir.join(CHAT_TEMPLATE_FILE);
        Self::from_files(
            &dir.join(TOKENIZER_CONFIG_FILE),
            jinja.is_file().then_some(jinja.as_path()),
        )
    }

    /// The template of `jinja` if given, else the `chat_template` key of `config` (a
    /// `tokenizer_config.json`, which also names the special tokens; it may be missing when
    /// `jinja` is given).
    pub fn from_files(config: &Path, jinja: Option<&Path>) -> Result<Self> {
        let config_value = if jinja.is_some() && !config.exists() {
            serde_json::Value::Null
        } else {
            let text = std::fs::read_to_string(config).map_err(|e| Error::io(config, e))?;
            serde_json::from_str(&text)
                .map_err(|e| Error::data(config, format!("not valid JSON: {e}")))?
        };
        let special = special_tokens(&config_value);
        if let Some(jinja) = jinja {
            let source = std::fs::read_to_string(jinja).map_err(|e| Error::io(jinja, e))?;
            return Self::from_source(&source, jinja, special);
        }
        let source = match config_value.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| {
                    Error::data(
                        config,
                        "`chat_template` is a list of named templates without a \"default\" \
                         one (with a `template` string)",
                    )
                })?
                .to_string(),
            Some(other) => {
                return Err(Error::data(
                    config,
                    format!("`chat_template` must be a string or a list, found {other}"),
                ))
            }
            None => {
                return Err(Error::data(
                    config,
                    format!(
                        "no chat template: no `chat_template` key here and no {CHAT_TEMPLATE_FILE} \
                         beside it"
                    ),
                ))
            }
        };
        Self::from_source(&source, config, special)
    }

    /// Compiles `source` (read from `origin`, named in errors) with the special tokens
    /// `special` (`("eos_token", "</s>")`...).
    pub fn from_source(
        source: &str,
        origin: &Path,
        special: Vec<(String, String)>,
    ) -> Result<Self> {
        let (source, generation) = rewrite_generation_tags(source);
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::data(origin, format!("chat template: {e}")))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)
            .map_err(|e| Error::data(origin, format!("chat template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            origin: origin.to_path_buf(),
            generation,
            special,
        })
    }

    /// The file the template was read from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Whether the template marks assistant output with `{% generation %}`.
    pub fn has_generation_markers(&self) -> bool {
        self.generation
    }

    /// The text of a special token of `tokenizer_config.json` (`"eos_token"`...), if named.
    pub fn special_token(&self, key: &str) -> Option<&str> {
        self.special
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Renders `messages` as `apply_chat_template(messages, add_generation_prompt=...,
    /// tokenize=False)` does. Errors name the template file.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let raw = self.render_raw(messages, add_generation_prompt)?;
        Ok(raw.replace([GEN_START, GEN_END], ""))
    }

    /// The text with the generation sentinels still in it.
    fn render_raw(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        if let Some(m) = messages.iter().position(|m| {
            m.content()
                .is_some_and(|c| c.contains([GEN_START, GEN_END]))
        }) {
            return Err(Error::data(
                &self.origin,
                format!(
                    "message {m} contains U+E000 or U+E001, private-use characters this \
                     renderer reserves"
                ),
            ));
        }
        let msgs: Vec<Value> = messages.iter().map(|m| m.value().clone()).collect();
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(msgs)),
            (
                "add_generation_prompt".into(),
                Value::from(add_generation_prompt),
            ),
            // transformers passes these as None when not given.
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
        ];
        for (k, v) in &self.special {
            ctx.push((k.clone(), Value::from(v.as_str())));
        }
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::data(&self.origin, e.to_string()))?;
        tmpl.render(Value::from_pairs(ctx))
            .map_err(|e| Error::data(&self.origin, format!("chat template failed: {e}")))
    }

    /// Renders the whole conversation and finds its assistant spans.
    ///
    /// With `{% generation %}` markers the spans are what the markers enclose. Without them,
    /// for each assistant message `i`, `messages[..i]` is rendered with the generation prompt
    /// (its end is the span's start) and `messages[..=i]` without (its end is the span's end),
    /// so the end-of-turn text the template writes after the content (`<|im_end|>\n`,
    /// `<|eot_id|>`) is in the span and the next turn's header is not. Each prefix rendering
    /// must be a prefix of the whole rendering, else the conversation is refused naming the
    /// message (e.g. a template that rewrites earlier turns once a later one exists).
    pub fn render_spans(&self, messages: &[Message]) -> Result<Rendered> {
        let raw = self.render_raw(messages, false)?;
        if self.generation {
            return split_sentinels(&raw).map_err(|m| Error::data(&self.origin, m));
        }
        let text = raw;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.role() != Role::Assistant {
                continue;
            }
            let prefix = |n: usize, gen: bool| -> Result<usize> {
                let p = self.render(&messages[..n], gen).map_err(|e| {
                    Error::data(
                        &self.origin,
                        format!("rendering the messages before assistant message {i}: {e}"),
                    )
                })?;
                if !text.starts_with(&p) {
                    return Err(Error::data(
                        &self.origin,
                        format!(
                            "cannot find assistant message {i}: the conversation rendered up \
                             to {} (add_generation_prompt={gen}) is not a prefix of the whole \
                             rendering; the template rewrites earlier turns, so only a \
                             template with {{% generation %}} markers can mark this \
                             conversation's assistant turns",
                            if gen { "before it" } else { "it" }
                        ),
                    ));
                }
                Ok(p.len())
            };
            let start = prefix(i, true)?;
            let end = prefix(i + 1, false)?;
            if end > start {
                spans.push(start..end);
            }
        }
        Ok(Rendered { text, spans })
    }
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (with any whitespace control) by a block
/// that outputs a sentinel: `{%- generation %}` becomes `{%- if true %}<S>{% endif %}`, so the
/// tag's own whitespace handling (`-`, trim_blocks, lstrip_blocks) is unchanged.
fn rewrite_generation_tags(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        match parse_tag(tag) {
            Some((len, left, word, right)) => {
                let mark = if word == "generation" {
                    GEN_START
                } else {
                    GEN_END
                };
                out.push_str(&format!("{{%{left} if true %}}{mark}{{% endif {right}%}}"));
                found = true;
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    (out, found)
}

/// `{%<l> generation <r>%}` at the start of `s`: (its length, `l`, the word, `r`).
fn parse_tag(s: &str) -> Option<(usize, &str, &str, &str)> {
    let body = s.strip_prefix("{%")?;
    let left = if body.starts_with(['-', '+']) {
        &body[..1]
    } else {
        ""
    };
    let after = body[left.len()..].trim_start();
    let word = ["endgeneration", "generation"]
        .into_iter()
        .find(|w| after.starts_with(w))?;
    let tail = after[word.len()..].trim_start();
    let right = if tail.starts_with(['-', '+']) {
        &tail[..1]
    } else {
        ""
    };
    let tail = tail[right.len()..].strip_prefix("%}")?;
    Some((s.len() - tail.len(), left, word, right))
}

/// Removes the sentinels from `raw`, returning the text and the ranges they enclosed.
fn split_sentinels(raw: &str) -> std::result::Result<Rendered, String> {
    let mut text = String::with_capacity(raw.len());
    let mut spans = Vec::new();
    let mut open: Option<usize> = None;
    for c in raw.chars() {
        match c {
            GEN_START => {
                if open.is_some() {
                    return Err("nested {% generation %} blocks".into());
                }
                open = Some(text.len());
            }
            GEN_END => {
                let start = open
                    .take()
                    .ok_or("{% endgeneration %} without {% generation %}")?;
                if text.len() > start {
                    spans.push(start..text.len());
                }
            }
            c => text.push(c),
        }
    }
    if open.is_some() {
        return Err("{% generation %} without {% endgeneration %}".into());
    }
    Ok(Rendered { text, spans })
}

#[cfg(test)]
#[path = "template_tests.rs"]
mod tests;
