//! Data parallel in the trainer, on candle-comm's in-process thread world (the same code runs
//! over MPI with `mpirun`; `.ci/mpi` runs it there): 2 ranks × batch b train like 1 rank × 2b,
//! replicas stay identical, only rank 0 writes, resume is exact and needs the same world size,
//! and a failing rank stops the other with an error naming it.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use candle_comm::{run_threads, ThreadComm};
use common::{tiny_config, weights, Recorder};
use trainer::config::TrainConfig;
use trainer::metrics::StepStats;
use trainer::train::Trainer;

type Run = (Vec<StepStats>, Vec<(String, Vec<f32>)>);

fn config(dir: &Path, batch_size: usize) -> TrainConfig {
    TrainConfig {
        batch_size,
        grad_accum: 2,
        // Dropout masks are keyed by the row's place in the global batch, so the ranks
        // together draw the masks one process draws.
        dropout: 0.1,
        max_iters: 6,
        eval_interval: 3,
        ..tiny_config(dir)
    }
}

fn run(mut t: Trainer) -> Run {
    let mut rec = Recorder::default();
    t.run(&mut rec, &AtomicBool::new(false)).unwrap();
    (rec.steps, weights(&t))
}

/// Runs `make` on 2 thread ranks and returns each rank's result.
fn two_ranks<T: Send>(make: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
    run_threads(2, Duration::from_secs(60), make)
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")))
        .collect()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert!(x.is_finite() && y.is_finite(), "non-finite weight");
            (x - y).abs()
        })
        .fold(0f32, f32::max)
}

/// 2 ranks' runs against one process with the whole batch.
fn assert_like_one_process(single: &Run, ranks: &[Run]) {
    // Replicas are bit-identical: same reduced gradients, same update.
    assert_eq!(ranks[0].1, ranks[1].1, "rank weights differ");
    // Against one process with the whole batch, only the order of f32 sums differs (per-shard
    // means weighted by their token counts, then a mean over ranks; accumulation per rank):
    // loss and gradient norm agree to ~1e-7 relative. AdamW's update is about lr per element
    // and per step whatever the gradient's scale, so tiny gradients amplify summation-order
    // noise: the weights must agree to 5% of one update (observed: under 0.5%); a gradient
    // that is not all-reduced moves them by whole updates.
    let (steps, w) = &ranks[0];
    assert_eq!(steps.len(), single.0.len());
    for (a, b) in single.0.iter().zip(steps) {
        let rel = |x: f32, y: f32| (x - y).abs() / x.abs().max(1e-6);
        assert!(
            rel(a.loss, b.loss) < 1e-5,
            "step {}: loss {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
        assert!(
            rel(a.grad_norm, b.grad_norm) < 1e-5,
            "step {}: grad norm {} vs {}",
            a.step,
            a.grad_norm,
            b.grad_norm
        );
        assert_eq!(a.tokens_seen, b.tokens_seen);
    }
    let lr = config(Path::new("."), 4).lr as f32;
    for ((name, a), (_, b)) in single.1.iter().zip(w) {
        let err = max_abs(a, b);
        assert!(err < 0.05 * lr, "{name}: weights differ by {err:e}");
    }
}

#[test]
fn two_ranks_train_like_one_rank_with_twice_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let single = run(Trainer::new(config(&tmp.path().join("one"), 8)).unwrap());
    let dir = tmp.path().join("two");
    let ranks = two_ranks(move |comm| {
        let t = Trainer::new(config(&dir, 4))
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap();
        run(t)
    });
    assert_like_one_process(&single, &ranks);
    // Rank 0 wrote the run; the checkpoint records the world size.
    let state = std::fs::read_to_string(
        tmp.path()
            .join("two/checkpoints/step-0000006/trainer_state.json"),
    )
    .unwrap();
    assert!(state.contains("\"world_size\": 2"), "{state}");
}

#[test]
fn resume_is_exact_and_needs_the_same_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let (straight, stopped) = (tmp.path().join("straight"), tmp.path().join("stopped"));
    let whole = two_ranks(move |comm| {
        run(Trainer::new(config(&straight, 4))
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap())
    });
    let first = stopped.clone();
    two_ranks(move |comm| {
        let cfg = TrainConfig {
            max_iters: 3, // lr_decay_iters stays tiny_config's, as in the straight run
            ..config(&first, 4)
        };
        run(Trainer::new(cfg)
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap())
    });
    let e = Trainer::resume(&stopped, |c| c.max_iters = 6)
        .unwrap()
        .run(&mut Recorder::default(), &AtomicBool::new(false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 data-parallel rank"), "{e}");
    let again = stopped.clone();
    let resumed = two_ranks(move |comm| {
        run(Trainer::resume(&again, |c| c.max_iters = 6)
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap())
    });
    for (a, b) in whole[0].0[3..].iter().zip(&resumed[0].0) {
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
    }
    assert_eq!(whole[0].1, resumed[0].1);
}

#[test]
fn a_failing_rank_stops_the_other_with_its_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let outcomes = two_ranks(move |comm| {
        let mut t = Trainer::new(config(&dir, 4))
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap();
        if t.data_parallel().rank() == 1 {
            let e = trainer::Error::Config("out of data at step 1".into());
            t.data_parallel().abort(&e);
            return Err(e.to_string());
        }
        t.run(&mut Recorder::default(), &AtomicBool::new(false))
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let e = outcomes[0].clone().unwrap_err();
    assert!(e.contains("rank 1") && e.contains("out of data"), "{e}");
}

#[test]
fn zero1_shards_the_optimiser_and_trains_like_plain_data_parallel() {
    let tmp = tempfile::tempdir().unwrap();
    let (plain_dir, zero_dir) = (tmp.path().join("plain"), tmp.path().join("zero"));
    let plain = two_ranks(move |comm| {
        run(Trainer::new(config(&plain_dir, 4))
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap())
    });
    let zdir = zero_dir.clone();
    let sharded = two_ranks(move |comm| {
        let t = Trainer::new(TrainConfig {
            zero: 1,
            ..config(&zdir, 4)
        })
        .unwrap()
        .with_comm(Box::new(comm))
        .unwrap();
        let held = t.optimizer.state_elements();
        (run(t), held)
    });
    // Same arithmetic for every update, only split across ranks: bit-identical.
    for ((z, _), p) in sharded.iter().zip(&plain) {
        assert_eq!(z.1, p.1, "ZeRO-1 weights differ from plain data parallel");
        for (a, b) in z.0.iter().zip(&p.0) {
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
        }
    }
    // Each rank holds part of the state; together exactly all of it, each part at most 60%.
    let total: usize = plain[0].1.iter().map(|(_, w)| 2 * w.len()).sum();
    let held: Vec<usize> = sharded.iter().map(|(_, h)| *h).collect();
    assert_eq!(held.iter().sum::<usize>(), total, "{held:?}");
    assert!(
        held.iter().all(|&h| h * 10 <= total * 6),
        "{held:?} of {total}"
    );
    // The checkpoint holds the whole optimiser state, byte for byte as without ZeRO.
    for f in ["optimizer.safetensors", "model.safetensors"] {
        let read = |d: &Path| std::fs::read(d.join("checkpoints/step-0000006").join(f)).unwrap();
        assert!(
            read(&tmp.path().join("plain")) == read(&zero_dir),
            "{f} differs"
        );
    }
}

#[test]
fn pipeline_stages_within_each_rank_train_like_one_process() {
    // 2D: each of the 2 ranks runs a 2-stage 1F1B pipeline (threads) that recomputes its
    // blocks, on its shard; together they train like one plain process with the whole batch
    // (dropout 0.1: every row draws the mask it draws there).
    let tmp = tempfile::tempdir().unwrap();
    let single = run(Trainer::new(config(&tmp.path().join("one"), 8)).unwrap());
    let dir = tmp.path().join("grid");
    let ranks = two_ranks(move |comm| {
        let cfg = TrainConfig {
            pipeline_stages: 2,
            microbatches: 2,
            pipeline_threads: 1,
            remat: "every:1".parse().unwrap(),
            ..config(&dir, 4)
        };
        run(Trainer::new(cfg)
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap())
    });
    assert_like_one_process(&single, &ranks);
}
