//! `trainer prepare` from Parquet files: the same shards as from the same records as JSON lines
//! (a text column, a `--field` column, SFT chats as list<struct<role, content>>, prompt and
//! completion columns), on every vocabulary; a run killed mid-file and rerun equals one run;
//! errors name the file, the column and the row. The fixtures and their JSONL twins are made
//! by scripts/python/make_parquet_fixtures.py (pyarrow, several row groups each).
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use trainer::data::shards::prepare::PROGRESS_FILE;
use trainer::data::shards::{prepare, Container, InputFormat, Manifest, PrepareOptions, VocabSpec};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/parquet")
        .join(name)
}

/// Qwen2.5's tokenizer (byte-level BPE, EOS `<|im_end|>`) and its chat template.
fn qwen() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/qwen2_5/tokenizer.json")
}

fn opts(input: &Path, out: &Path, format: InputFormat, vocab: VocabSpec) -> PrepareOptions {
    PrepareOptions {
        inputs: vec![input.to_path_buf()],
        out_dir: out.to_path_buf(),
        format,
        vocab,
        shard_tokens: 40,
        val_fraction: 0.2,
        chunk_bytes: 24,
        threads: 2,
        ..PrepareOptions::default()
    }
}

/// The shard files of a prepared directory, by name, with their bytes.
fn shards(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tok"))
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// Prepares `o`, and its twin: the same options on `twin` (JSON lines, `format` for records).
fn both(o: &PrepareOptions, twin: &Path, format: InputFormat) -> (Manifest, Manifest) {
    let a = prepare(o, &|_| {}).unwrap().manifest;
    let t = PrepareOptions {
        inputs: vec![twin.to_path_buf()],
        out_dir: o.out_dir.with_extension("twin"),
        format,
        ..o.clone()
    };
    let b = prepare(&t, &|_| {}).unwrap().manifest;
    assert!(a.train.len() > 2 && !a.val.is_empty(), "{a:?}");
    assert_eq!(shards(&o.out_dir), shards(&t.out_dir), "{o:?}");
    (a, b)
}

#[test]
fn text_and_field_columns_give_the_shards_of_their_jsonl_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let (pq, twin) = (fixture("text.parquet"), fixture("text.jsonl"));
    // The text column with a tokenizer (EOS after each row), another column with a char
    // vocabulary (an extra pass over the rows), and `--format text` (a document a row) with
    // bytes.
    let cases = [
        (InputFormat::Jsonl, "text", VocabSpec::Tokenizer(qwen())),
        (InputFormat::Jsonl, "body", VocabSpec::Char),
        (InputFormat::Text, "text", VocabSpec::Byte),
    ];
    for (i, (format, field, vocab)) in cases.into_iter().enumerate() {
        let o = PrepareOptions {
            field: field.into(),
            ..opts(&pq, &tmp.path().join(format!("out{i}")), format, vocab)
        };
        let (a, b) = both(&o, &twin, InputFormat::Jsonl);
        assert_eq!(a.tokenizer, b.tokenizer);
        assert_eq!(a.eos_id, b.eos_id);
    }
}

#[test]
fn sft_columns_give_the_shards_of_their_jsonl_twin() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["chat", "prompt_completion"] {
        let pq = fixture(&format!("{name}.parquet"));
        let twin = fixture(&format!("{name}.jsonl"));
        let out = tmp.path().join(name);
        let o = opts(&pq, &out, InputFormat::Sft, VocabSpec::Tokenizer(qwen()));
        let (a, _) = both(&o, &twin, InputFormat::Sft);
        assert!(a.mask, "{name}");
    }
}

#[test]
fn a_run_killed_mid_file_and_rerun_gives_the_shards_of_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    let pq = fixture("text.parquet");
    let clean = tmp.path().join("clean");
    let o = opts(
        &pq,
        &clean,
        InputFormat::Jsonl,
        VocabSpec::Tokenizer(qwen()),
    );
    let all = prepare(&o, &|_| {}).unwrap().manifest;
    assert!(all.train.len() + all.val.len() > 6, "{all:?}");
    let mut inside_a_group = false;
    for crash_after in [1, 3, 5] {
        let out = tmp.path().join(format!("crash{crash_after}"));
        let o = PrepareOptions {
            out_dir: out.clone(),
            ..o.clone()
        };
        // Killed after `crash_after` shards: nothing is cleaned up.
        let (done, total) = common::shards::prepare_killed(&o, crash_after);
        let progress: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join(PROGRESS_FILE)).unwrap()).unwrap();
        // `line` is 1 + the row of the file; the row groups hold 6 rows.
        let row = progress["resume"]["line"].as_u64().unwrap() - 1;
        assert!(row > 0 && row < 40, "{progress}");
        inside_a_group |= !row.is_multiple_of(6);
        let s = prepare(&o, &|_| {}).unwrap();
        assert!(s.resumed_shards >= crash_after, "{}", s.resumed_shards);
        assert_eq!(s.bytes_read, total - done, "crash after {crash_after}");
        assert_eq!(shards(&out), shards(&clean), "crash after {crash_after}");
        assert_eq!(
            std::fs::read(out.join("manifest.json")).unwrap(),
            std::fs::read(clean.join("manifest.json")).unwrap()
        );
    }
    assert!(
        inside_a_group,
        "no kill left a resume point inside a row group"
    );
}

fn error(o: &PrepareOptions) -> String {
    prepare(o, &|_| {}).unwrap_err().to_string()
}

#[test]
fn errors_name_the_file_the_column_and_the_row() {
    let (_tmp, out) = common::temp_join("out");
    let byte = |name: &str, field: &str| PrepareOptions {
        field: field.into(),
        ..opts(&fixture(name), &out, InputFormat::Jsonl, VocabSpec::Byte)
    };
    let e = error(&byte("text.parquet", "txt"));
    common::assert_mentions(&e, &["text.parquet", "no column `txt`", "id, text, body"]);
    let e = error(&byte("wrong_type.parquet", "text"));
    common::assert_mentions(&e, &["wrong_type.parquet", "`text` is INT64"]);
    let e = error(&byte("null.parquet", "text"));
    assert!(
        e.contains("null.parquet (row group 1, row 2; row 6 of the file")
            && e.contains("`text` is null"),
        "{e}"
    );
    // SFT records: a wrong type is named by the record reader, with the row.
    let o = opts(
        &fixture("wrong_type.parquet"),
        &out,
        InputFormat::Sft,
        VocabSpec::Tokenizer(qwen()),
    );
    let e = error(&o);
    assert!(
        e.contains("wrong_type.parquet (row group 0, row 0;")
            && e.contains("`text` must be a string, found number"),
        "{e}"
    );
    let o = PrepareOptions {
        container: Container::Text,
        ..o
    };
    let e = error(&o);
    assert!(
        e.contains("--input-format text cannot hold --format sft"),
        "{e}"
    );
    // A codec this build does not read.
    let e = error(&byte("zstd.parquet", "text"));
    common::assert_mentions(&e, &["zstd.parquet", "zstd", "snappy-compressed"]);
    // A file that is not Parquet, read as Parquet.
    let o = PrepareOptions {
        container: Container::Parquet,
        ..byte("text.jsonl", "text")
    };
    let e = error(&o);
    assert!(e.contains("text.jsonl") && e.contains("Parquet"), "{e}");
}

#[test]
fn the_cli_reads_parquet_by_extension_or_by_input_format() {
    let (tmp, renamed) = common::temp_join("rows.data");
    std::fs::copy(fixture("text.parquet"), &renamed).unwrap();
    let run = |input: &Path, out: &str, extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_trainer"))
            .arg("prepare")
            .arg(input)
            .args(["--vocab", "byte", "--quiet", "--out-dir"])
            .arg(tmp.path().join(out))
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    run(&fixture("text.parquet"), "auto", &[]);
    run(&renamed, "forced", &["--input-format", "parquet"]);
    run(&fixture("text.jsonl"), "twin", &[]);
    let auto = shards(&tmp.path().join("auto"));
    assert_eq!(auto, shards(&tmp.path().join("forced")));
    assert_eq!(auto, shards(&tmp.path().join("twin")));
    let help = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(["prepare", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    common::assert_mentions(&help, &["--input-format", "Parquet"]);
}

#[test]
fn sft_training_reads_a_parquet_file_as_its_jsonl_twin() {
    use trainer::data::{DataKind, DataSource, DataSpec, SftSource};
    for name in ["chat", "prompt_completion"] {
        let spec = DataSpec {
            kind: DataKind::Sft,
            path: Some(fixture(&format!("{name}.parquet"))),
            tokenizer: Some(qwen()),
            ..DataSpec::default()
        };
        let a = SftSource::open(&spec).unwrap();
        let twin = DataSpec {
            path: Some(fixture(&format!("{name}.jsonl"))),
            ..spec.clone()
        };
        let b = SftSource::open(&twin).unwrap();
        assert!(a.len() > 10, "{name}");
        assert_eq!(a.all_examples(), b.all_examples(), "{name}");
        assert_eq!(a.fingerprint(), b.fingerprint(), "{name}");
    }
    let spec = DataSpec {
        kind: DataKind::Sft,
        path: Some(fixture("null.parquet")),
        tokenizer: Some(qwen()),
        ..DataSpec::default()
    };
    let e = SftSource::open(&spec)
        .err()
        .expect("a null record")
        .to_string();
    assert!(
        e.contains("null.parquet (row group 1, row 2;") && e.contains("null here: text"),
        "{e}"
    );
}
