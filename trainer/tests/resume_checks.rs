//! What a resumed run reads back is what was saved, checked (#32): `trainer_state.json`
//! records the optimiser's update count and the weights' digest, compared with the files
//! even when the manifest was made to match; the metrics written before the resume are kept bit for bit
//! (floats read back exactly); and every file a checkpoint writes names itself in its error.

mod common;

use std::fs;
use std::path::Path;

use common::tiny_config;
use trainer::checkpoint::{self, manifest};
use trainer::config::TrainConfig;
use trainer::train::Trainer;

/// A run of `steps` steps with a checkpoint every 2 (all kept): the learning rate of each
/// step.
fn run(dir: &Path, steps: usize) -> Vec<f64> {
    let cfg = TrainConfig {
        max_iters: steps,
        lr_decay_iters: Some(16),
        eval_interval: 2,
        keep_last: 10,
        ..tiny_config(dir)
    };
    let mut t = Trainer::new(cfg).unwrap();
    common::run_to_end(&mut t).iter().map(|s| s.lr).collect()
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Another step's weights or optimiser file, with the manifest sealed again over it, is
/// refused naming the file, the state file and the steps. (Before, it resumed.)
#[test]
fn a_file_of_another_step_is_refused_even_with_a_matching_manifest() {
    let (tmp, dir) = common::temp_join("run");
    run(&dir, 4);
    let ckpts = dir.join("checkpoints");
    for file in [checkpoint::MODEL_FILE, checkpoint::OPTIMIZER_FILE] {
        let forged = tmp.path().join(format!("forged-{file}"));
        copy_dir(&ckpts.join("step-0000004"), &forged);
        fs::copy(ckpts.join("step-0000002").join(file), forged.join(file)).unwrap();
        manifest::write(&forged, 4).unwrap();
        let e = Trainer::resume(&forged, |c| c.out_dir = tmp.path().join("fork"))
            .err()
            .unwrap_or_else(|| panic!("{file} of step 2 resumed as step 4"))
            .to_string();
        assert!(e.contains(file) && e.contains("step 4"), "{e}");
        assert!(e.contains(checkpoint::STATE_FILE), "{e}");
        if file == checkpoint::OPTIMIZER_FILE {
            assert!(e.contains("after 2 updates"), "{e}");
        }
    }
    // The untouched checkpoints resume.
    Trainer::resume(&ckpts.join("step-0000002"), |_| {}).unwrap();
}

/// Resuming rewrites metrics.jsonl with the records up to the checkpoint: they come back
/// exactly as written (every float of every field, the learning rate included), so the
/// file of a resumed run holds the same numbers as before. (Before, serde_json's default
/// float parsing changed the last bits of some of them.)
#[test]
fn metrics_read_back_on_resume_keep_every_bit() {
    let (_tmp, dir) = common::temp_join("run");
    // Ten steps: about 50 floats, of which serde_json's default parsing reads about one in
    // ten a bit off (measured on such a file: 22 of 255).
    let mut lrs = run(&dir, 10);
    let path = dir.join("metrics.jsonl");
    let before = fs::read_to_string(&path).unwrap();
    let kept: Vec<&str> = before.lines().collect();
    assert!(kept.len() >= 10, "{before}");
    let mut t = Trainer::resume(&dir, |c| c.max_iters = 12).unwrap();
    lrs.extend(common::run_to_end(&mut t).iter().map(|s| s.lr));
    let after = fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = after.lines().collect();
    assert_eq!(
        lines[..kept.len()],
        kept[..],
        "records before the resume changed"
    );
    // The learning rate of every step, read back, is the one the run used, bit for bit.
    let read: Vec<f64> = trainer::metrics::read(&path)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            trainer::metrics::Record::Step(s) => Some(s.lr),
            _ => None,
        })
        .collect();
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&read), bits(&lrs), "{read:?} {lrs:?}");
}

/// A write of a checkpoint file that fails with an error naming no file (a full disk under a
/// writer that does not say where) is reported naming the file in the checkpoint.
#[test]
fn every_checkpoint_write_error_names_its_file() {
    let (_tmp, dir) = common::temp_join("run");
    let mut t = Trainer::new(TrainConfig {
        max_iters: 1,
        ..tiny_config(&dir)
    })
    .unwrap();
    t.train_step().unwrap();
    let full = |_: &Path| -> trainer::Result<()> {
        Err(trainer::Error::Config(
            "No space left on device (os error 28)".into(),
        ))
    };
    let e = common::save_with(&t, &dir, &[("scaler.safetensors", &full)])
        .unwrap_err()
        .to_string();
    common::assert_mentions(&e, &["step-0000001/scaler.safetensors", "No space left"]);
    assert!(!dir.join("checkpoints/step-0000001").exists());
}
