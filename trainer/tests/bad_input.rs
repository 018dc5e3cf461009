//! Bad input gets one clear error naming the file and the problem, and never damages an
//! existing good checkpoint.

mod common;

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use common::{snapshot, tiny_config, tiny_run, Recorder};
use tempfile::TempDir;
use trainer::config::TrainConfig;
use trainer::train::Trainer;

fn err_of<T>(r: trainer::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// A finished 4-step run: its temporary directory, run directory and latest checkpoint.
fn trained_run() -> (TempDir, PathBuf, PathBuf) {
    let (tmp, run, _) = tiny_run(|c| c.max_iters = 4);
    let ckpt = trainer::checkpoint::resolve(&run).unwrap();
    (tmp, run, ckpt)
}

#[test]
fn missing_data_file_is_named() {
    let (tmp, missing) = common::temp_join("nope.txt");
    let e = err_of(Trainer::new(TrainConfig {
        data: "char".parse().unwrap(),
        data_path: Some(missing.clone()),
        ..tiny_config(tmp.path())
    }));
    assert!(e.contains("nope.txt"), "{e}");
}

#[test]
fn empty_and_too_short_corpora_are_rejected() {
    let (tmp, empty) = common::temp_join("empty.txt");
    fs::write(&empty, "").unwrap();
    let e = err_of(Trainer::new(TrainConfig {
        data: "char".parse().unwrap(),
        data_path: Some(empty),
        ..tiny_config(tmp.path())
    }));
    assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");

    let short = tmp.path().join("short.txt");
    fs::write(&short, "hello world, this is short").unwrap();
    let e = err_of(Trainer::new(TrainConfig {
        data: "char".parse().unwrap(),
        data_path: Some(short),
        block_size: 64,
        ..tiny_config(tmp.path())
    }));
    assert!(e.contains("short.txt"), "{e}");
}

#[test]
fn impossible_configs_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let e = err_of(Trainer::new(TrainConfig {
        n_head: 3,
        ..tiny_config(tmp.path())
    }));
    assert!(e.contains("divisible"), "{e}");
    let e = err_of(Trainer::new(TrainConfig {
        min_lr: 1.0,
        ..tiny_config(tmp.path())
    }));
    assert!(e.contains("min_lr"), "{e}");
    // Text-valued fields are typed: a bad value is an error where it is read, naming it.
    let bad = tmp.path().join("bad.toml");
    for (line, word) in [
        ("data = \"words\"", "words"),
        ("dtype = \"f8\"", "f8"),
        ("remat = \"every:0\"", "every:0"),
        ("schedule = \"zigzag\"", "zigzag"),
        ("device = \"tpu\"", "tpu"),
        ("loss_scale = \"-4\"", "-4"),
    ] {
        fs::write(&bad, line).unwrap();
        let e = err_of(TrainConfig::from_toml_file(&bad));
        assert!(e.contains("bad.toml") && e.contains(word), "{e}");
    }

    let toml = tmp.path().join("run.toml");
    fs::write(&toml, "n_layer = 2\nn_layers = 4\n").unwrap();
    let e = err_of(TrainConfig::from_toml_file(&toml));
    assert!(e.contains("run.toml") && e.contains("n_layers"), "{e}");
}

#[test]
fn block_size_beyond_loaded_positions_is_rejected() {
    let (tmp, _, ckpt) = trained_run();
    let e = err_of(Trainer::new(TrainConfig {
        init_from: Some(ckpt.display().to_string()),
        block_size: 32,
        ..tiny_config(&tmp.path().join("finetune"))
    }));
    common::assert_mentions(&e, &["block_size 32", "16 positions"]);
    // A smaller block size trains on shorter windows; the model keeps its 16 positions.
    let mut t = Trainer::new(TrainConfig {
        init_from: Some(ckpt.display().to_string()),
        block_size: 12,
        max_iters: 1,
        ..tiny_config(&tmp.path().join("finetune"))
    })
    .unwrap();
    assert_eq!(t.model.config().max_positions(), 16);
    t.train_step().unwrap();
}

#[test]
fn truncated_and_corrupt_safetensors_are_named() {
    let (_tmp, run, ckpt) = trained_run();
    let model = ckpt.join("model.safetensors");
    let bytes = fs::read(&model).unwrap();

    fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let e = err_of(Trainer::resume(&run, |_| {}));
    common::assert_mentions(&e, &["model.safetensors", "truncated"]);

    let mut garbage = bytes.clone();
    garbage[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    fs::write(&model, &garbage).unwrap();
    let e = err_of(Trainer::resume(&run, |_| {}));
    assert!(e.contains("model.safetensors"), "{e}");

    fs::write(&model, &bytes).unwrap();
    let opt = ckpt.join("optimizer.safetensors");
    fs::write(&opt, b"not a safetensors file").unwrap();
    let e = err_of(Trainer::resume(&run, |_| {}));
    assert!(e.contains("optimizer.safetensors"), "{e}");
}

#[test]
fn checkpoint_not_matching_its_config_is_named() {
    let (_tmp, run, ckpt) = trained_run();
    let cfg_path = ckpt.join("config.json");
    let text = fs::read_to_string(&cfg_path).unwrap();
    fs::write(&cfg_path, text.replace("\"n_embd\": 32", "\"n_embd\": 64")).unwrap();
    // The config that disagrees with the run's recorded state is named (not the weights,
    // which match the run), before the weights are read.
    let e = err_of(Trainer::resume(&run, |_| {}));
    common::assert_mentions(&e, &["config.json", "n_embd 64", "32"]);

    let e = err_of(Trainer::resume(&run, |c| c.n_layer = 3));
    assert!(e.contains("cannot change n_layer"), "{e}");
}

#[test]
fn missing_checkpoint_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let e = err_of(Trainer::resume(&tmp.path().join("no-run"), |_| {}));
    assert!(e.contains("no-run"), "{e}");
    let e = err_of(Trainer::resume(tmp.path(), |_| {}));
    assert!(e.contains("neither a checkpoint"), "{e}");
}

#[test]
fn non_finite_loss_stops_without_touching_the_good_checkpoint() {
    let (_tmp, run, _) = trained_run();
    let before = snapshot(&run.join("checkpoints"));
    // An absurd learning rate blows the weights up within a few steps.
    let mut t = Trainer::resume(&run, |c| {
        c.max_iters = 50;
        c.lr = 1e30;
        c.min_lr = 1e30;
        c.grad_clip = 0.0;
    })
    .unwrap();
    let e = err_of(t.run(&mut Recorder::default(), &AtomicBool::new(false)));
    assert!(e.contains("non-finite"), "{e}");
    assert_eq!(before, snapshot(&run.join("checkpoints")));
}
