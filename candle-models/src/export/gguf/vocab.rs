//! A Hugging Face tokenizer as GGUF's `tokenizer.*` metadata, read as llama.cpp's converter
//! reads it (`convert_hf_to_gguf.py`'s `get_vocab_base` and gguf-py's `SpecialVocab`): the
//! tokens by id with their types, the merges, the special ids and whether BOS/EOS are added,
//! the chat template, and `tokenizer.ggml.pre`, the name llama.cpp gives the pre-tokenizer.
//!
//! Byte-level BPE tokenizers (`"model": {"type": "BPE"}` with a `ByteLevel` pre-tokenizer:
//! GPT-2, Llama 3, Qwen2, SmolLM2) are written as llama.cpp's `gpt2` model. Others are
//! refused by name: GGUF cannot express a `WordLevel` vocabulary, and a pre-tokenizer
//! llama.cpp does not know would tokenize differently there.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::Value as Json;

use super::writer::Value;
use crate::{Error, Result};

/// llama.cpp's token types (`enum llama_token_type`).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The special-token kinds gguf-py's `SpecialVocab` reads, in its order.
const SPECIAL: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];

/// Split regexes of the pre-tokenizers llama.cpp implements, by the name it knows them by
/// (from the published `tokenizer.json` files; llama.cpp's converter recognises them by a
/// hash of their output on a test string, `get_vocab_base_pre`).
const SPLIT_PATTERNS: [(&str, &str); 2] = [
    (
        "llama-bpe",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        "qwen2",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// The `tokenizer.*` metadata of the tokenizer in `dir` (`tokenizer.json`,
/// `tokenizer_config.json`, `chat_template.jinja`, `config.json`) for a model of
/// `vocab_size` embeddings.
pub fn metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let path = dir.join(candle_data::tokenizer::TOKENIZER_FILE);
    let tokenizer = read_json(&path)?;
    let model = &tokenizer["model"];
    let kind = model["type"].as_str().unwrap_or("?");
    let config_path = dir.join("tokenizer_config.json");
    let mut config = match config_path.is_file() {
        true => Some(read_json(&config_path)?),
        false => None,
    };
    if kind == "BPE"
        && model["byte_fallback"].as_bool() == Some(true)
        && tokenizer["decoder"]["type"] == "Sequence"
    {
        let mut out = sentencepiece(&tokenizer, config.as_ref(), &path)?;
        let n = match &out[2].1 {
            Value::Strs(t) => t.len(),
            _ => vocab_size,
        };
        SpecialVocab::read(&tokenizer, config.as_mut(), dir, n)?.append_to(&mut out);
        return Ok(out);
    }
    if kind != "BPE" {
        return Err(refused(
            &path,
            &format!(
                "a {kind} vocabulary, which GGUF cannot express (llama.cpp reads byte-level BPE \
                 and SentencePiece vocabularies); export without it with --gguf-no-tokenizer"
            ),
        ));
    }
    let pre = pre_name(&tokenizer["pre_tokenizer"]).ok_or_else(|| {
        refused(
            &path,
            &format!(
                "pre_tokenizer {} is not one llama.cpp implements (byte-level BPE with GPT-2's, \
                 Llama 3's or Qwen2's split, or SmolLM's digits); export without the tokenizer \
                 with --gguf-no-tokenizer",
                tokenizer["pre_tokenizer"]
            ),
        )
    })?;
    let (tokens, types) = tokens(&tokenizer, &path, vocab_size)?;
    let merges = merges(model, &path)?;
    let special = SpecialVocab::read(&tokenizer, config.as_mut(), dir, vocab_size)?;
    let mut out = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::Str("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".to_string(), Value::Str(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Strs(tokens)),
        ("tokenizer.ggml.token_type".to_string(), Value::I32s(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Strs(merges)),
    ];
    special.append_to(&mut out);
    Ok(out)
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::checkpoint(path, e.to_string()))
}

fn refused(path: &Path, why: &str) -> Error {
    Error::Config(format!(
        "{}: cannot be written to GGUF: {why}",
        path.display()
    ))
}

/// llama.cpp's name for a byte-level pre-tokenizer, if it is one it implements.
fn pre_name(pre: &Json) -> Option<&'static str> {
    let byte_level = |p: &Json| p["type"] == "ByteLevel";
    match pre["type"].as_str()? {
        "ByteLevel" if pre["use_regex"].as_bool().unwrap_or(true) => Some("gpt-2"),
        "Sequence" => {
            let parts = pre["pretokenizers"].as_array()?;
            match parts.as_slice() {
                [split, last] if split["type"] == "Split" && byte_level(last) => {
                    let pattern = split["pattern"]["Regex"].as_str()?;
                    SPLIT_PATTERNS
                        .iter()
                        .find(|(_, p)| *p == pattern)
                        .map(|(name, _)| *name)
                }
                [digits, last]
                    if digits["type"] == "Digits"
                        && digits["individual_digits"] == true
                        && byte_level(last)
                        && last["use_regex"].as_bool().unwrap_or(true) =>
                {
                    Some("smollm")
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// The tokens by id (`[PAD{i}]` where an id has none) and their types: added tokens are
/// control tokens when special (or looking special, `<|...|>`), user-defined otherwise.
fn tokens(tokenizer: &Json, path: &Path, vocab_size: usize) -> Result<(Vec<String>, Vec<i32>)> {
    let mut by_id: BTreeMap<usize, (String, i32)> = BTreeMap::new();
    let vocab = tokenizer["model"]["vocab"]
        .as_object()
        .ok_or_else(|| refused(path, "model.vocab is not an object"))?;
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| refused(path, &format!("model.vocab[{token:?}] is not an id")))?;
        by_id.insert(id as usize, (token.clone(), NORMAL));
    }
    for added in tokenizer["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(refused(
                path,
                &format!("added_tokens entry {added} has no id/content"),
            ));
        };
        let special = added["special"].as_bool().unwrap_or(false) || looks_special(content);
        let ty = if special { CONTROL } else { USER_DEFINED };
        let text = match ty {
            USER_DEFINED => content.replace('\u{2581}', " "),
            _ => content.to_string(),
        };
        by_id.insert(id as usize, (text, ty));
    }
    if let Some((&id, _)) = by_id.range(vocab_size..).next() {
        return Err(refused(
            path,
            &format!("token id {id} is outside the model's vocabulary of {vocab_size}"),
        ));
    }
    Ok((0..vocab_size)
        .map(|i| match by_id.remove(&i) {
            Some(t) => t,
            None => (format!("[PAD{i}]"), UNUSED),
        })
        .unzip())
}

/// A SentencePiece-style `tokenizer.json` (BPE with byte fallback, Llama 2, Mistral) as
/// llama.cpp's `llama` tokenizer model, as the converter writes it from `tokenizer.json`
/// (gguf-py's `LlamaHfVocab`; a `tokenizer.model` is not read): the base vocabulary by id, then
/// added tokens past it; `<0xXX>` pieces are byte tokens, special tokens control tokens; every
/// score -1000 and no merges (llama.cpp ranks the pieces by id).
fn sentencepiece(
    tokenizer: &Json,
    config: Option<&Json>,
    path: &Path,
) -> Result<Vec<(String, Value)>> {
    let vocab = tokenizer["model"]["vocab"]
        .as_object()
        .ok_or_else(|| refused(path, "model.vocab is not an object"))?;
    let mut ids: HashMap<String, u32> = HashMap::new();
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| refused(path, &format!("model.vocab[{token:?}] is not an id")))?;
        ids.insert(token.clone(), id as u32);
    }
    let base = vocab.len();
    let mut by_id = vec![None; base];
    for (t, &id) in &ids {
        let slot = by_id
            .get_mut(id as usize)
            .ok_or_else(|| refused(path, &format!("model.vocab id {id} past its {base} pieces")))?;
        *slot = Some(t.clone());
    }
    let mut added: Vec<(u32, String)> = Vec::new();
    for a in tokenizer["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) {
            if id as usize >= base {
                added.push((id as u32, c.to_string()));
            }
            ids.entry(c.to_string()).or_insert(id as u32);
        }
    }
    added.sort();
    // transformers' `all_special_ids`: the config's special tokens and its extra ones.
    let mut special: Vec<u32> = Vec::new();
    if let Some(c) = config {
        let named = SPECIAL
            .iter()
            .filter_map(|t| token_text(&c[format!("{t}_token")]));
        let extra = ["additional_special_tokens", "extra_special_tokens"]
            .iter()
            .flat_map(|k| c[*k].as_array().cloned().unwrap_or_default())
            .filter_map(|v| token_text(&v));
        special.extend(named.chain(extra).filter_map(|t| ids.get(&t).copied()));
    }
    let is_byte = |t: &str| {
        t.len() == 6
            && t.starts_with("<0x")
            && t.ends_with('>')
            && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
    };
    let mut tokens = Vec::with_capacity(base + added.len());
    let mut types = Vec::with_capacity(base + added.len());
    for (id, t) in by_id.into_iter().enumerate() {
        let t = t.ok_or_else(|| refused(path, &format!("model.vocab has no piece {id}")))?;
        types.push(if is_byte(&t) {
            BYTE
        } else if special.contains(&(id as u32)) {
            CONTROL
        } else {
            NORMAL
        });
        tokens.push(t);
    }
    for (id, t) in added {
        types.push(match special.contains(&id) {
            true if is_byte(&t) => BYTE,
            true => CONTROL,
            false => USER_DEFINED,
        });
        tokens.push(t);
    }
    let scores = vec![-1000.0; tokens.len()];
    Ok(vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::Str("llama".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::Str("default".into()),
        ),
        ("tokenizer.ggml.tokens".to_string(), Value::Strs(tokens)),
        ("tokenizer.ggml.scores".to_string(), Value::F32s(scores)),
        ("tokenizer.ggml.token_type".to_string(), Value::I32s(types)),
    ])
}

/// `does_token_look_special` of llama.cpp's converter.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The merges as `"a b"` strings (pairs written as lists get their spaces as U+0120... as
/// gguf-py does: a space inside a part becomes `chr(ord(' ') + 256)`).
fn merges(model: &Json, path: &Path) -> Result<Vec<String>> {
    let Some(list) = model["merges"].as_array() else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(pair) if pair.len() == 2 => {
                let part = |p: &Json| {
                    p.as_str()
                        .map(|s| s.replace(' ', "\u{0120}"))
                        .ok_or_else(|| refused(path, &format!("merge {m} is not two strings")))
                };
                Ok(format!("{} {}", part(&pair[0])?, part(&pair[1])?))
            }
            _ => Err(refused(
                path,
                &format!("merge {m} is not a string or a pair"),
            )),
        })
        .collect()
}

/// gguf-py's `SpecialVocab`: special token ids and whether they are added, from
/// `tokenizer.json`'s post-processor, `tokenizer_config.json` and `config.json`.
#[derive(Default)]
struct SpecialVocab {
    ids: Vec<(String, u32)>,
    add: Vec<(String, bool)>,
    chat_template: Option<String>,
}

impl SpecialVocab {
    fn read(
        tokenizer: &Json,
        config: Option<&mut Json>,
        dir: &Path,
        vocab_size: usize,
    ) -> Result<Self> {
        let mut sv = SpecialVocab::default();
        let get = |c: &Option<&mut Json>, k: &str| -> Option<String> {
            c.as_ref().and_then(|c| token_text(&c[k]))
        };
        let bos = get(&config, "bos_token");
        let cls = get(&config, "cls_token");
        let eos = get(&config, "eos_token");
        if let Some(pp) = tokenizer.get("post_processor").filter(|p| !p.is_null()) {
            let list = match pp["processors"].as_array() {
                Some(l) => l.clone(),
                None => vec![pp.clone()],
            };
            for p in &list {
                match p["type"].as_str() {
                    Some("ByteLevel") => {
                        sv.set_add_default("bos", false);
                        sv.set_add_default("eos", false);
                    }
                    Some("TemplateProcessing") => {
                        sv.template(p, bos.as_deref(), cls.as_deref(), eos.as_deref())
                    }
                    _ => {}
                }
            }
        }
        let added: HashMap<String, u32> = tokenizer["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| Some((t["content"].as_str()?.to_string(), t["id"].as_u64()? as u32)))
            .collect();
        if let Some(c) = config {
            let jinja = dir.join("chat_template.jinja");
            let alt = match jinja.is_file() {
                true => Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?),
                false => None,
            };
            sv.chat_template = c["chat_template"].as_str().map(str::to_string).or(alt);
            for typ in SPECIAL {
                if let Some(add) = c[format!("add_{typ}_token")].as_bool() {
                    sv.set_add_default(typ, add);
                }
                if let Some(text) = token_text(&c[format!("{typ}_token")]) {
                    if let Some(&id) = added.get(&text) {
                        sv.set_id(typ, id, vocab_size);
                    }
                }
            }
        }
        let model_config = dir.join(crate::load::CONFIG_FILE);
        if model_config.is_file() {
            let c = read_json(&model_config)?;
            for typ in SPECIAL {
                if let Some(id) = c[format!("{typ}_token_id")].as_u64() {
                    sv.set_id(typ, id as u32, vocab_size);
                }
            }
        }
        Ok(sv)
    }

    /// A `TemplateProcessing` post-processor: BOS added when its single template starts with
    /// the BOS (or CLS) token; EOS when it ends with the EOS token; a separator between pairs.
    fn template(&mut self, p: &Json, bos: Option<&str>, cls: Option<&str>, eos: Option<&str>) {
        let special = |e: &Json| e["SpecialToken"]["id"].as_str().map(str::to_string);
        let single = p["single"].as_array().cloned().unwrap_or_default();
        let (mut first, mut last) = (None, None);
        if single.len() > 1 {
            first = special(&single[0]);
            if let Some(f) = &first {
                self.add_set("bos", Some(f.as_str()) == bos || Some(f.as_str()) == cls);
            }
            last = special(&single[single.len() - 1]);
            if let Some(l) = &last {
                self.add_set("eos", Some(l.as_str()) == eos);
            }
        }
        let pair = p["pair"].as_array().cloned().unwrap_or_default();
        if pair.is_empty() {
            return;
        }
        let start = usize::from(first.is_some() && special(&pair[0]) == first);
        let stop = match last.is_some() && special(&pair[pair.len() - 1]) == last {
            true => pair.len() - 1,
            false => pair.len(),
        };
        let pair = &pair[start.min(stop)..stop];
        let seq = |e: &Json| e["Sequence"]["id"].as_str().map(str::to_string);
        if pair.len() > 2
            && seq(&pair[0]).as_deref() == Some("A")
            && seq(&pair[pair.len() - 1]).as_deref() == Some("B")
        {
            let middle = &pair[1..pair.len() - 1];
            let is_sep = |e: &Json| special(e).is_some_and(|s| Some(s.as_str()) == eos);
            let mut add_sep = is_sep(&middle[0]) && last.is_none();
            if middle.len() == 2 && is_sep(&middle[1]) {
                add_sep = true;
            }
            self.add_set("sep", add_sep);
        }
    }

    fn add_set(&mut self, typ: &str, v: bool) {
        match self.add.iter_mut().find(|(t, _)| t == typ) {
            Some(e) => e.1 = v,
            None => self.add.push((typ.to_string(), v)),
        }
    }

    fn set_add_default(&mut self, typ: &str, v: bool) {
        if !self.add.iter().any(|(t, _)| t == typ) {
            self.add.push((typ.to_string(), v));
        }
    }

    fn set_id(&mut self, typ: &str, id: u32, vocab_size: usize) {
        if (id as usize) < vocab_size && !self.ids.iter().any(|(t, _)| t == typ) {
            self.ids.push((typ.to_string(), id));
        }
    }

    /// The keys gguf-py's writer has (no CLS id, no "add" flag but BOS/EOS/SEP's).
    fn append_to(self, out: &mut Vec<(String, Value)>) {
        for (typ, id) in self.ids {
            let key = match typ.as_str() {
                "pad" => "padding",
                "sep" => "seperator", // sic, llama.cpp's key
                "unk" => "unknown",
                "cls" => continue,
                t => t,
            };
            out.push((format!("tokenizer.ggml.{key}_token_id"), Value::U32(id)));
        }
        for (typ, add) in self.add {
            if matches!(typ.as_str(), "bos" | "eos" | "sep") {
                out.push((format!("tokenizer.ggml.add_{typ}_token"), Value::Bool(add)));
            }
        }
        if let Some(t) = self.chat_template {
            out.push(("tokenizer.chat_template".to_string(), Value::Str(t)));
        }
    }
}

/// A special token's text in `tokenizer_config.json`: a string, or `{"content": ...}`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}
