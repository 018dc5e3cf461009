//! N steps + save + resume + N steps == 2N uninterrupted steps, bit for bit: the same losses,
//! gradient norms and final weights. Dropout and gradient accumulation are on, so the test
//! covers the data RNG, the dropout seeds and the optimiser moments.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use common::{assert_same_steps, run_to_end, tiny_config, tiny_run, train, weights, Recorder};
use trainer::train::Trainer;

fn config(dir: &std::path::Path) -> trainer::config::TrainConfig {
    trainer::config::TrainConfig {
        dropout: 0.1,
        grad_accum: 2,
        ..tiny_config(dir)
    }
}

#[test]
fn resume_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();

    // 2N = 8 uninterrupted steps.
    let mut full = Trainer::new(config(&tmp.path().join("full"))).unwrap();
    let full_steps = run_to_end(&mut full);
    assert_eq!(full_steps.len(), 8);

    // N = 4 steps, then a new process-like start from the checkpoint.
    let split_dir = tmp.path().join("split");
    let half = trainer::config::TrainConfig {
        max_iters: 4,
        ..config(&split_dir)
    };
    let (split_steps, second) = common::split_run(half, 8);

    assert_same_steps(&full_steps, &split_steps, "resumed");
    assert_eq!(weights(&full), weights(&second), "final weights differ");
    // The metrics file of the resumed run holds each step exactly once.
    let records = trainer::metrics::read(&split_dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<usize> = records
        .iter()
        .filter_map(|r| match r {
            trainer::metrics::Record::Step(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
}

#[test]
fn interrupted_run_saves_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let full = train(config(&tmp.path().join("full")));

    // Stop after step 3 (not an eval step): the run must checkpoint step 3 on its way out.
    let dir = tmp.path().join("interrupted");
    let stop = Arc::new(AtomicBool::new(false));
    let mut t = Trainer::new(config(&dir)).unwrap();
    let mut rec = Recorder {
        stop_after: Some((3, stop.clone())),
        ..Default::default()
    };
    let summary = t.run(&mut rec, &stop).unwrap();
    assert!(summary.interrupted);
    assert_eq!(summary.step, 3);
    assert!(dir
        .join("checkpoints/step-0000003/model.safetensors")
        .is_file());
    drop(t);
    let mut resumed = Trainer::resume(&dir, |_| {}).unwrap();
    assert_eq!(resumed.step(), 3);
    run_to_end(&mut resumed);
    assert_eq!(weights(&full), weights(&resumed));
}

/// An uninterrupted run of `cfg` and one stopped after step `k` (not an eval step: it
/// checkpoints on its way out) then resumed from its run directory, each run in a fresh
/// directory: the same losses, gradient norms, learning rates and final weights, bit for bit.
fn assert_stop_and_resume_is_exact(
    tmp: &std::path::Path,
    name: &str,
    cfg: impl Fn(&std::path::Path) -> trainer::config::TrainConfig,
    k: usize,
) {
    let mut full = Trainer::new(cfg(&tmp.join(format!("{name}-full")))).unwrap();
    let full_steps = run_to_end(&mut full);
    assert_eq!(full_steps.len(), full.config.max_iters);

    let dir = tmp.join(format!("{name}-stopped"));
    let stop = Arc::new(AtomicBool::new(false));
    let mut first = Trainer::new(cfg(&dir)).unwrap();
    let mut rec_first = Recorder {
        stop_after: Some((k, stop.clone())),
        ..Default::default()
    };
    let summary = first.run(&mut rec_first, &stop).unwrap();
    assert!(
        summary.interrupted && summary.step == k,
        "{name}: {summary:?}"
    );
    drop(first);
    let mut second = Trainer::resume(&dir, |_| {}).unwrap();
    assert_eq!(second.step(), k);
    assert_eq!(second.config, cfg(&dir), "{name}: config changed on resume");
    let mut split = rec_first.steps;
    split.extend(run_to_end(&mut second));
    assert_same_steps(&full_steps, &split, name);
    assert!(
        weights(&full) == weights(&second),
        "{name}: final weights differ"
    );
}

#[test]
fn remat_run_stopped_and_resumed_is_bit_exact() {
    // Checkpointing every block, with dropout (masks regenerated in the recompute) and
    // gradient accumulation.
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |dir: &std::path::Path| trainer::config::TrainConfig {
        remat: "every:1".parse().unwrap(),
        ..config(dir)
    };
    let t = Trainer::new(cfg(&tmp.path().join("probe"))).unwrap();
    assert!(t.remat_plan().is_some());
    drop(t);
    assert_stop_and_resume_is_exact(tmp.path(), "remat", cfg, 3);
}

#[test]
fn pipeline_run_stopped_and_resumed_is_bit_exact() {
    // Two stages, two microbatches, accumulation, dropout (keyed by the microbatches' rows).
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |dir: &std::path::Path| trainer::config::TrainConfig {
        pipeline_stages: 2,
        microbatches: 2,
        dropout: 0.1,
        ..config(dir)
    };
    assert_stop_and_resume_is_exact(tmp.path(), "pipeline", cfg, 3);
}

#[test]
fn sgd_run_stopped_and_resumed_is_bit_exact() {
    // `optimizer = "sgd"` with momentum, dampening and weight decay: its momentum buffers are
    // checkpointed and restored (a fresh buffer would change every step after the stop).
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |dir: &std::path::Path| trainer::config::TrainConfig {
        optimizer: "sgd".into(),
        optimizer_options: "momentum=0.9,dampening=0.1,weight_decay=0.01"
            .parse()
            .unwrap(),
        lr: 0.05,
        min_lr: 0.005,
        ..config(dir)
    };
    let t = Trainer::new(cfg(&tmp.path().join("probe"))).unwrap();
    assert_eq!(t.optimizer.name(), "sgd");
    drop(t);
    assert_stop_and_resume_is_exact(tmp.path(), "sgd", cfg, 3);
}

/// A finished 8-step run that evaluates every `eval_interval` steps and keeps the last 2
/// checkpoints (and the best): its temporary directory and run directory.
fn keeping_two(eval_interval: usize) -> (tempfile::TempDir, std::path::PathBuf) {
    let (tmp, dir, _) = tiny_run(|c| {
        c.max_iters = 8;
        c.eval_interval = eval_interval;
        c.keep_last = 2;
    });
    (tmp, dir)
}

#[test]
fn keeps_last_n_plus_best() {
    let (_tmp, dir) = keeping_two(2);
    let mut names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    let state: trainer::checkpoint::TrainerState = trainer::checkpoint::io::read_json(
        &dir.join("checkpoints/step-0000008/trainer_state.json"),
    )
    .unwrap();
    let best = state.best_checkpoint.unwrap();
    let mut want = vec!["step-0000006".to_string(), "step-0000008".to_string()];
    if !want.contains(&best) {
        want.insert(0, best);
    }
    assert_eq!(names, want);
    assert_eq!(
        std::fs::read_to_string(dir.join("checkpoints/latest")).unwrap(),
        "step-0000008"
    );
}

#[test]
fn resuming_with_more_steps_continues_the_schedule() {
    let (_tmp, dir, t) = tiny_run(|c| {
        c.max_iters = 4;
        c.lr_decay_iters = None; // decay ends at max_iters = 4
    });
    let min_lr = t.config.min_lr;
    let steps = run_to_end(&mut Trainer::resume(&dir, |c| c.max_iters = 7).unwrap());
    assert_eq!(steps.len(), 3);
    for s in &steps {
        assert_eq!(s.lr, min_lr, "step {} jumped to lr {}", s.step, s.lr);
    }
}

#[test]
fn resuming_from_an_older_checkpoint_keeps_the_new_one() {
    let (_tmp, dir) = keeping_two(4);
    // Roll back to step 4 (e.g. after a divergence) while step 8 exists, keep only 1, and
    // save step 6: the checkpoint just written must survive pruning.
    let older = dir.join("checkpoints/step-0000004");
    assert!(older.join("trainer_state.json").is_file());
    let mut back = Trainer::resume(&older, |c| {
        c.max_iters = 6;
        c.keep_last = 1;
    })
    .unwrap();
    run_to_end(&mut back);
    assert!(dir
        .join("checkpoints/step-0000006/trainer_state.json")
        .is_file());
    let resumed = Trainer::resume(&dir, |_| {}).unwrap();
    assert_eq!(resumed.step(), 6);
}
