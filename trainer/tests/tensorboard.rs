//! TensorBoard event files: against the file TensorBoard's own `SummaryWriter` wrote
//! (`tests/fixtures/tensorboard/`, made by `scripts/python/make_tensorboard_fixture.py`), and a
//! run's event file against its `metrics.jsonl`, also across a resume.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::{run_to_end, tiny_config, train};
use trainer::metrics::scalars_of;
use trainer::tensorboard::{read, EventWriter, Scalar};
use trainer::train::Trainer;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tensorboard")
        .join(name)
}

/// The scalars SummaryWriter was given, as `expected.json` lists them (a NaN as `null`), and
/// the header's wall time.
fn expected() -> (f64, Vec<Scalar>) {
    let text = std::fs::read_to_string(fixture("expected.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let scalars = doc["scalars"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Scalar {
            tag: s["tag"].as_str().unwrap().to_string(),
            step: s["step"].as_i64().unwrap(),
            value: s["value"].as_f64().map_or(f32::NAN, |v| v as f32),
            wall_time: s["wall_time"].as_f64().unwrap(),
        })
        .collect();
    (doc["header_wall_time"].as_f64().unwrap(), scalars)
}

/// Scalars compared bit for bit (NaN equal to NaN).
fn bits(scalars: &[Scalar]) -> Vec<(String, i64, u32, u64)> {
    scalars
        .iter()
        .map(|s| {
            (
                s.tag.clone(),
                s.step,
                s.value.to_bits(),
                s.wall_time.to_bits(),
            )
        })
        .collect()
}

#[test]
fn reads_what_summary_writer_wrote() {
    let (start, want) = expected();
    let file = read(&fixture("summary_writer.tfevents")).unwrap();
    assert_eq!(file.wall_time, start);
    assert_eq!(file.writer, "tensorboard.summary.writer.event_file_writer");
    assert_eq!(bits(&file.scalars), bits(&want));
}

#[test]
fn writes_the_bytes_summary_writer_wrote() {
    let (start, want) = expected();
    let (_tmp, path) = common::temp_join("events.out.tfevents.ours");
    let mut w =
        EventWriter::create(&path, start, "tensorboard.summary.writer.event_file_writer").unwrap();
    for s in &want {
        w.write(s).unwrap();
    }
    w.flush().unwrap();
    let ours = std::fs::read(&path).unwrap();
    let theirs = std::fs::read(fixture("summary_writer.tfevents")).unwrap();
    assert_eq!(ours.len(), theirs.len());
    assert!(ours == theirs, "the event files differ");
}

#[test]
fn a_damaged_file_is_named_with_the_offset() {
    let (_tmp, path) = common::temp_join("events.out.tfevents.bad");
    let mut bytes = std::fs::read(fixture("summary_writer.tfevents")).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let e = read(&path).unwrap_err().to_string();
    common::assert_mentions(
        &e,
        &[
            "events.out.tfevents.bad",
            "CRC mismatch in the record at byte",
        ],
    );
}

/// The one event file of run directory `dir`.
fn event_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

/// The event file of run `dir` holds the scalars of its `metrics.jsonl`, in order, each
/// (tag, step) once; returns the steps of `train/loss`.
fn assert_events_match_metrics(dir: &Path) -> Vec<i64> {
    let records = trainer::metrics::read(&dir.join("metrics.jsonl")).unwrap();
    let want: Vec<Scalar> = records.iter().flat_map(|r| scalars_of(r, 0.0)).collect();
    let got: Vec<Scalar> = read(&event_file(dir))
        .unwrap()
        .scalars
        .into_iter()
        .map(|s| Scalar {
            wall_time: 0.0,
            ..s
        })
        .collect();
    assert_eq!(bits(&got), bits(&want));
    let pairs: BTreeSet<(&str, i64)> = got.iter().map(|s| (s.tag.as_str(), s.step)).collect();
    assert_eq!(pairs.len(), got.len(), "a (tag, step) twice");
    for tag in [
        "train/learning_rate",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
    ] {
        assert!(pairs.iter().any(|(t, _)| *t == tag), "no {tag}");
    }
    for tag in ["eval/loss", "eval/train_loss", "eval/addition_accuracy"] {
        assert!(pairs.iter().any(|(t, _)| *t == tag), "no {tag}");
    }
    got.iter()
        .filter(|s| s.tag == "train/loss")
        .map(|s| s.step)
        .collect()
}

/// A run killed after its step-4 checkpoint went on to step 8; resumed from step 4 to 6, its
/// curves hold steps 1..=6 once each: the events past the checkpoint are gone.
#[test]
fn a_resumed_run_logs_each_step_once() {
    let (_tmp, dir) = common::temp_join("run");
    drop(train(tiny_config(&dir)));
    assert_eq!(
        assert_events_match_metrics(&dir),
        (1..=8).collect::<Vec<_>>()
    );
    let older = dir.join("checkpoints/step-0000004");
    let mut back = Trainer::resume(&older, |c| c.max_iters = 6).unwrap();
    run_to_end(&mut back);
    drop(back);
    assert_eq!(
        assert_events_match_metrics(&dir),
        (1..=6).collect::<Vec<_>>()
    );
}
