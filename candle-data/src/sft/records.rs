//! SFT records: one JSON object per line, in the formats TRL's `SFTTrainer` takes.
//!
//! - conversational: `{"messages": [{"role": "user", "content": "..."}, ...]}`
//! - prompt-completion: `{"prompt": "...", "completion": "..."}`
//! - conversational prompt-completion: `{"prompt": [messages], "completion": [messages]}`
//! - language modelling: `{"text": "..."}`
//!
//! Blank lines are skipped; other keys of a record are ignored. Errors name `file:line`.

use std::path::Path;

use minijinja::value::{Value, ValueKind};

use crate::error::{Error, Result};
use crate::lines::{for_each_line, too_long, MAX_LINE_BYTES};

/// The role of a chat message (the roles TRL's datasets and the common templates use).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// `"system"`: instructions before the conversation.
    System,
    /// `"user"`: a user turn.
    User,
    /// `"assistant"`: a model turn (the one trained on).
    Assistant,
    /// `"tool"`: a tool's answer.
    Tool,
}

impl Role {
    /// The role from its name (`"system"`, `"user"`, `"assistant"`, `"tool"`).
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" => Some(Role::Tool),
            _ => None,
        }
    }

    /// The role's name as templates see it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One chat message: its role, and the whole JSON object as the template sees it (with any
/// other keys, such as `tool_calls`, in their original order).
#[derive(Clone, Debug)]
pub struct Message {
    role: Role,
    value: Value,
}

impl Message {
    /// A message with only `role` and `content`.
    pub fn new(role: Role, content: &str) -> Message {
        Message {
            role,
            value: Value::from_pairs([("role", role.as_str()), ("content", content)]),
        }
    }

    /// Checks one message object; the error says what is wrong (the caller adds where).
    pub fn from_value(value: Value) -> std::result::Result<Message, String> {
        if value.kind() != ValueKind::Map {
            return Err(format!("is not a JSON object but {}", value.kind()));
        }
        let role = value.get_attr("role").unwrap_or_default();
        let Some(name) = role.as_str() else {
            return Err("has no string `role`".into());
        };
        let role = Role::parse(name).ok_or_else(|| {
            format!("has unknown role {name:?} (allowed: system, user, assistant, tool)")
        })?;
        let content = value.get_attr("content").unwrap_or_default();
        let tool_calls = value.get_attr("tool_calls").unwrap_or_default();
        let ok = match content.kind() {
            ValueKind::String => true,
            // An assistant turn that only calls tools may have no content.
            ValueKind::None | ValueKind::Undefined => {
                !tool_calls.is_undefined() && !tool_calls.is_none()
            }
            _ => false,
        };
        if !ok {
            return Err("has no string `content`".into());
        }
        Ok(Message { role, value })
    }

    /// The message's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The message's text (`None` for a tool call without content).
    pub fn content(&self) -> Option<String> {
        let c = self.value.get_attr("content").ok()?;
        c.as_str().map(str::to_string)
    }

    /// The message as the template sees it.
    pub fn value(&self) -> &Value {
        &self.value
    }
}

/// A list of messages from JSON (e.g. a fixture's `messages`); the error names the message.
pub fn parse_messages(json: &str) -> Result<Vec<Message>> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| Error::Config(format!("messages are not JSON: {e}")))?;
    messages(&value, "messages").map_err(Error::Config)
}

/// One training record.
#[derive(Clone, Debug)]
pub enum Record {
    /// `{"messages": [...]}`: a conversation; its assistant turns are trained on.
    Messages(Vec<Message>),
    /// `{"prompt": str, "completion": str}`: the completion is trained on.
    PromptCompletion {
        /// Text before the completion.
        prompt: String,
        /// Text trained on.
        completion: String,
    },
    /// `{"prompt": [messages], "completion": [messages]}`: the completion turns are trained on.
    ChatPromptCompletion {
        /// The conversation so far.
        prompt: Vec<Message>,
        /// The answer (usually one assistant message).
        completion: Vec<Message>,
    },
    /// `{"text": str}`: language modelling, every token trained on.
    Text(String),
}

impl Record {
    /// A short name of the record's format, for logs.
    pub fn format(&self) -> &'static str {
        match self {
            Record::Messages(_) => "messages",
            Record::PromptCompletion { .. } => "prompt/completion",
            Record::ChatPromptCompletion { .. } => "conversational prompt/completion",
            Record::Text(_) => "text",
        }
    }
}

/// A record and the (1-based) line it was read from.
#[derive(Clone, Debug)]
pub struct LineRecord {
    /// Line number in the file, from 1 (Parquet: 1 + the row).
    pub line: usize,
    /// The record.
    pub record: Record,
}

/// What becomes of an error encoding the record on `line` of `path`: an error naming
/// `path:line`, its message keeping the file an inner error named (a template, say).
pub(crate) fn at_line(path: &Path, line: usize) -> impl FnOnce(Error) -> Error + '_ {
    move |e| {
        let msg = match e {
            Error::Data { path, msg } => format!("{}: {msg}", path.display()),
            e => e.to_string(),
        };
        Error::data(format!("{}:{}", path.display(), line), msg)
    }
}

/// Reads a JSONL file of records (see the module docs), a line at a time: a line longer than
/// [`MAX_LINE_BYTES`](crate::lines::MAX_LINE_BYTES) is refused naming `file:line` before
/// it is read whole.
pub(crate) fn read_jsonl_records(path: &Path) -> Result<Vec<LineRecord>> {
    let mut out = Vec::new();
    for_each_line(path, |n, line| {
        out.extend(parse_line_at(line, n, path)?);
        Ok(())
    })?;
    no_records(out, path)
}

/// The record of line `n` of `path` (`None` for a blank line).
fn parse_line_at(line: &str, n: usize, path: &Path) -> Result<Option<LineRecord>> {
    if line.trim().is_empty() {
        return Ok(None);
    }
    let record =
        parse_line(line).map_err(|msg| Error::data(format!("{}:{n}", path.display()), msg))?;
    Ok(Some(LineRecord { line: n, record }))
}

pub(crate) fn no_records(out: Vec<LineRecord>, path: &Path) -> Result<Vec<LineRecord>> {
    if out.is_empty() {
        return Err(Error::data(
            path,
            "no records (the file is empty or only blank lines); expected one JSON object a \
             line with `messages`, `prompt` + `completion` or `text`",
        ));
    }
    Ok(out)
}

/// Parses JSONL `text` read from `path` (named in errors as `path:line`).
pub fn parse_records(text: &str, path: &Path) -> Result<Vec<LineRecord>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.len() > MAX_LINE_BYTES {
            return Err(too_long(path, i as u64 + 1, MAX_LINE_BYTES));
        }
        out.extend(parse_line_at(line, i + 1, path)?);
    }
    no_records(out, path)
}

pub(crate) fn parse_line(line: &str) -> std::result::Result<Record, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    parse_value(value)
}

/// The record a JSON object (or a Parquet row, [`crate::parquet`]) holds.
pub(crate) fn parse_value(value: Value) -> std::result::Result<Record, String> {
    if value.kind() != ValueKind::Map {
        return Err(format!("expected a JSON object, found {}", value.kind()));
    }
    let get = |k: &str| {
        let v = value.get_attr(k).unwrap_or_default();
        (!v.is_undefined()).then_some(v)
    };
    if let Some(m) = get("messages") {
        let msgs = messages(&m, "messages")?;
        return Ok(Record::Messages(msgs));
    }
    if let Some(prompt) = get("prompt") {
        let completion = get("completion")
            .ok_or("has `prompt` but no `completion` (prompt-completion records need both)")?;
        return match (prompt.as_str(), completion.as_str()) {
            (Some(p), Some(c)) => Ok(Record::PromptCompletion {
                prompt: p.to_string(),
                completion: c.to_string(),
            }),
            _ if prompt.kind() == ValueKind::Seq && completion.kind() == ValueKind::Seq => {
                Ok(Record::ChatPromptCompletion {
                    prompt: messages(&prompt, "prompt")?,
                    completion: messages(&completion, "completion")?,
                })
            }
            _ => Err(format!(
                "`prompt` ({}) and `completion` ({}) must both be strings or both lists of \
                 messages",
                prompt.kind(),
                completion.kind()
            )),
        };
    }
    if let Some(text) = get("text") {
        return match text.as_str() {
            Some(t) => Ok(Record::Text(t.to_string())),
            None => Err(format!("`text` must be a string, found {}", text.kind())),
        };
    }
    let keys: Vec<String> = value
        .try_iter()
        .map(|it| it.map(|k| k.to_string()).collect())
        .unwrap_or_default();
    Err(format!(
        "no known field: expected `messages`, `prompt` + `completion` or `text`, found keys \
         {keys:?}"
    ))
}

/// The messages of the list `value` (the field `field`), each checked.
pub(super) fn messages(value: &Value, field: &str) -> std::result::Result<Vec<Message>, String> {
    if value.kind() != ValueKind::Seq {
        return Err(format!(
            "`{field}` must be a list of messages, found {}",
            value.kind()
        ));
    }
    let items: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
    if items.is_empty() {
        return Err(format!("`{field}` is an empty list"));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, m)| Message::from_value(m).map_err(|e| format!("`{field}` message {i} {e}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<LineRecord>> {
        parse_records(text, Path::new("data.jsonl"))
    }

    fn err(text: &str) -> String {
        parse(text).expect_err("must fail").to_string()
    }

    #[test]
    fn the_four_formats_and_blank_lines() {
        let text = concat!(
            r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#,
            "\n\n   \n",
            r#"{"prompt": "a", "completion": "b"}"#,
            "\n",
            r#"{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "r"}]}"#,
            "\n",
            r#"{"text": "plain", "id": 3}"#,
            "\n"
        );
        let recs = parse(text).unwrap();
        assert_eq!(
            recs.iter().map(|r| r.line).collect::<Vec<_>>(),
            [1, 4, 5, 6]
        );
        match &recs[0].record {
            Record::Messages(m) => {
                assert_eq!(m.len(), 2);
                assert_eq!(m[1].role(), Role::Assistant);
                assert_eq!(m[1].content().as_deref(), Some("yo"));
            }
            r => panic!("{r:?}"),
        }
        assert!(
            matches!(&recs[1].record, Record::PromptCompletion { prompt, completion }
            if prompt == "a" && completion == "b")
        );
        assert!(
            matches!(&recs[2].record, Record::ChatPromptCompletion { prompt, completion }
            if prompt.len() == 1 && completion[0].role() == Role::Assistant)
        );
        assert!(matches!(&recs[3].record, Record::Text(t) if t == "plain"));
    }

    #[test]
    fn errors_name_file_and_line() {
        let e = err("{\"text\": \"ok\"}\n{not json\n");
        assert!(e.contains("data.jsonl:2") && e.contains("not JSON"), "{e}");
        let e = err("\n{\"txt\": \"x\"}\n");
        assert!(
            e.contains("data.jsonl:2") && e.contains("no known field"),
            "{e}"
        );
        let e = err(r#"{"messages": [{"role": "user"}]}"#);
        assert!(e.contains("data.jsonl:1") && e.contains("content"), "{e}");
        let e = err(r#"{"messages": [{"content": "x"}]}"#);
        assert!(e.contains("data.jsonl:1") && e.contains("role"), "{e}");
        let e = err(r#"{"prompt": "a"}"#);
        assert!(e.contains("completion"), "{e}");
        let e = err(r#"{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}"#);
        assert!(e.contains("both"), "{e}");
        let e = err("[1, 2]");
        assert!(e.contains("JSON object"), "{e}");
    }

    #[test]
    fn unknown_role_is_named() {
        let e = err(
            "{\"text\": \"a\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, \
             {\"role\": \"narrator\", \"content\": \"b\"}]}",
        );
        assert!(e.contains("data.jsonl:2"), "{e}");
        assert!(e.contains("message 1") && e.contains("\"narrator\""), "{e}");
    }

    #[test]
    fn empty_file_is_an_error() {
        let e = err("\n  \n");
        assert!(e.contains("data.jsonl") && e.contains("empty"), "{e}");
    }

    #[test]
    fn tool_call_without_content_is_accepted() {
        let m = parse_messages(
            r#"[{"role": "assistant", "content": null, "tool_calls": [{"name": "f"}]}]"#,
        )
        .unwrap();
        assert_eq!(m[0].content(), None);
    }
}
