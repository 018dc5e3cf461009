//! Our SFT data equals transformers' and TRL's on the chat fixtures of
//! `tests/fixtures/chat/` (made by `scripts/python/make_chat_fixtures.py`; see its README):
//! the rendered text byte for byte, the token ids, the assistant masks of the templates with
//! `{% generation %}` markers, and TRL 1.16's SFT tokenization of text, prompt/completion and
//! conversational prompt/completion records (EOS appended, completion masks).
//!
//! Templates without markers get their assistant spans by rendering prefixes of the
//! conversation (see `ChatTemplate::render_spans`); what those spans are, and where they
//! differ from the training templates' masks, is checked in
//! [`prefix_spans_against_the_training_templates`].

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use trainer::data::sft::{parse_messages, parse_records, Example, Record, SftEncoder};

const STYLES: [&str; 6] = [
    "llama3",
    "llama3_1",
    "llama3_training",
    "qwen2_5",
    "qwen2_5_training",
    "smollm2",
];

fn dir(style: &str) -> PathBuf {
    common::fixtures("chat").join(style)
}

fn cases(style: &str) -> Value {
    let text = std::fs::read_to_string(dir(style).join("cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn encoder(style: &str) -> SftEncoder {
    SftEncoder::open(&dir(style).join("tokenizer.json")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn mask(v: &Value) -> Vec<bool> {
    ids(v).into_iter().map(|x| x == 1).collect()
}

fn messages(v: &Value) -> Vec<trainer::data::sft::Message> {
    parse_messages(&v.to_string()).unwrap()
}

/// The conversation cases of `style` (name, case).
fn conversations(style: &str) -> Vec<(String, Value)> {
    cases(style)["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                format!("{style}/{}", c["name"].as_str().unwrap()),
                c.clone(),
            )
        })
        .collect()
}

/// The SFT case `name` of `style`.
fn sft_case(style: &str, name: &str) -> Value {
    cases(style)["sft_cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("{style}: no sft case {name}"))
        .clone()
}

/// `record` (a JSON object) as TRL's dataset row, parsed as one JSONL line.
fn record(record: Value) -> Record {
    let line = record.to_string();
    parse_records(&line, Path::new("case.jsonl")).unwrap()[0]
        .record
        .clone()
}

/// The record of case `c`'s prompt and its completion field `completion`, encoded.
fn prompt_completion(enc: &SftEncoder, c: &Value, completion: &str) -> Example {
    let rec = record(serde_json::json!({
        "prompt": c["prompt"],
        "completion": c[completion],
    }));
    enc.encode_record(&rec).unwrap()
}

fn counted_ids(ex: &Example) -> Vec<u32> {
    ex.tokens
        .iter()
        .zip(&ex.counted)
        .filter(|(_, &c)| c)
        .map(|(&t, _)| t)
        .collect()
}

#[test]
fn rendering_and_token_ids_equal_transformers() {
    for style in STYLES {
        let enc = encoder(style);
        let has_markers = cases(style)["has_generation_markers"].as_bool().unwrap();
        assert_eq!(
            enc.template().unwrap().has_generation_markers(),
            has_markers,
            "{style}"
        );
        for (name, c) in conversations(style) {
            let m = messages(&c["messages"]);
            let gen = c["add_generation_prompt"].as_bool().unwrap();
            let rendered = enc.render(&m, gen).unwrap();
            assert_eq!(
                rendered,
                c["rendered"].as_str().unwrap(),
                "{name}: rendering"
            );
            // apply_chat_template(tokenize=True) = tok(rendered, add_special_tokens=False).
            let tokens = enc.tokenizer().encode(rendered.as_str(), false).unwrap();
            assert_eq!(tokens.get_ids(), ids(&c["input_ids"]), "{name}: token ids");
            if !gen {
                let ex = enc.encode_messages(&m).unwrap();
                assert_eq!(ex.tokens, ids(&c["input_ids"]), "{name}: encode_messages");
            }
        }
    }
}

/// With `{% generation %}` markers our counted tokens are transformers'
/// `return_assistant_tokens_mask`: a token counts when it overlaps a generation block, which on
/// these byte-level tokenizers is the same as transformers' char-to-token mapping (every
/// character of a block marks the token holding it).
#[test]
fn assistant_masks_of_the_training_templates_equal_transformers() {
    for style in ["llama3_training", "qwen2_5_training"] {
        let enc = encoder(style);
        for (name, c) in conversations(style) {
            let m = messages(&c["messages"]);
            let expected = mask(&c["assistant_masks"]);
            let ex = enc.encode_messages(&m).unwrap();
            if c["add_generation_prompt"].as_bool().unwrap() {
                // encode_messages renders without the generation prompt (training data): the
                // mask is transformers' up to it, and the prompt's tokens are not assistant
                // tokens there either.
                let n = ex.tokens.len();
                assert_eq!(ex.tokens, ids(&c["input_ids"])[..n], "{name}");
                assert_eq!(ex.counted, expected[..n], "{name}: assistant mask");
                assert!(expected[n..].iter().all(|&b| !b), "{name}");
            } else {
                assert_eq!(ex.counted, expected, "{name}: assistant mask");
            }
            assert!(
                ex.counted.iter().any(|&b| b),
                "{name}: some assistant tokens"
            );
        }
    }
}

/// Without markers, assistant message `i`'s span runs from the end of `messages[..i]` rendered
/// with the generation prompt to the end of `messages[..=i]` rendered without it:
///
/// - Llama 3 (`llama3`, `llama3_1`): the trimmed content + `<|eot_id|>`, exactly what
///   `llama3_training` marks (checked token for token against its mask; the two templates
///   render the same text).
/// - ChatML (`qwen2_5`, `smollm2`): the content + `<|im_end|>\n`. `qwen2_5_training` opens its
///   generation block right after `<|im_start|>assistant`, so its mask also holds the `\n`
///   that ends the assistant header; the generation prompt is `<|im_start|>assistant\n`, so
///   our span starts after that `\n`. Intended difference: the header's `\n` token is not
///   counted by us (the model is never asked to write the header, which the generation prompt
///   supplies at inference). Otherwise (the trailing `\n` after `<|im_end|>` included) the
///   masks agree token for token.
#[test]
fn prefix_spans_against_the_training_templates() {
    for (plain, training, header_newline) in [
        ("llama3", "llama3_training", false),
        ("qwen2_5", "qwen2_5_training", true),
    ] {
        let enc = encoder(plain);
        let newline = enc.tokenizer().token_to_id("\u{10a}").unwrap(); // byte-level "\n"
        let training_cases = conversations(training);
        for ((name, c), (_, t)) in conversations(plain).into_iter().zip(training_cases) {
            assert_eq!(c["rendered"], t["rendered"], "{name}");
            if c["add_generation_prompt"].as_bool().unwrap() {
                continue;
            }
            let ex = enc.encode_messages(&messages(&c["messages"])).unwrap();
            let mut expected = mask(&t["assistant_masks"]);
            if header_newline {
                // Clear the first token of each masked run: the header's "\n", on its own.
                for j in (0..expected.len()).rev() {
                    if expected[j] && (j == 0 || !expected[j - 1]) {
                        assert_eq!(ex.tokens[j], newline, "{name}: run {j} starts with \\n");
                        expected[j] = false;
                    }
                }
            }
            assert_eq!(ex.counted, expected, "{name}: prefix spans vs {training}");
        }
    }
    // llama3_1 and smollm2 have no training variant here: their counted tokens are exactly the
    // tokens of each assistant content (trimmed for Llama 3.1) followed by the end of turn.
    for (style, trim, end) in [
        ("llama3_1", true, "<|eot_id|>"),
        ("smollm2", false, "<|im_end|>\n"),
    ] {
        let enc = encoder(style);
        for (name, c) in conversations(style) {
            if c["add_generation_prompt"].as_bool().unwrap() {
                continue;
            }
            let m = messages(&c["messages"]);
            let ex = enc.encode_messages(&m).unwrap();
            let mut want = Vec::new();
            for msg in m.iter().filter(|m| m.role().as_str() == "assistant") {
                let content = msg.content().unwrap();
                let content = if trim { content.trim() } else { &content };
                let text = format!("{content}{end}");
                want.extend(
                    enc.tokenizer()
                        .encode(text, false)
                        .unwrap()
                        .get_ids()
                        .to_vec(),
                );
            }
            assert_eq!(counted_ids(&ex), want, "{name}: counted tokens");
        }
    }
}

#[test]
fn text_records_get_eos_once_as_trl() {
    for style in STYLES {
        let enc = encoder(style);
        let c = sft_case(style, "text");
        let expected = ids(&c["input_ids"]);
        let text = c["text"].as_str().unwrap();
        let with_eos = c["text_with_eos"].as_str().unwrap();
        assert_ne!(text, with_eos, "{style}: the fixture's text lacks the EOS");
        for t in [text, with_eos] {
            let ex = enc
                .encode_record(&record(serde_json::json!({ "text": t })))
                .unwrap();
            assert_eq!(ex.tokens, expected, "{style}: text {t:?}");
            assert!(ex.counted.iter().all(|&b| b), "{style}: labels = input_ids");
        }
    }
}

/// Case `c`'s `completion` record encoded, checked against TRL's input ids and mask.
fn prompt_completion_as_trl(enc: &SftEncoder, c: &Value, style: &str) -> Example {
    let ex = prompt_completion(enc, c, "completion");
    assert_eq!(ex.tokens, ids(&c["input_ids"]), "{style}: input ids");
    assert_eq!(ex.counted, mask(&c["completion_mask"]), "{style}: mask");
    ex
}

#[test]
fn prompt_completion_masks_equal_trl() {
    for style in STYLES {
        let enc = encoder(style);
        let c = sft_case(style, "prompt_completion");
        let ex = prompt_completion_as_trl(&enc, &c, style);
        // A completion that already ends with the EOS does not get a second one.
        let again = prompt_completion(&enc, &c, "completion_with_eos");
        assert_eq!(again, ex, "{style}: EOS once");
    }
}

#[test]
fn conversational_prompt_completion_masks_equal_trl() {
    for style in STYLES {
        let enc = encoder(style);
        let c = sft_case(style, "prompt_completion_conversational");
        prompt_completion_as_trl(&enc, &c, style);
        let prompt = enc.render(&messages(&c["prompt"]), true).unwrap();
        let p = enc.tokenizer().encode(prompt.as_str(), false).unwrap();
        assert_eq!(p.get_ids(), ids(&c["prompt_ids"]), "{style}: prompt ids");
        if let Some(am) = c.get("assistant_masks") {
            // The whole conversation as `messages`: the template's assistant mask.
            let all: Vec<Value> = c["prompt"]
                .as_array()
                .unwrap()
                .iter()
                .chain(c["completion"].as_array().unwrap())
                .cloned()
                .collect();
            let ex = enc
                .encode_record(&record(serde_json::json!({ "messages": all })))
                .unwrap();
            assert_eq!(ex.tokens, ids(&c["input_ids"]), "{style}");
            assert_eq!(ex.counted, mask(am), "{style}: assistant mask");
        }
    }
}
