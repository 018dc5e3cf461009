//! The trainer composes candle-remat and candle-amp by flags: checkpointing changes nothing
//! in the numbers, mixed precision trains and resumes exactly.

mod common;

use std::sync::atomic::AtomicBool;

use common::{tiny_config, weights, Recorder};
use trainer::config::TrainConfig;
use trainer::train::Trainer;

fn run(cfg: TrainConfig) -> (Vec<trainer::metrics::StepStats>, Vec<(String, Vec<f32>)>) {
    let mut t = Trainer::new(cfg).unwrap();
    let mut rec = Recorder::default();
    t.run(&mut rec, &AtomicBool::new(false)).unwrap();
    (rec.steps, weights(&t))
}

#[test]
fn remat_policies_give_bit_identical_training() {
    let tmp = tempfile::tempdir().unwrap();
    let base = |name: &str, remat: &str| TrainConfig {
        n_layer: 4,
        dropout: 0.1,
        grad_accum: 2,
        max_iters: 3,
        remat: remat.into(),
        ..tiny_config(&tmp.path().join(name))
    };
    let (plain_steps, plain_w) = run(base("plain", "none"));
    for remat in ["all", "every:2", "sqrt", "budget:400KiB"] {
        let (steps, w) = run(base(remat, remat));
        for (a, b) in plain_steps.iter().zip(&steps) {
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "{remat}: loss at {}",
                a.step
            );
            assert_eq!(
                a.grad_norm.to_bits(),
                b.grad_norm.to_bits(),
                "{remat}: norm"
            );
        }
        assert_eq!(plain_w, w, "{remat}: weights differ");
    }
    let e = Trainer::new(base("bad", "budget:1")).err().unwrap();
    assert!(e.to_string().contains("budget"), "{e}");
}

#[test]
fn mixed_precision_trains_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["f16", "bf16"] {
        let cfg = |name: &str, max_iters| TrainConfig {
            dtype: dtype.into(),
            max_iters,
            ..tiny_config(&tmp.path().join(format!("{dtype}-{name}")))
        };
        let (full, full_w) = run(cfg("full", 8));
        assert!(full.iter().all(|s| s.loss.is_finite()));
        assert!(full.iter().all(|s| s.loss_scale.is_some()));
        if dtype == "f16" {
            // The dynamic scaler starts at 2^16 and backs off; the outcome is reported.
            assert!(full[0].loss_scale.unwrap() >= 1.0);
        }
        let split = tmp.path().join(format!("{dtype}-split"));
        run(TrainConfig {
            out_dir: split.clone(),
            ..cfg("split", 4)
        });
        assert!(split
            .join("checkpoints/step-0000004/amp.safetensors")
            .is_file());
        let mut t = Trainer::resume(&split, |c| c.max_iters = 8).unwrap();
        let mut rec = Recorder::default();
        t.run(&mut rec, &AtomicBool::new(false)).unwrap();
        for (a, b) in full[4..].iter().zip(&rec.steps) {
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "{dtype}: loss at {}",
                a.step
            );
            assert_eq!(a.loss_scale, b.loss_scale);
            assert_eq!(a.skipped, b.skipped);
        }
        assert_eq!(full_w, weights(&t), "{dtype}: weights after resume");
    }
}

#[test]
fn remat_and_mixed_precision_compose_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["f16", "bf16"] {
        let cfg = |remat: &str| TrainConfig {
            n_layer: 3,
            dtype: dtype.into(),
            remat: remat.into(),
            dropout: 0.1,
            max_iters: 3,
            ..tiny_config(&tmp.path().join(format!("{dtype}-{remat}")))
        };
        let (a, wa) = run(cfg("none"));
        let (b, wb) = run(cfg("all"));
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                x.loss.to_bits(),
                y.loss.to_bits(),
                "{dtype}: loss at {}",
                x.step
            );
        }
        assert_eq!(wa, wb, "{dtype}: weights differ with remat");
    }
}

#[test]
fn pipeline_training_matches_plain_training() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |name: &str| TrainConfig {
        n_layer: 3,
        batch_size: 6,
        grad_accum: 2,
        max_iters: 3,
        ..tiny_config(&tmp.path().join(name))
    };
    let (plain, plain_w) = run(cfg("plain"));
    for (stages, m, schedule) in [
        (2, 3, "gpipe"),
        (2, 6, "1f1b"),
        (2, 2, "interleaved:2"),
        (4, 3, "1f1b"),
    ] {
        let (steps, w) = run(TrainConfig {
            pipeline_stages: stages,
            microbatches: m,
            schedule: schedule.into(),
            ..cfg(&format!("{schedule}-{stages}-{m}"))
        });
        for (a, b) in plain.iter().zip(&steps) {
            let rel = (a.loss - b.loss).abs() / a.loss.abs();
            assert!(
                rel <= 1e-5,
                "{schedule} S={stages} m={m}: loss {} vs {}",
                a.loss,
                b.loss
            );
        }
        // A few f32 ulps of gradient difference move AdamW's update by about as much.
        for ((name, a), (_, b)) in plain_w.iter().zip(&w) {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-4, "{schedule}: {name}: {x} vs {y}");
            }
        }
    }
    let e = Trainer::new(TrainConfig {
        pipeline_stages: 2,
        dropout: 0.1,
        ..cfg("dropout")
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("dropout"), "{e}");
}
