//! Data parallel in the trainer, on candle-comm's in-process thread world (the same code runs
//! over MPI with `mpirun`; `.ci/mpi` runs it there): 2 ranks × batch b train like 1 rank × 2b,
//! replicas stay identical, only rank 0 writes, resume is exact and needs the same world size,
//! and a failing rank stops the other with an error naming it.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use candle_comm::{run_threads, ThreadComm};
use common::{assert_same_losses, finish, tiny_config, Recorder, Run};
use trainer::config::TrainConfig;
use trainer::train::Trainer;

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

/// Runs `make` on 2 thread ranks and returns each rank's result.
fn two_ranks<T: Send>(make: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
    run_threads(2, Duration::from_secs(60), make)
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")))
        .collect()
}

/// `t` as one rank of `comm`'s world.
fn joined(t: trainer::Result<Trainer>, comm: ThreadComm) -> Trainer {
    t.unwrap().with_comm(Box::new(comm)).unwrap()
}

/// Trains `cfg` on 2 thread ranks; each rank's steps and weights.
fn train_two_ranks(cfg: TrainConfig) -> Vec<Run> {
    two_ranks(move |comm| finish(joined(Trainer::new(cfg.clone()), comm)))
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
        for (what, x, y) in [
            ("loss", a.loss, b.loss),
            ("grad norm", a.grad_norm, b.grad_norm),
        ] {
            let rel = (x - y).abs() / x.abs().max(1e-6);
            assert!(rel < 1e-5, "step {}: {what} {x} vs {y}", a.step);
        }
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
    let single = finish(Trainer::new(config(&tmp.path().join("one"), 8)).unwrap());
    let ranks = train_two_ranks(config(&tmp.path().join("two"), 4));
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
    let (tmp, stopped) = common::temp_join("stopped");
    let whole = train_two_ranks(config(&tmp.path().join("straight"), 4));
    train_two_ranks(TrainConfig {
        max_iters: 3, // lr_decay_iters stays tiny_config's, as in the straight run
        ..config(&stopped, 4)
    });
    let e = Trainer::resume(&stopped, |c| c.max_iters = 6)
        .unwrap()
        .run(&mut Recorder::default(), &AtomicBool::new(false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 data-parallel rank"), "{e}");
    let resumed =
        two_ranks(|comm| finish(joined(Trainer::resume(&stopped, |c| c.max_iters = 6), comm)));
    assert_same_losses(&whole[0].0[3..], &resumed[0].0, "resumed");
    assert_eq!(whole[0].1, resumed[0].1);
}

#[test]
fn a_failing_rank_stops_the_other_with_its_name() {
    let (_tmp, dir) = common::temp_join("run");
    let outcomes = two_ranks(move |comm| {
        let mut t = joined(Trainer::new(config(&dir, 4)), comm);
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
    let (tmp, zero_dir) = common::temp_join("zero");
    let plain = train_two_ranks(config(&tmp.path().join("plain"), 4));
    let sharded = two_ranks(|comm| {
        let zero = TrainConfig {
            zero: 1,
            ..config(&zero_dir, 4)
        };
        let t = joined(Trainer::new(zero), comm);
        let held: usize = t
            .optimizer
            .state()
            .iter()
            .map(|(_, s)| s.elem_count())
            .sum();
        (finish(t), held)
    });
    // Same arithmetic for every update, only split across ranks: bit-identical.
    for ((z, _), p) in sharded.iter().zip(&plain) {
        assert_eq!(z.1, p.1, "ZeRO-1 weights differ from plain data parallel");
        assert_same_losses(&z.0, &p.0, "ZeRO-1");
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
    let single = finish(Trainer::new(config(&tmp.path().join("one"), 8)).unwrap());
    let ranks = train_two_ranks(TrainConfig {
        pipeline_stages: 2,
        microbatches: 2,
        pipeline_threads: 1,
        remat: "every:1".parse().unwrap(),
        ..config(&tmp.path().join("grid"), 4)
    });
    assert_like_one_process(&single, &ranks);
}

#[test]
fn a_llama_trains_on_two_ranks_like_one_process() {
    // GQA, RoPE, RMSNorm, SwiGLU and the chunked loss under data parallel and ZeRO-1.
    let tmp = tempfile::tempdir().unwrap();
    let llama = |dir: &Path, batch_size, zero| TrainConfig {
        arch: trainer::config::Arch::Llama,
        n_kv_head: 1,
        tie_embeddings: false,
        zero,
        ..config(dir, batch_size)
    };
    let single = finish(Trainer::new(llama(&tmp.path().join("one"), 8, 0)).unwrap());
    let ranks = train_two_ranks(llama(&tmp.path().join("two"), 4, 0));
    assert_like_one_process(&single, &ranks);
    let zero = train_two_ranks(llama(&tmp.path().join("zero"), 4, 1));
    assert_eq!(
        zero[0].1, ranks[0].1,
        "ZeRO-1 weights differ from plain data parallel"
    );
}
