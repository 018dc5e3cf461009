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

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind};

use super::records::{Message, Role};
use crate::error::{Error, Result};
use crate::pretrained::TOKENIZER_CONFIG_FILE;

/// The file transformers 5 writes a model's chat template to.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

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

/// `raise_exception(message)`: fails the rendering with the template's message.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC time formatted like Python's `strftime` (`%d`,
/// `%m`, `%Y`, `%y`, `%b`, `%B`, `%a`, `%A`, `%H`, `%M`, `%S`, `%j`, `%%`).
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, secs)
}

/// `format` for the UTC time `secs` seconds after the Unix epoch.
fn strftime(format: &str, secs: i64) -> std::result::Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mname = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&mname[..3]),
            Some('B') => out.push_str(mname),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// `tojson`, as transformers defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0))),
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item, key) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v.try_iter()?.map(|p| p.to_string()).collect();
            match parts.as_slice() {
                [a, b] => (a.clone(), b.clone()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ascii: ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(out)
}

/// How Python's `json.dumps` lays out its output.
struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ascii: bool,
}

impl JsonStyle {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn write(
        &self,
        v: &Value,
        depth: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => {
                let f: f64 = v.clone().try_into()?;
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    out.push_str(&format!("{f:.1}"));
                } else if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&f.to_string());
                }
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    match k.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&k.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.write(&v.get_item(k)?, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push(']');
            }
            _ => self.string(&v.to_string(), out),
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "template_tests.rs"]
mod tests;
