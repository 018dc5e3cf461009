//! `trainer train --data sft` from outside: bad records and templates are refused (exit
//! status 1) with a message naming the file and line, the template file, the role or the
//! message; a tiny Llama with a chat fixture's tokenizer trains a few steps on a JSONL of
//! conversations, prompt/completion pairs and text, packed or padded, and the banner's data
//! line counts the examples and targets as the library does.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Device;
use common::{output_text, run_cli};
use serde_json::{json, Value};
use trainer::checkpoint;
use trainer::data::sft::{parse_records, SftEncoder};
use trainer::model::llama::{Family, LlamaConfig};

fn chat_fixture(style: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(style)
}

fn cases(style: &str) -> Value {
    let text = fs::read_to_string(chat_fixture(style).join("cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A fresh tiny Llama (1 layer, 16 wide) over the vocabulary of chat fixture `style`, saved
/// at `dir` with the fixture's tokenizer files (tokenizer.json, tokenizer_config.json,
/// chat_template.jinja where it has one).
fn model_dir(dir: &Path, style: &str) -> String {
    fs::create_dir_all(dir).unwrap();
    let vocab = cases(style)["vocab_size"].as_u64().unwrap() as usize;
    let cfg = LlamaConfig::new(Family::Llama, vocab, 1, 16, 2, 1, 32);
    let (_, params) = trainer::model::init(&cfg, 5, &Device::Cpu).unwrap();
    checkpoint::save_model(dir, &cfg, &params).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let src = chat_fixture(style).join(f);
        if src.is_file() {
            fs::copy(src, dir.join(f)).unwrap();
        }
    }
    dir.to_str().unwrap().to_string()
}

/// Replaces the chat template of model directory `dir` (in its tokenizer_config.json).
fn set_template(dir: &Path, template: &str) {
    let p = dir.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap();
    cfg["chat_template"] = json!(template);
    fs::write(&p, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

/// JSONL of records: the fixture's conversations (those without a generation prompt) and its
/// three TRL SFT cases (prompt/completion, conversational prompt/completion, text).
fn chats(style: &str) -> String {
    let c = cases(style);
    let mut lines = Vec::new();
    for case in c["cases"].as_array().unwrap() {
        if case["add_generation_prompt"] == json!(false) {
            lines.push(json!({ "messages": case["messages"] }).to_string());
        }
    }
    for case in c["sft_cases"].as_array().unwrap() {
        let rec = match case["format"].as_str().unwrap() {
            "text" => json!({ "text": case["text"] }),
            _ => json!({ "prompt": case["prompt"], "completion": case["completion"] }),
        };
        lines.push(rec.to_string());
    }
    lines.join("\n") + "\n"
}

/// `trainer train --init-from model --data sft --data-path data` in blocks of `block` tokens,
/// batches of 2, for `iters` steps (evaluated once, at the end).
fn sft_args<'a>(model: &'a str, data: &'a str, block: &'a str, iters: &'a str) -> Vec<&'a str> {
    let mut args = vec!["train", "--init-from", model, "--data-path", data];
    args.extend(["--block-size", block, "--max-iters", iters]);
    args.extend(["--eval-interval", iters]);
    args.extend(common::words(
        "--data sft --batch-size 2 --eval-iters 1 --warmup-iters 1",
    ));
    args
}

/// `trainer train --init-from model --data sft --data-path data` with `extra` flags, in `cwd`.
fn train(cwd: &Path, model: &str, data: &str, extra: &[&str]) -> std::process::Output {
    let mut args = sft_args(model, data, "64", "3");
    args.extend_from_slice(&["--out-dir", "runs/sft"]);
    args.extend_from_slice(extra);
    run_cli(&args, cwd)
}

/// Runs `train` on `data` (written to `chats.jsonl`), expecting exit status 1; the output.
fn refused(cwd: &Path, model: &str, data: &str) -> String {
    fs::write(cwd.join("chats.jsonl"), data).unwrap();
    common::refusal_text(&train(cwd, model, "chats.jsonl", &[]))
}

const USER_ASSISTANT: &str =
    r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#;

#[test]
fn bad_records_are_named_by_line() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let model = model_dir(&cwd.join("model"), "qwen2_5");
    let ok = r#"{"text": "First Citizen"}"#;

    let text = refused(cwd, &model, &format!("{ok}\n{ok}\n{{not json\n"));
    common::assert_mentions(&text, &["chats.jsonl:3", "not JSON"]);

    let narrator =
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}]}"#;
    let text = refused(cwd, &model, &format!("{ok}\n{narrator}\n"));
    common::assert_mentions(&text, &["chats.jsonl:2", "\"narrator\"", "message 1"]);

    let text = refused(cwd, &model, "");
    common::assert_mentions(&text, &["chats.jsonl", "empty"]);
    let text = refused(cwd, &model, "\n  \n");
    common::assert_mentions(&text, &["chats.jsonl", "no records"]);
}

#[test]
fn template_failures_name_the_template_and_the_record() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let dir = cwd.join("model");
    let model = model_dir(&dir, "qwen2_5");

    // The template's own error (raise_exception), on the record at line 3.
    set_template(
        &dir,
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system') }}{% endif %}\
         {% for m in messages %}{{ m.content }}{% endfor %}",
    );
    let sys = r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#;
    let text = refused(cwd, &model, &format!("{sys}\n{sys}\n{USER_ASSISTANT}\n"));
    common::assert_mentions(
        &text,
        &["chats.jsonl:3", "tokenizer_config.json", "no system"],
    );

    // An error only rendering finds (an unknown filter), likewise.
    set_template(
        &dir,
        "{% for m in messages %}{{ m.content | shout }}{% endfor %}",
    );
    let text = refused(
        cwd,
        &model,
        &format!("{USER_ASSISTANT}\n{USER_ASSISTANT}\n"),
    );
    common::assert_mentions(&text, &["chats.jsonl:1", "tokenizer_config.json", "shout"]);

    // A template that rewrites earlier turns once a later one exists: the prefix rendered up
    // to the assistant message is not a prefix of the whole; the message is named.
    set_template(
        &dir,
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.role }}: {{ m.content }}\n\
         {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
    );
    let text = refused(
        cwd,
        &model,
        &format!("{USER_ASSISTANT}\n{USER_ASSISTANT}\n"),
    );
    common::assert_mentions(
        &text,
        &["chats.jsonl:1", "assistant message 1", "not a prefix"],
    );

    // A syntax error in chat_template.jinja (which takes priority over the config's): named
    // with the file as soon as the template is read, before any record.
    fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }}",
    )
    .unwrap();
    let text = refused(
        cwd,
        &model,
        &format!("{USER_ASSISTANT}\n{USER_ASSISTANT}\n"),
    );
    common::assert_mentions(&text, &["chat_template.jinja", "does not compile"]);
}

/// The banner's data line for `data` as the library describes it: examples, tokens and
/// counted targets of the records encoded with the model's tokenizer and template.
fn expected_counts(model: &Path, data: &str) -> (usize, usize, usize) {
    let enc = SftEncoder::open(&model.join("tokenizer.json")).unwrap();
    let recs = parse_records(data, Path::new("chats.jsonl")).unwrap();
    let examples: Vec<_> = recs
        .iter()
        .map(|r| enc.encode_record(&r.record).unwrap())
        .collect();
    (
        examples.len(),
        examples.iter().map(|e| e.tokens.len()).sum(),
        examples.iter().map(|e| e.counted_targets()).sum(),
    )
}

fn smoke(style: &str, packing: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let dir = cwd.join("model");
    let model = model_dir(&dir, style);
    let data = chats(style);
    fs::write(cwd.join("chats.jsonl"), &data).unwrap();
    let o = train(cwd, &model, "chats.jsonl", &["--packing", packing]);
    let text = output_text(&o);
    assert!(o.status.success(), "{style}, packing {packing}: {text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("data: "))
        .unwrap_or_else(|| panic!("no data line: {text}"));
    let (n, tokens, counted) = expected_counts(&dir, &data);
    assert_eq!(n, 8, "five conversations and three SFT cases");
    let template = if dir.join("chat_template.jinja").is_file() {
        "chat_template.jinja"
    } else {
        "tokenizer_config.json"
    };
    for want in [
        "data: chats.jsonl: 8 examples (messages, text, prompt/completion, \
         conversational prompt/completion)"
            .to_string(),
        format!("{tokens} tokens, {counted} counted targets, 7 train / 1 val examples"),
        format!("chat template {}", dir.join(template).display()),
        if packing == "true" {
            "packed"
        } else {
            "padded"
        }
        .to_string(),
    ] {
        assert!(line.contains(&want), "{style}: {want:?} not in {line:?}");
    }
    let metrics = fs::read_to_string(cwd.join("runs/sft/metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() >= 3, "{metrics}");
    assert!(cwd.join("runs/sft/checkpoints").is_dir());
}

#[test]
fn a_tiny_llama_trains_on_packed_chats() {
    smoke("llama3_training", "true");
}

#[test]
fn a_tiny_llama_trains_on_padded_chats() {
    smoke("smollm2", "false");
}

/// `trainer train` on `data` (written to `long.jsonl`) with blocks of `block` tokens.
fn train_block(cwd: &Path, model: &str, data: &str, block: &str) -> std::process::Output {
    fs::write(cwd.join("long.jsonl"), data).unwrap();
    let _ = fs::remove_dir_all(cwd.join("runs"));
    let mut args = sft_args(model, "long.jsonl", block, "2");
    args.extend_from_slice(&["--out-dir", "runs/long"]);
    run_cli(&args, cwd)
}

#[test]
fn records_whose_targets_are_all_cut_off_by_the_block_are_refused_or_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let model = model_dir(&cwd.join("model"), "qwen2_5");
    let long_prompt = "First Citizen ".repeat(30);
    let long = json!({ "prompt": long_prompt, "completion": "yo" }).to_string();
    let short = json!({ "prompt": "hi", "completion": "yo" }).to_string();

    // Every record's answer lies beyond the block: no target is left to train on.
    let o = train_block(cwd, &model, &format!("{long}\n{long}\n{long}\n"), "8");
    let text = common::refusal_text(&o);
    common::assert_mentions(
        &text,
        &[
            "long.jsonl",
            "3 of 3 records keep no target",
            "block_size + 1 = 9",
            "line 1, 2, 3",
            "--block-size",
        ],
    );

    // Some keep theirs: the others are reported by line, and training goes on.
    let data = format!("{short}\n{long}\n{short}\n{short}\n{long}\n{short}\n");
    let o = train_block(cwd, &model, &data, "8");
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    common::assert_mentions(&text, &["2 of 6 records keep no target", "line 2, 5"]);

    // A block that holds them all says nothing.
    let o = train_block(cwd, &model, &data, "512");
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    assert!(!text.contains("keep no target"), "{text}");
}
