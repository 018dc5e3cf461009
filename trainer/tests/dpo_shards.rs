//! Preference pairs through `trainer prepare --format preference` and DPO's held-out metrics.
//!
//! - The fixtures' records (strings, conversations, implicit prompts; tokenised with Llama 3's
//!   tokenizer and chat template) prepared into shards small enough that pairs continue from
//!   one shard into the next, then `data = shards` over them: the same LoRA DPO run as
//!   `data = preference` over the JSONL, losses, gradient norms and metrics bit for bit, the
//!   evaluations' too.
//! - `--max-length` drops the record whose prompt fills it, counted in prepare's output (the
//!   CLI) and summary; the pairs read back are the JSONL's, token for token; a directory
//!   prepared with a validation split serves that split.
//! - Bad records (no `rejected`, an empty implicit prompt) stop `prepare` naming file:line.
//! - Under `--objective dpo`, evaluations report the loss and TRL's metrics of held-out pairs
//!   (`eval/dpo_loss`, `eval/rewards/accuracies`, ...): at step 0 a fresh adapter is its own
//!   reference (margin 0, loss log 2); the margin rises with training.

mod common;

use std::path::{Path, PathBuf};

use common::dpo::{fixture, lora_dpo_config, write_pairs};
use trainer::config::TrainConfig;
use trainer::data::sft::{read_preferences, Preferences, SftEncoder};
use trainer::data::shards::{prepare, InputFormat, PrepareOptions, PrepareSummary, VocabSpec};
use trainer::data::{DataKind, DataSpec, Split};
use trainer::metrics::{EvalStats, Record};
use trainer::train::Trainer;

fn tokenizer() -> PathBuf {
    fixture("chat/llama3/tokenizer.json")
}

/// `prepare --format preference` of `input` into `out`: shards of 150 tokens (pairs continue
/// from one into the next), units of 300 bytes, 2 threads.
fn pair_options(input: &Path, out: &Path, val: f64, max_length: Option<usize>) -> PrepareOptions {
    PrepareOptions {
        inputs: vec![input.to_path_buf()],
        out_dir: out.to_path_buf(),
        format: InputFormat::Preference,
        vocab: VocabSpec::Tokenizer(tokenizer()),
        shard_tokens: 150,
        val_fraction: val,
        chunk_bytes: 300,
        threads: 2,
        max_length,
        ..PrepareOptions::default()
    }
}

fn prepare_pairs(
    input: &Path,
    out: &Path,
    val: f64,
    max_length: Option<usize>,
) -> trainer::data::Result<PrepareSummary> {
    prepare(&pair_options(input, out, val, max_length), &|_| {})
}

/// `dpo.rs`'s LoRA DPO run, 4 steps, evaluated every 2.
fn run_config(out: &Path, data: DataKind, path: &Path) -> TrainConfig {
    TrainConfig {
        max_iters: 4,
        lr_decay_iters: Some(4),
        eval_interval: 2,
        eval_iters: 2,
        ..lora_dpo_config(out, data, path)
    }
}

fn evals(run: &Path) -> Vec<EvalStats> {
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    log.lines()
        .filter_map(|l| match serde_json::from_str::<Record>(l).unwrap() {
            Record::Eval(e) => Some(e),
            Record::Step(_) => None,
        })
        .collect()
}

#[test]
fn prepared_pairs_train_dpo_as_the_jsonl_does() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = write_pairs(tmp.path());
    let dir = tmp.path().join("shards");
    let summary = prepare_pairs(&jsonl, &dir, 0.0, None).unwrap();
    let m = &summary.manifest;
    assert!(m.pairs && m.train.len() > 2 && m.val.is_empty(), "{m:?}");
    assert_eq!(summary.dropped, 0);

    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let (jsonl_steps, jsonl_end) =
        common::finish(Trainer::new(run_config(&a, DataKind::Preference, &jsonl)).unwrap());
    let (shard_steps, shard_end) =
        common::finish(Trainer::new(run_config(&b, DataKind::Shards, &dir)).unwrap());
    common::assert_same_steps(&jsonl_steps, &shard_steps, "shards vs JSONL");
    for (x, y) in jsonl_steps.iter().zip(&shard_steps) {
        assert_eq!(x.objective, y.objective, "DPO metrics at step {}", x.step);
    }
    assert_eq!(jsonl_end, shard_end, "the same adapters");
    let (ea, eb) = (evals(&a.join("run")), evals(&b.join("run")));
    assert_eq!(ea.len(), 3);
    assert_eq!(ea, eb, "the same evaluations");
}

#[test]
fn prepare_drops_counts_and_keeps_the_pairs_and_the_split() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = write_pairs(tmp.path());
    // the CLI: the dropped record counted in prepare's output
    let out = tmp.path().join("cut");
    let o = common::run_cli(
        &[
            "prepare",
            jsonl.to_str().unwrap(),
            "--format",
            "preference",
            "--tokenizer",
            tokenizer().to_str().unwrap(),
            "--max-length",
            "65",
            "--val-fraction",
            "0.3",
            "--out-dir",
            out.to_str().unwrap(),
            "--quiet",
        ],
        tmp.path(),
    );
    let text = common::output_text(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("dropped     1 of 10 preference records: their prompt alone fills"),
        "{text}"
    );
    // the pairs read back are the JSONL's cut to 65 tokens (the dropped one left out), in the
    // prepared split
    let records = read_preferences(&jsonl).unwrap();
    let encoder = SftEncoder::open(&tokenizer()).unwrap();
    let want = Preferences::encode(&encoder, &records, &jsonl, 65).unwrap();
    let spec = DataSpec {
        kind: DataKind::Shards,
        path: Some(out.clone()),
        ..DataSpec::default()
    };
    let source = trainer::data::open(&spec).unwrap();
    let pairs = source.preferences().expect("a preference source");
    assert!(
        source.describe().contains("their split"),
        "{}",
        source.describe()
    );
    let manifest = trainer::data::shards::Manifest::read(&out).unwrap();
    let count = |s| -> u64 { manifest.shards(s).iter().map(|e| e.docs).sum() };
    let (n_train, n_val) = (count(Split::Train) as usize, count(Split::Val) as usize);
    assert!(n_train > 0 && n_val > 0, "{n_train} / {n_val}");
    assert_eq!(pairs.pairs().len(), want.pairs.len());
    for (i, p) in pairs.pairs().iter().enumerate() {
        let line = pairs.line(i);
        let k = want.lines.iter().position(|&l| l == line).unwrap();
        assert_eq!(p, &want.pairs[k], "the pair of line {line}");
    }
    // train pairs first, in file order, then the held-out ones
    let lines: Vec<usize> = (0..pairs.pairs().len()).map(|i| pairs.line(i)).collect();
    assert!(
        lines[..n_train].is_sorted() && lines[n_train..].is_sorted(),
        "{lines:?}"
    );
    let mut sorted = lines.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, want.lines, "every record but the dropped one");
}

#[test]
fn prepare_names_bad_preference_records_by_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let good = r#"{"prompt": "a", "chosen": "b", "rejected": "c"}"#;
    let bad = [
        (r#"{"prompt": "a", "chosen": "b"}"#, "no `rejected`"),
        (r#"{"chosen": "yes", "rejected": "no"}"#, "implicit prompt"),
    ];
    for (i, (record, what)) in bad.iter().enumerate() {
        let path = tmp.path().join(format!("p{i}.jsonl"));
        // the bad record on line 3, after a blank line
        std::fs::write(&path, format!("{good}\n\n{record}\n")).unwrap();
        let out = tmp.path().join(format!("out{i}"));
        let err = prepare_pairs(&path, &out, 0.0, None)
            .unwrap_err()
            .to_string();
        let at = format!("{}:3", path.display());
        assert!(err.contains(&at) && err.contains(what), "{err}");
    }
}

#[test]
fn dpo_evaluations_report_held_out_margin_and_accuracy() {
    // the README's run, shortened: the embedded chat base learns to prefer the right letters
    let tmp = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cfg = TrainConfig {
        init_from: Some(repo.join("data/chat-base").display().to_string()),
        data: DataKind::Preference,
        data_path: Some(repo.join("data/letters-preference.jsonl")),
        tokenizer_path: Some(repo.join("data/chat-base/tokenizer.json")),
        objective: "dpo".into(),
        lora_r: 8,
        lora_alpha: 16.0,
        lora_dropout: 0.0,
        lr: 1e-2,
        weight_decay: 0.0,
        warmup_iters: 0,
        batch_size: 8,
        block_size: 32,
        max_iters: 10,
        lr_decay_iters: Some(10),
        eval_interval: 10,
        eval_iters: 2,
        sample_tokens: 0,
        ..common::tiny_config(&tmp.path().join("run"))
    };
    common::finish(Trainer::new(cfg).unwrap());
    let e = evals(&tmp.path().join("run"));
    assert_eq!(e.len(), 2, "{e:?}");
    let mut names: Vec<&str> = trainer::objective::DPO_METRICS.to_vec();
    names.push("dpo_loss");
    names.sort_unstable();
    for ev in &e {
        let got: Vec<&str> = ev.objective.keys().map(String::as_str).collect();
        assert_eq!(got, names, "step {}", ev.step);
    }
    // a fresh adapter (B = 0) is its base, the reference: every log-ratio 0
    let (first, last) = (&e[0].objective, &e[1].objective);
    assert_eq!(first["rewards/margins"], 0.0);
    assert_eq!(first["rewards/accuracies"], 0.0);
    assert!(
        (first["dpo_loss"] - std::f64::consts::LN_2).abs() < 1e-6,
        "{first:?}"
    );
    // held-out pairs: the margin and the accuracy rise, the loss falls
    assert!(last["rewards/margins"] > 0.3, "{last:?}");
    assert!(last["rewards/accuracies"] > 0.5, "{last:?}");
    assert!(last["dpo_loss"] < 0.6, "{last:?}");
    // the eval losses stay the cross-entropy over the completions
    assert!(e[0].val_loss > 1.0, "{:?}", e[0]);
}

#[test]
fn a_preference_prepare_killed_mid_way_and_rerun_writes_the_same_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let one = std::fs::read_to_string(write_pairs(tmp.path())).unwrap();
    let jsonl = tmp.path().join("thrice.jsonl");
    std::fs::write(&jsonl, one.repeat(3)).unwrap();
    let clean = tmp.path().join("clean");
    let want = prepare_pairs(&jsonl, &clean, 0.3, None).unwrap().manifest;
    let out = tmp.path().join("killed");
    // A panic in the progress callback stands for a kill once 3 shards are done: the
    // unfinished shards (their pair tables) are saved beside them and reloaded.
    let killed = std::panic::catch_unwind(|| {
        let opts = pair_options(&jsonl, &out, 0.3, None);
        prepare(&opts, &|p| assert!(p.shards < 3, "killed"))
    });
    assert!(killed.is_err());
    let s = prepare_pairs(&jsonl, &out, 0.3, None).unwrap();
    assert!(s.resumed_shards >= 3, "{}", s.resumed_shards);
    // the same shards: names, sizes and checksums of every MiB and of the whole body
    let got = &s.manifest;
    assert!(!got.val.is_empty() && got.train.len() > 3);
    assert_eq!((&got.train, &got.val), (&want.train, &want.val));
}
