use std::collections::HashSet;

use candle_core::{Device, Tensor};

use super::encoder::counted_from_spans;
use super::layout::{best_fit_decreasing, Layout};
use super::*;
use crate::tokenizer::{word_level, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};
use crate::DataKind;

/// The vocabulary's words, space-separated (id `i` is word `i`, `<unk>` first); the special
/// tokens follow.
const WORDS: &str =
    "<unk> system user assistant be nice hi hello how are you fine plain text a b c d e f g h";

fn words() -> Vec<&'static str> {
    WORDS.split(' ').collect()
}
const SPECIAL: &[&str] = &["<|im_start|>", "<|im_end|>", "<|endoftext|>"];

const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A model directory with a word-level tokenizer, a ChatML template and `<|im_end|>` as EOS.
fn model_dir(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    word_level(&words(), SPECIAL)
        .unwrap()
        .save(dir.path().join(TOKENIZER_FILE), false)
        .unwrap();
    let cfg = serde_json::json!({
        "chat_template": template,
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<|endoftext|>"},
    });
    std::fs::write(
        dir.path().join(TOKENIZER_CONFIG_FILE),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    dir
}

fn encoder(dir: &tempfile::TempDir) -> SftEncoder {
    SftEncoder::open(&dir.path().join(TOKENIZER_FILE)).unwrap()
}

fn id(w: &str) -> u32 {
    words().iter().chain(SPECIAL).position(|x| *x == w).unwrap() as u32
}

fn ids(s: &str) -> Vec<u32> {
    s.split_whitespace().map(id).collect()
}

fn record(json: &str) -> Record {
    parse_records(json, Path::new("r.jsonl")).unwrap()[0]
        .record
        .clone()
}

/// The counted tokens of `ex`, as words.
fn counted_words(ex: &Example) -> Vec<&'static str> {
    let all: Vec<&str> = words().into_iter().chain(SPECIAL.iter().copied()).collect();
    ex.tokens
        .iter()
        .zip(&ex.counted)
        .filter(|(_, &c)| c)
        .map(|(&t, _)| all[t as usize])
        .collect()
}

#[test]
fn conversation_counts_assistant_content_and_end_of_turn_only() {
    let dir = model_dir(CHATML);
    let enc = encoder(&dir);
    let m = vec![
        Message::new(Role::System, "be nice"),
        Message::new(Role::User, "hi"),
        Message::new(Role::Assistant, "hello"),
        Message::new(Role::User, "how are you"),
        Message::new(Role::Assistant, "fine"),
    ];
    let ex = enc.encode_messages(&m).unwrap();
    assert_eq!(
        ex.tokens,
        ids(
            "<|im_start|> system be nice <|im_end|> <|im_start|> user hi <|im_end|> \
             <|im_start|> assistant hello <|im_end|> <|im_start|> user how are you <|im_end|> \
             <|im_start|> assistant fine <|im_end|>"
        )
    );
    assert_eq!(
        counted_words(&ex),
        ["hello", "<|im_end|>", "fine", "<|im_end|>"]
    );
    assert!(enc
        .render(&m[..2], true)
        .unwrap()
        .ends_with("<|im_start|>assistant\n"));
}

#[test]
fn eos_is_appended_to_text_and_completion_only_when_absent() {
    let dir = model_dir(CHATML);
    let enc = encoder(&dir);
    let eos = id("<|im_end|>");
    let ex = enc
        .encode_record(&record(r#"{"text": "plain text"}"#))
        .unwrap();
    assert_eq!(ex.tokens, ids("plain text <|im_end|>"));
    assert!(ex.counted.iter().all(|&c| c));
    let ex = enc
        .encode_record(&record(r#"{"text": "plain text<|im_end|>"}"#))
        .unwrap();
    assert_eq!(ex.tokens.iter().filter(|&&t| t == eos).count(), 1);

    let ex = enc
        .encode_record(&record(r#"{"prompt": "how are", "completion": " you"}"#))
        .unwrap();
    assert_eq!(ex.tokens, ids("how are you <|im_end|>"));
    assert_eq!(ex.counted, [false, false, true, true]);
    let ex = enc
        .encode_record(&record(
            r#"{"prompt": "how are", "completion": " you<|im_end|>"}"#,
        ))
        .unwrap();
    assert_eq!(ex.tokens, ids("how are you <|im_end|>"));
}

#[test]
fn conversational_prompt_completion_counts_the_completion() {
    let dir = model_dir(CHATML);
    let enc = encoder(&dir);
    let ex = enc
        .encode_record(&record(
            r#"{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]}"#,
        ))
        .unwrap();
    // The prompt ends with the generation prompt; no EOS is added (the template ends the turn).
    assert_eq!(
        ex.tokens,
        ids("<|im_start|> user hi <|im_end|> <|im_start|> assistant hello <|im_end|>")
    );
    assert_eq!(counted_words(&ex), ["hello", "<|im_end|>"]);
}

#[test]
fn conversations_without_a_template_are_refused() {
    let dir = model_dir(CHATML);
    std::fs::write(
        dir.path().join(TOKENIZER_CONFIG_FILE),
        r#"{"eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    let enc = encoder(&dir);
    assert!(enc.template().is_none());
    let err = enc
        .encode_record(&record(
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
        ))
        .unwrap_err()
        .to_string();
    assert!(err.contains("chat template"), "{err}");
    assert!(enc.encode_record(&record(r#"{"text": "hi"}"#)).is_ok());
}

#[test]
fn counted_from_spans_follows_the_tokens_that_overlap() {
    let offsets = [(0, 2), (2, 5), (5, 5), (5, 9), (9, 12)];
    assert_eq!(
        counted_from_spans(&offsets, &[3..9, 12..12]),
        [false, true, true, true, false]
    );
    assert_eq!(counted_from_spans(&offsets, &[]), [false; 5]);
}

/// Writes `lines` as a JSONL file next to the model and opens it.
fn source(
    dir: &tempfile::TempDir,
    lines: &[String],
    f: impl FnOnce(&mut DataSpec),
) -> Result<SftSource> {
    let path = dir.path().join("data.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    let mut spec = DataSpec {
        kind: DataKind::Sft,
        path: Some(path),
        tokenizer: Some(dir.path().join(TOKENIZER_FILE)),
        val_fraction: 0.25,
        ..DataSpec::default()
    };
    f(&mut spec);
    SftSource::open(&spec)
}

/// `n` prompt/completion records of varying lengths.
fn lines(n: usize) -> Vec<String> {
    let letters = ["a", "b", "c", "d", "e", "f", "g", "h"];
    (0..n)
        .map(|i| {
            let prompt = letters[..1 + i % 3].join(" ");
            let completion = letters[..1 + (i * 5) % 7].join(" ");
            format!(r#"{{"prompt": "{prompt}", "completion": " {completion}"}}"#)
        })
        .collect()
}

fn layout_of(b: &Batch) -> Layout {
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    Layout {
        x: flat(&b.x),
        y: flat(&b.y),
        mask: b
            .mask
            .as_ref()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap(),
        positions: b.rows.positions.as_ref().map(flat),
        doc_ids: b.rows.doc_ids.as_ref().map(flat),
    }
}

#[test]
fn val_split_is_non_empty_disjoint_and_seeded() {
    let dir = model_dir(CHATML);
    let src = source(&dir, &lines(20), |_| {}).unwrap();
    assert_eq!((src.train.len(), src.val.len()), (15, 5));
    let train: HashSet<_> = src.train.iter().collect();
    assert!(src.val.iter().all(|i| !train.contains(i)));
    let again = source(&dir, &lines(20), |_| {}).unwrap();
    assert_eq!(again.val, src.val);
    let other = source(&dir, &lines(20), |s| s.seed = 7).unwrap();
    assert_ne!(other.val, src.val);
    // Two examples: one each, whatever the fraction.
    let two = source(&dir, &lines(2), |s| s.val_fraction = 0.01).unwrap();
    assert_eq!((two.train.len(), two.val.len()), (1, 1));
    let err = source(&dir, &lines(1), |_| {}).err().unwrap().to_string();
    assert!(err.contains("at least 2"), "{err}");
    let d = src.describe();
    assert!(
        d.contains("20 examples") && d.contains("15 train / 5 val"),
        "{d}"
    );
    assert!(d.contains("tokenizer_config.json"), "{d}");
}

#[test]
fn record_errors_name_the_line_and_template_file() {
    let dir = model_dir(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}{{ m.content }}{% endfor %}",
    );
    let mut l = lines(3);
    l.insert(
        1,
        r#"{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]}"#
            .into(),
    );
    let err = source(&dir, &l, |_| {}).err().unwrap().to_string();
    assert!(err.contains("data.jsonl:2"), "{err}");
    assert!(
        err.contains("tokenizer_config.json") && err.contains("no tools here"),
        "{err}"
    );
}

#[test]
fn packed_rows_restart_positions_separate_documents_and_keep_targets_inside() {
    let dir = model_dir(CHATML);
    let src = source(&dir, &lines(30), |_| {}).unwrap();
    let (b, t) = (4, 24);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let batch = src
        .batch(Split::Train, b, t, &mut rng, &Device::Cpu)
        .unwrap();
    assert_eq!(batch.x.dims(), &[b, t]);
    let l = layout_of(&batch);
    let (pos, doc) = (l.positions.clone().unwrap(), l.doc_ids.clone().unwrap());
    let train: Vec<&Example> = src.examples(Split::Train).collect();
    let pad = src.encoder().pad_id();
    let mut filled = 0;
    for r in 0..b {
        let row = r * t..(r + 1) * t;
        let mut seen = HashSet::new();
        let mut j = row.start;
        while j < row.end {
            let d = doc[j];
            assert!(seen.insert(d), "document ids repeat in row {r}");
            let end = (j..row.end).find(|&k| doc[k] != d).unwrap_or(row.end);
            assert_eq!(pos[j..end], (0..(end - j) as u32).collect::<Vec<_>>());
            let mut tokens = l.x[j..end].to_vec();
            tokens.push(l.y[end - 1]);
            if tokens.iter().all(|&x| x == pad) {
                assert_eq!(end, row.end, "padding only at the row end");
                assert!(l.mask[j..end].iter().all(|&m| m == 0.0));
            } else {
                // x ++ last y is one whole example: every target is inside it.
                let ex = train
                    .iter()
                    .find(|e| e.tokens == tokens)
                    .expect("a document is one training example");
                let weights: Vec<f32> = ex.counted[1..]
                    .iter()
                    .map(|&c| f32::from(u8::from(c)))
                    .collect();
                assert_eq!(l.mask[j..end], weights[..]);
                filled += end - j;
            }
            j = end;
        }
    }
    assert!(
        filled * 10 >= b * t * 9,
        "rows are well filled: {filled} of {}",
        b * t
    );
    // The same generator state gives the same batch and leaves the same state.
    let mut rng2 = ChaCha8Rng::seed_from_u64(3);
    let again = src
        .batch(Split::Train, b, t, &mut rng2, &Device::Cpu)
        .unwrap();
    assert_eq!(layout_of(&again), l);
    assert_eq!(rng.random::<u64>(), rng2.random::<u64>());
}

#[test]
fn best_fit_decreasing_places_longest_first_into_the_tightest_row() {
    assert_eq!(
        best_fit_decreasing(&[5, 4, 3, 3, 2, 1], 2, 8),
        vec![vec![0, 2], vec![1, 3, 5]]
    );
    // Too long for every row: left out.
    assert_eq!(best_fit_decreasing(&[9, 2], 1, 8), vec![vec![1]]);
}

#[test]
fn padded_rows_hold_one_example_and_mask_the_padding() {
    let dir = model_dir(CHATML);
    let src = source(&dir, &lines(12), |s| s.packing = false).unwrap();
    let (b, t) = (3, 10);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let batch = src
        .batch(Split::Train, b, t, &mut rng, &Device::Cpu)
        .unwrap();
    assert!(batch.rows.is_empty());
    let l = layout_of(&batch);
    let pad = id("<|endoftext|>");
    assert_eq!(src.encoder().pad_id(), pad);
    for r in 0..b {
        let x = &l.x[r * t..(r + 1) * t];
        let n = x.iter().position(|&v| v == pad).unwrap_or(t);
        let ex = src
            .examples(Split::Train)
            .find(|e| e.tokens.len() == n + 1 && e.tokens[..n] == x[..n])
            .expect("row starts with an example");
        assert_eq!(l.y[r * t..r * t + n], ex.tokens[1..]);
        assert!(l.x[r * t + n..(r + 1) * t].iter().all(|&v| v == pad));
        assert!(l.mask[r * t + n..(r + 1) * t].iter().all(|&m| m == 0.0));
        let w: f32 = l.mask[r * t..r * t + n].iter().sum();
        assert_eq!(w as usize, ex.counted_targets());
    }
}

#[test]
fn long_examples_are_cut_keeping_their_start() {
    let dir = model_dir(CHATML);
    let long = r#"{"text": "a b c d e f g h"}"#.to_string(); // 9 tokens with EOS
    let src = source(&dir, &[long.clone(), long], |s| s.packing = false).unwrap();
    assert_eq!(src.truncated(4), 2);
    assert_eq!(src.truncated(8), 0);
    src.check_block_size(4).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let l = layout_of(&src.batch(Split::Val, 1, 4, &mut rng, &Device::Cpu).unwrap());
    assert_eq!(l.x, ids("a b c d"));
    assert_eq!(l.y, ids("b c d e"));
    let packed = source(
        &dir,
        &vec![r#"{"text": "a b c d e f g h"}"#.into(); 2],
        |_| {},
    )
    .unwrap();
    let l = layout_of(
        &packed
            .batch(Split::Train, 2, 4, &mut rng, &Device::Cpu)
            .unwrap(),
    );
    assert_eq!(l.x, ids("a b c d a b c d"));
    assert_eq!(l.positions.unwrap(), [0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn train_on_everything_counts_every_target_and_changes_the_fingerprint() {
    let dir = model_dir(CHATML);
    let only = source(&dir, &lines(8), |_| {}).unwrap();
    let all = source(&dir, &lines(8), |s| s.completion_only = false).unwrap();
    assert!(all
        .examples(Split::Train)
        .all(|e| e.counted.iter().all(|&c| c)));
    assert!(only
        .examples(Split::Train)
        .any(|e| e.counted.iter().any(|&c| !c)));
    assert_ne!(only.fingerprint().tokens, all.fingerprint().tokens);
    assert_eq!(only.fingerprint().vocab, all.fingerprint().vocab);
    assert_eq!(
        only.fingerprint(),
        source(&dir, &lines(8), |_| {}).unwrap().fingerprint()
    );
    assert_eq!(only.vocab_size(), words().len() + SPECIAL.len());
    assert_eq!(only.encode("a b").unwrap(), ids("a b"));
    assert_eq!(only.decode(&ids("a b")).unwrap(), "a b");
}

#[test]
fn sft_spec_needs_a_path_and_a_tokenizer() {
    let spec = DataSpec {
        kind: DataKind::Sft,
        path: Some("d.jsonl".into()),
        ..DataSpec::default()
    };
    let err = spec.validate().unwrap_err().to_string();
    assert!(err.contains("tokenizer_path"), "{err}");
    let spec = DataSpec {
        kind: DataKind::Sft,
        ..DataSpec::default()
    };
    assert!(spec.validate().unwrap_err().to_string().contains("JSONL"));
    assert_eq!("sft".parse::<DataKind>().unwrap(), DataKind::Sft);
}
