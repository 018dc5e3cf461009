//! Round trip with transformers: a fixture model (`tests/fixtures/llama/<case>`) is trained for
//! 20 steps, exported as a Hugging Face directory, and transformers must load that export and
//! compute the same loss and the same greedy continuation as we do.
//!
//! transformers cannot run in CI, so the check is split in two:
//! * `UPDATE_GOLDEN=1 cargo test --release -p trainer --test llama_roundtrip` trains, exports
//!   into `tests/fixtures/llama/roundtrip/<case>/` (the golden export) and records our loss on
//!   the fixture's batch and our greedy continuation there (`ours.json`);
//! * `scripts/python/verify_roundtrip.py` loads each golden export with
//!   `AutoModelForCausalLM.from_pretrained` and records transformers' loss and continuation
//!   (`verified.json`), failing if loading reports missing or unexpected keys.
//!
//! Every `cargo test` then retrains and re-exports, and checks that the export equals the golden
//! one (tensor by tensor within 1e-5 of each tensor's scale: 20 AdamW steps on another CPU may
//! round differently; config.json identical), that our loss of the golden export equals
//! transformers' within 1e-5 relative, and that our KV-cache greedy continuation equals
//! transformers' token for token.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use candle_core::{Device, Tensor};
use common::llama::{expected, fixture};
use common::{max_abs, max_abs_diff, Recorder};
use serde_json::{json, Value};
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::export::{self, ExportOptions};
use trainer::load::{ModelDir, WeightFiles};
use trainer::model::Ctx;
use trainer::train::Trainer;

/// Cases: untied with every bias (exported in 4 shards), tied, Qwen3's q/k norm with a
/// head_dim of its own, Mistral's sliding window.
const CASES: &[(&str, u64)] = &[
    ("llama", 40_000),
    ("tied", export::DEFAULT_MAX_SHARD_SIZE),
    ("qwen3", export::DEFAULT_MAX_SHARD_SIZE),
    ("mistral_sliding", export::DEFAULT_MAX_SHARD_SIZE),
];

fn golden(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama/roundtrip")
        .join(case)
}

/// Trains the fixture `case` for 20 steps on tinyshakespeare's bytes (ids < 256 fit its 301)
/// and exports the run into `out`.
fn train_and_export(case: &str, shard: u64, work: &Path, out: &Path) {
    let cfg = TrainConfig {
        out_dir: work.join("run"),
        init_from: Some(fixture(case).to_string_lossy().into_owned()),
        data: DataKind::Byte,
        data_path: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt")),
        cache_dir: Some(work.join("cache")),
        block_size: 12,
        batch_size: 4,
        max_iters: 20,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_iters: 2,
        eval_interval: 20,
        eval_iters: 1,
        peak_flops: 1e12,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(cfg).unwrap();
    t.run(&mut Recorder::default(), &AtomicBool::new(false))
        .unwrap();
    let options = ExportOptions {
        max_shard_size: shard,
        force: true,
        ..ExportOptions::default()
    };
    export::export_spec(work.join("run").to_str().unwrap(), out, &options).unwrap();
}

/// Our loss of the fixture's batch and greedy 20-token continuation of its prompt, with the
/// model exported in `dir`.
fn ours(case: &str, dir: &Path) -> (f32, Vec<u32>) {
    let model = ModelDir::open(dir.to_str().unwrap())
        .unwrap()
        .load_model(&Device::Cpu)
        .unwrap();
    let ex = expected(case);
    let ctx = Ctx::eval().with_rows(ex.rows.clone());
    let loss = model.loss(&ex.idx, &ex.targets, &ctx).unwrap().mean;
    let g =
        candle_core::safetensors::load(fixture(case).join("generate.safetensors"), &Device::Cpu)
            .unwrap();
    let prompt: Vec<i64> = g["prompt"].squeeze(0).unwrap().to_vec1().unwrap();
    let prompt: Vec<u32> = prompt.iter().map(|&x| x as u32).collect();
    let greedy = trainer::sample::greedy_batch(model.as_ref(), &[prompt], 20, &Device::Cpu)
        .unwrap()
        .remove(0);
    (loss.to_scalar::<f32>().unwrap(), greedy)
}

fn tensors(dir: &Path) -> Vec<(String, Tensor)> {
    let files = WeightFiles::locate(dir).unwrap().files();
    let mut all: Vec<(String, Tensor)> = files
        .iter()
        .flat_map(|f| candle_core::safetensors::load(f, &Device::Cpu).unwrap())
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (see this file's header)", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn trained_exports_load_in_transformers_with_the_same_loss_and_generation() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    for &(case, shard) in CASES {
        let tmp = tempfile::tempdir().unwrap();
        let out = if update {
            golden(case)
        } else {
            tmp.path().join("export")
        };
        train_and_export(case, shard, tmp.path(), &out);
        if update {
            let (loss, greedy) = ours(case, &out);
            let j = json!({"loss": loss, "greedy": greedy});
            std::fs::write(out.join("ours.json"), format!("{j:#}\n")).unwrap();
            continue;
        }
        // The export equals the golden one that transformers loaded.
        let (got, want) = (tensors(&out), tensors(&golden(case)));
        assert_eq!(
            got.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            want.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            "{case}: tensor names"
        );
        for ((name, a), (_, b)) in got.iter().zip(&want) {
            assert_eq!(a.dtype(), b.dtype(), "{case}: {name}");
            let rel = max_abs_diff(a, b) / max_abs(b);
            assert!(
                rel <= 1e-5,
                "{case}: {name} differs from the golden export by {rel:e}"
            );
        }
        assert_eq!(
            read_json(&out.join("config.json")),
            read_json(&golden(case).join("config.json")),
            "{case}: config.json"
        );
        let shards = WeightFiles::locate(&out).unwrap().files().len();
        assert_eq!(
            shards > 1,
            shard < export::DEFAULT_MAX_SHARD_SIZE,
            "{case}: {shards} shards"
        );
        // transformers' loss and continuation of the golden export are ours.
        let verified = read_json(&golden(case).join("verified.json"));
        let (loss, greedy) = ours(case, &golden(case));
        let theirs = verified["loss"].as_f64().unwrap() as f32;
        assert!(
            ((loss - theirs) / theirs).abs() <= 1e-5,
            "{case}: loss {loss} vs transformers' {theirs}"
        );
        let theirs: Vec<u32> = serde_json::from_value(verified["greedy"].clone()).unwrap();
        assert_eq!(greedy, theirs, "{case}: greedy continuation");
        // And training moved the model: the fixture's own loss is not the export's.
        let before = expected(case).loss;
        assert!(
            (loss - before).abs() > 1e-3,
            "{case}: 20 steps changed nothing"
        );
    }
}
