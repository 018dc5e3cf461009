//! `trainer prepare`: token shards from text, JSONL and SFT records; determinism across
//! thread counts, resumption after a kill, the validation split, refusals.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use trainer::data::sft::{parse_records, SftEncoder};
use trainer::data::shards::format::{self, open_shard, Expect};
use trainer::data::shards::{prepare, InputFormat, Manifest, PrepareOptions, VocabSpec};
use trainer::data::Split;

const WORDS: [&str; 12] = [
    "<unk>",
    "<|endoftext|>",
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "queen",
    "good",
    "night",
    "prince",
];

/// A word-level tokenizer.json (EOS `<|endoftext|>` = id 1) in `dir`.
fn tokenizer(dir: &Path) -> PathBuf {
    let p = dir.join("tokenizer.json");
    trainer::pretrained::word_level(&WORDS, &["<|endoftext|>"])
        .unwrap()
        .save(&p, false)
        .unwrap();
    p
}

/// Document `i`: a few words, different for different `i` (its first word encodes `i`).
fn doc(i: usize) -> String {
    let w = |k: usize| WORDS[2 + k % 10];
    let mut s = format!("{} {} {}", w(i), w(i / 10), w(i / 100));
    for k in 0..(i % 7) {
        s.push(' ');
        s.push_str(w(i + k));
    }
    s
}

fn jsonl(path: &Path, n: usize) {
    let text: String = (0..n)
        .map(|i| serde_json::json!({ "text": doc(i), "id": i }).to_string() + "\n")
        .collect();
    std::fs::write(path, text).unwrap();
}

fn opts(inputs: Vec<PathBuf>, out: &Path, tok: &Path) -> PrepareOptions {
    PrepareOptions {
        inputs,
        out_dir: out.to_path_buf(),
        format: InputFormat::Jsonl,
        vocab: VocabSpec::Tokenizer(tok.to_path_buf()),
        shard_tokens: 1000,
        chunk_bytes: 512,
        ..PrepareOptions::default()
    }
}

/// A tokenizer and `a.jsonl` of `records` records in `tmp`, and options that prepare them
/// into `tmp/out` holding `val_fraction` of the documents out.
fn jsonl_opts(tmp: &Path, records: usize, out: &str, val_fraction: f64) -> PrepareOptions {
    let tok = tokenizer(tmp);
    let data = tmp.join("a.jsonl");
    jsonl(&data, records);
    PrepareOptions {
        val_fraction,
        ..opts(vec![data], &tmp.join(out), &tok)
    }
}

/// Every file of a prepared directory, by name, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// The documents of a split: token lists cut at the document starts (a document continuing
/// across shards is joined).
fn docs(dir: &Path, m: &Manifest, split: Split) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for e in m.shards(split) {
        let s = open_shard(&dir.join(&e.file), &m.expect()).unwrap();
        s.verify().unwrap();
        let starts: BTreeSet<u64> = s.doc_starts().collect();
        for (i, t) in s.tokens().into_iter().enumerate() {
            if starts.contains(&(i as u64)) || out.is_empty() {
                out.push(Vec::new());
            }
            out.last_mut().unwrap().push(t);
        }
    }
    out
}

#[test]
fn jsonl_documents_end_with_eos_and_val_is_disjoint_by_documents() {
    let tmp = tempfile::tempdir().unwrap();
    let o = jsonl_opts(tmp.path(), 2000, "out", 0.1);
    let out = o.out_dir.clone();
    let s = prepare(&o, &|_| {}).unwrap();
    let m = &s.manifest;
    assert_eq!(
        (m.width, m.eos_id, m.docs, m.mask),
        (2, Some(1), true, false)
    );
    assert!(m.train.len() > 3 && !m.val.is_empty(), "{m:?}");
    assert!(m.train[..m.train.len() - 1]
        .iter()
        .all(|e| e.tokens == 1000));
    let tok = tmp.path().join("tokenizer.json");
    let enc = trainer::pretrained::TokenizerFile::open(&tok).unwrap();
    let expected: Vec<Vec<u32>> = (0..2000)
        .map(|i| {
            let mut t = enc.encode(&doc(i)).unwrap();
            t.push(1);
            t
        })
        .collect();
    let train = docs(&out, m, Split::Train);
    let val = docs(&out, m, Split::Val);
    assert_eq!(train.len() + val.len(), 2000);
    assert!(train.iter().chain(&val).all(|d| d.last() == Some(&1)));
    // Every document lands whole in exactly one split, in order.
    let (mut ti, mut vi) = (0, 0);
    for e in &expected {
        if train.get(ti) == Some(e) {
            ti += 1;
        } else {
            assert_eq!(val.get(vi), Some(e));
            vi += 1;
        }
    }
    assert!(
        (100..300).contains(&val.len()),
        "{} val documents",
        val.len()
    );
    // A second call finds the directory up to date.
    let again = prepare(&o, &|_| {}).unwrap();
    assert!(again.up_to_date);
}

#[test]
fn one_thread_and_two_give_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let (a, b) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    jsonl(&a, 1500);
    jsonl(&b, 700);
    let mut outs = Vec::new();
    for threads in [1, 2] {
        let out = tmp.path().join(format!("out{threads}"));
        let o = PrepareOptions {
            threads,
            val_fraction: 0.2,
            ..opts(vec![a.clone(), b.clone()], &out, &tok)
        };
        prepare(&o, &|_| {}).unwrap();
        outs.push(files(&out));
    }
    assert_eq!(outs[0], outs[1]);
}

#[test]
fn a_crash_mid_way_and_a_rerun_give_the_same_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let o = jsonl_opts(tmp.path(), 3000, "clean", 0.15);
    let clean = o.out_dir.clone();
    prepare(&o, &|_| {}).unwrap();
    for crash_after in [1, 4, 9] {
        let out = tmp.path().join(format!("crash{crash_after}"));
        let o = PrepareOptions {
            out_dir: out.clone(),
            threads: 2,
            ..o.clone()
        };
        // Killed after `crash_after` shards: nothing is cleaned up.
        let (done, total) = common::shards::prepare_killed(&o, crash_after);
        assert!(!out.join(format::MANIFEST_FILE).exists());
        // A half-written shard from the kill is redone.
        std::fs::write(out.join(".train-00099.tok.tmp-1-0"), b"half").unwrap();
        let s = prepare(&o, &|_| {}).unwrap();
        assert!(s.resumed_shards >= crash_after, "{}", s.resumed_shards);
        // With a validation split too, the rerun starts where the kill stopped it.
        assert!(done > 0 && done < total, "{done} of {total}");
        assert_eq!(s.bytes_read, total - done, "crash after {crash_after}");
        assert_eq!(files(&out), files(&clean), "crash after {crash_after}");
    }
}

#[test]
fn killing_the_cli_and_rerunning_it_gives_the_same_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let data = tmp.path().join("big.jsonl");
    jsonl(&data, 200_000);
    let run = |out: &Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_trainer"));
        c.args([
            "prepare",
            "--quiet",
            "--shard-tokens",
            "20000",
            "--val-fraction",
            "0.1",
        ])
        .args(["--chunk-bytes", "4096", "--threads", "2", "--tokenizer"])
        .arg(&tok)
        .arg("--out-dir")
        .arg(out)
        .arg(&data)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        c
    };
    let out = tmp.path().join("killed");
    let mut child = run(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !out.join("progress.json").exists() && t0.elapsed() < Duration::from_secs(60) {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let killed_mid_way = !out.join(format::MANIFEST_FILE).exists();
    let resumable = out.join("progress.json").exists();
    let o = run(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let made = |o: &std::process::Output| -> u64 {
        let stdout = String::from_utf8_lossy(&o.stdout);
        let line = stdout.lines().find(|l| l.starts_with("speed")).unwrap();
        let (_, rest) = line.split_once('(').unwrap();
        rest.split(' ').next().unwrap().parse().unwrap()
    };
    let rerun = o;
    if killed_mid_way && resumable {
        let stdout = String::from_utf8_lossy(&rerun.stdout);
        assert!(stdout.contains("finished shards kept"), "{stdout}");
    }
    let clean = tmp.path().join("clean");
    let o = run(&clean).output().unwrap();
    assert!(o.status.success());
    if killed_mid_way && resumable {
        // The rerun continued where the kill stopped it (a validation split included).
        assert!(made(&rerun) < made(&o), "{} of {}", made(&rerun), made(&o));
    }
    assert_eq!(files(&out), files(&clean));
    if !killed_mid_way {
        eprintln!("note: the child finished before it could be killed");
    }
}

#[test]
fn a_missing_field_names_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let data = tmp.path().join("bad.jsonl");
    std::fs::write(&data, "{\"text\": \"the king\"}\n\n{\"body\": \"x\"}\n").unwrap();
    let err = prepare(&opts(vec![data], &tmp.path().join("o"), &tok), &|_| {})
        .unwrap_err()
        .to_string();
    common::assert_mentions(&err, &["bad.jsonl:3", "`text`"]);
}

#[test]
fn text_files_directories_and_globs_char_and_byte() {
    let (tmp, dir) =
        common::temp_files("texts", &[("b.txt", "hello\nworld\n"), ("a.txt", "abc\n")]);
    for (input, vocab) in [
        (dir.clone(), VocabSpec::Char),
        (dir.join("*.txt"), VocabSpec::Byte),
    ] {
        let out = tmp.path().join(format!("o{vocab:?}"));
        let o = PrepareOptions {
            inputs: vec![input],
            out_dir: out.clone(),
            vocab: vocab.clone(),
            shard_tokens: 5,
            ..PrepareOptions::default()
        };
        let m = prepare(&o, &|_| {}).unwrap().manifest;
        assert_eq!(m.eos_id, None);
        let d = docs(&out, &m, Split::Train);
        // Files in sorted order, one document each.
        assert_eq!(d.len(), 2);
        let back = |t: &[u32]| -> String {
            match vocab {
                VocabSpec::Byte => t.iter().map(|&b| b as u8 as char).collect(),
                _ => {
                    let chars: Vec<char> = m.tokenizer.chars.as_ref().unwrap().chars().collect();
                    t.iter().map(|&i| chars[i as usize]).collect()
                }
            }
        };
        assert_eq!(back(&d[0]), "abc\n");
        assert_eq!(back(&d[1]), "hello\nworld\n");
    }
}

#[test]
fn tampered_shards_are_refused_naming_the_file_and_redone_by_prepare() {
    let tmp = tempfile::tempdir().unwrap();
    let o = jsonl_opts(tmp.path(), 500, "out", 0.0);
    let out = o.out_dir.clone();
    let m = prepare(&o, &|_| {}).unwrap().manifest;
    let good = files(&out);
    let p = out.join(&m.train[1].file);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&p, &bytes).unwrap();
    let err = format::verify(&p, &m.expect()).unwrap_err().to_string();
    common::assert_mentions(&err, &["train-00001.tok", "checksum"]);
    std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
    let err = format::verify(&p, &m.expect()).unwrap_err().to_string();
    common::assert_mentions(&err, &["train-00001.tok", "truncated"]);
    let other = Expect {
        vocab: Some(m.vocab_hash().unwrap() ^ 1),
        width: None,
    };
    let err = format::verify(&out.join(&m.train[0].file), &other)
        .unwrap_err()
        .to_string();
    common::assert_mentions(&err, &["train-00000.tok", "vocabulary"]);
    // Rerunning prepare notices and rebuilds.
    let s = prepare(&o, &|_| {}).unwrap();
    assert!(!s.up_to_date);
    assert_eq!(files(&out), good);
    // Other settings in the same directory are refused.
    let o2 = PrepareOptions {
        shard_tokens: 999,
        ..o
    };
    let err = prepare(&o2, &|_| {}).unwrap_err().to_string();
    assert!(err.contains("--overwrite"), "{err}");
}

#[test]
fn sft_shards_carry_the_encoders_masks() {
    let tmp = tempfile::tempdir().unwrap();
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/qwen2_5");
    let lines = [
        r#"{"messages": [{"role": "user", "content": "the king"}, {"role": "assistant", "content": "is dead"}]}"#,
        r#"{"prompt": "long live", "completion": " the queen"}"#,
        r#"{"prompt": [{"role": "user", "content": "good"}], "completion": [{"role": "assistant", "content": "night"}]}"#,
        r#"{"text": "sweet prince"}"#,
    ];
    let text = (lines.join("\n") + "\n").repeat(5);
    let data = tmp.path().join("sft.jsonl");
    std::fs::write(&data, &text).unwrap();
    let out = tmp.path().join("out");
    let o = PrepareOptions {
        inputs: vec![data.clone()],
        out_dir: out.clone(),
        format: InputFormat::Sft,
        vocab: VocabSpec::Tokenizer(chat.join("tokenizer.json")),
        shard_tokens: 37,
        chunk_bytes: 64,
        ..PrepareOptions::default()
    };
    let m = prepare(&o, &|_| {}).unwrap().manifest;
    assert!(m.mask && m.docs && m.eos_id.is_none());
    let enc = SftEncoder::open(&chat.join("tokenizer.json")).unwrap();
    let mut tokens = Vec::new();
    let mut counted = Vec::new();
    let mut starts = Vec::new();
    for r in parse_records(&text, &data).unwrap() {
        let ex = enc.encode_record(&r.record).unwrap();
        starts.push(tokens.len() as u64);
        tokens.extend(ex.tokens);
        counted.extend(ex.counted);
    }
    let (mut got_t, mut got_c, mut got_s) = (Vec::new(), Vec::new(), Vec::new());
    for e in &m.train {
        let s = open_shard(&out.join(&e.file), &m.expect()).unwrap();
        s.verify().unwrap();
        let base = got_t.len() as u64;
        got_s.extend(s.doc_starts().map(|d| d + base));
        s.read_counted(0, s.len(), &mut got_c);
        got_t.extend(s.tokens());
    }
    assert!(m.train.len() > 1);
    assert_eq!(got_t, tokens);
    assert_eq!(got_c, counted);
    assert_eq!(got_s, starts);
    assert!(counted.contains(&false) && counted.contains(&true));
}

#[test]
fn the_format_is_detected_from_the_files_a_directory_holds() {
    let files = [
        ("a.jsonl", "{\"text\": \"x\"}\n"),
        ("b.json", "{\"text\": \"y\"}\n"),
    ];
    let (tmp, dir) = common::temp_files("corpus", &files);
    assert_eq!(
        InputFormat::detect(std::slice::from_ref(&dir)).unwrap(),
        InputFormat::Jsonl
    );
    std::fs::write(dir.join("c.txt"), "plain").unwrap();
    assert_eq!(
        InputFormat::detect(std::slice::from_ref(&dir)).unwrap(),
        InputFormat::Text
    );
    let glob = dir.join("*.jsonl");
    assert_eq!(InputFormat::detect(&[glob]).unwrap(), InputFormat::Jsonl);
    let e = InputFormat::detect(&[tmp.path().join("none")]).unwrap_err();
    assert!(e.to_string().contains("none"), "{e}");
}

#[test]
fn verify_reads_every_shard_back_and_names_each_bad_one() {
    let tmp = tempfile::tempdir().unwrap();
    let o = jsonl_opts(tmp.path(), 800, "out", 0.2);
    let out = o.out_dir.clone();
    let m = prepare(&o, &|_| {}).unwrap().manifest;
    assert!(m.train.len() >= 2 && !m.val.is_empty());
    let verify = || {
        Command::new(env!("CARGO_BIN_EXE_trainer"))
            .arg("prepare")
            .arg("--verify")
            .arg(&out)
            .output()
            .unwrap()
    };
    let o = verify();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        text.matches("ok ").count(),
        m.train.len() + m.val.len(),
        "{text}"
    );
    // A flipped byte in a train shard's body, a val shard listed with another token count.
    let p = out.join(&m.train[1].file);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[format::HEADER_LEN + 7] ^= 0x10;
    std::fs::write(&p, &bytes).unwrap();
    let mut manifest = m.clone();
    manifest.val[0].tokens += 1;
    manifest.write(&out).unwrap();
    let o = verify();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("BAD         train-00001.tok: corrupt"),
        "{text}"
    );
    common::assert_mentions(&text, &["BAD         val-00000.tok:", "the manifest lists"]);
    assert!(text.contains("2 of"), "{text}");
    assert!(text.contains("ok          train-00000.tok"), "{text}");
}

/// Sets the modification time of `path` an hour later: a `touch`.
fn touch(path: &Path) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    let t = f.metadata().unwrap().modified().unwrap() + Duration::from_secs(3600);
    f.set_modified(t).unwrap();
}

#[test]
fn a_touch_changes_nothing_and_a_refusal_says_what_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let o = jsonl_opts(tmp.path(), 500, "out", 0.1);
    let (out, data) = (o.out_dir.clone(), o.inputs[0].clone());
    prepare(&o, &|_| {}).unwrap();
    let good = files(&out);
    // Same bytes, new time: up to date, nothing redone.
    touch(&data);
    let s = prepare(&o, &|_| {}).unwrap();
    assert!(s.up_to_date);
    assert_eq!(
        files(&out)[1..],
        good[1..],
        "only the manifest's record of the time changes"
    );
    // An interrupted run resumes after a touch too.
    let again = tmp.path().join("again");
    let o2 = PrepareOptions {
        out_dir: again.clone(),
        ..o.clone()
    };
    common::shards::prepare_killed(&o2, 2);
    touch(&data);
    let s = prepare(&o2, &|_| {}).unwrap();
    assert!(s.resumed_shards >= 2, "{}", s.resumed_shards);
    assert_eq!(files(&again)[1..], files(&out)[1..]);
    // Another byte of the same size, more bytes, another setting: refused, saying which.
    let text = std::fs::read_to_string(&data).unwrap();
    std::fs::write(&data, text.replacen("king", "kong", 1)).unwrap();
    let err = prepare(&o, &|_| {}).unwrap_err().to_string();
    let name = data.display().to_string();
    assert!(
        err.contains(&format!("input {name} changed content (same")),
        "{err}"
    );
    std::fs::write(&data, text.clone() + "\n").unwrap();
    let err = prepare(&o, &|_| {}).unwrap_err().to_string();
    let size = text.len();
    assert!(
        err.contains(&format!(
            "input {name} changed size ({size} -> {} bytes)",
            size + 1
        )),
        "{err}"
    );
    std::fs::write(&data, &text).unwrap();
    let o3 = PrepareOptions {
        shard_tokens: 999,
        ..o.clone()
    };
    let err = prepare(&o3, &|_| {}).unwrap_err().to_string();
    assert!(
        err.contains("setting shard_tokens changed (1000 -> 999)"),
        "{err}"
    );
    assert!(err.contains("--overwrite"), "{err}");
    // The original bytes are up to date again.
    assert!(prepare(&o, &|_| {}).unwrap().up_to_date);
}

#[test]
fn an_overlong_json_line_is_refused_naming_file_line_and_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let data = tmp.path().join("a.jsonl");
    let line = |words: usize| {
        serde_json::json!({ "text": vec!["king"; words].join(" ") }).to_string() + "\n"
    };
    // Lines 1-3 short, line 4 about 1.5 MB; one more short line after it.
    let text = line(3) + &line(5) + &line(2) + &line(300_000) + &line(4);
    std::fs::write(&data, &text).unwrap();
    let limit = 1 << 20;
    let o = PrepareOptions {
        max_line_bytes: limit,
        ..opts(vec![data.clone()], &tmp.path().join("out"), &tok)
    };
    for format in [InputFormat::Jsonl, InputFormat::Sft] {
        let o = PrepareOptions {
            format,
            vocab: VocabSpec::Tokenizer(tok.clone()),
            ..o.clone()
        };
        let err = prepare(&o, &|_| {}).unwrap_err().to_string();
        let at = format!("{}:4", data.display());
        assert!(err.contains(&at), "{format:?}: {err}");
        assert!(err.contains(&format!("longer than {limit} bytes")), "{err}");
    }
    // With the limit above the line, it is read.
    let o = PrepareOptions {
        max_line_bytes: 2 << 20,
        ..o
    };
    prepare(&o, &|_| {}).unwrap();
    // SFT training's reader: the same bound (the default), before the line is read whole.
    let sft = tmp.path().join("chat.jsonl");
    let record = |n: usize| {
        serde_json::json!({ "prompt": "the king", "completion": "x".repeat(n) }).to_string() + "\n"
    };
    let big = trainer::data::lines::MAX_LINE_BYTES + 10;
    std::fs::write(&sft, record(5) + "\n" + &record(big)).unwrap();
    let err = trainer::data::sft::read_records(&sft)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("{}:3", sft.display())), "{err}");
    assert!(
        err.contains(&format!("longer than {} bytes", 4 << 20)),
        "{err}"
    );
}
