//! Training does not accumulate memory across steps, through the real [`Trainer::train_step`]
//! in every mode: plain, activation checkpointing, mixed precision (bf16 and f16 with its loss
//! scaler), the pipeline and gradient accumulation.
//!
//! Candle leaves the backward graph attached to the gradients of variables; an optimiser (or
//! an accumulator, a scaler, a pipeline stash) that keeps those tensors retains every step's
//! activations. Live heap (counted by dhat's allocator) must stay flat after a warm-up: the
//! first steps allocate the optimiser moments and the pipeline's thread pools.
//!
//! dhat allows one profiler per process, so the modes run one after another in a single test.
//!
//! One thread computes (rayon's pool and each pipeline stage's pool): gemm keeps a 1 MiB
//! packing slab per thread (gemm-common's `L2_SLAB`), allocated lazily by whichever pool thread
//! first runs a GEMM, which made the heap jump by exactly 1 MiB at a random step in about one
//! run in ten with 2 rayon threads (this test before the change, and the model-only version it
//! replaces).

mod common;

use common::tiny_config;
use trainer::config::TrainConfig;
use trainer::train::Trainer;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Steps per mode: live heap after step `WARMUP` is the baseline, after step `STEPS` the end.
const WARMUP: usize = 5;
const STEPS: usize = 16;
/// Allowed growth from `WARMUP` to `STEPS`, in bytes. A leak grows the heap at every step; what
/// may legitimately appear once, at a time the OS decides, is a thread starting up: rayon's
/// global worker (its registry slot and crossbeam-epoch handle, about 7 KB in this profile)
/// is spawned in the first step but can run its start-up several steps later. Measured growth
/// is otherwise 0 bytes (a few dozen with the pipeline: its mailboxes depend on message
/// arrival order), on a baseline of about 1.4 MB (4 MB with the pipeline's pools). Leaks tried:
/// the head's graph under remat, 22 KB a step, grows the heap by 240 KB over these 11 steps;
/// the pipeline's gradients, 112 KB a step, by 1.2 MB. 16 KiB catches a leak of about 1.5 KB a
/// step; the model-only test's 10% of the baseline needed about 14 KB.
const MAX_GROWTH: usize = 16 << 10;

/// Live heap after each of `STEPS` real training steps of a run with `cfg`.
fn live_heap_per_step(cfg: TrainConfig) -> Vec<usize> {
    let mut t = Trainer::new(cfg).unwrap();
    let mut live = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let stats = t.train_step().unwrap();
        assert!(stats.loss.is_finite() && !stats.skipped);
        live.push(dhat::HeapStats::get().curr_bytes);
    }
    live
}

#[test]
fn live_heap_is_flat_across_train_steps_in_every_mode() {
    // Before any tensor op: rayon sizes its global pool once, from this variable, and Candle
    // reads it at every GEMM (1 thread: `Parallelism::None`, on the calling thread).
    std::env::set_var("RAYON_NUM_THREADS", "1");
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    let _profiler = dhat::Profiler::builder().testing().build();
    let tmp = tempfile::tempdir().unwrap();
    let base = |name: &str| TrainConfig {
        dropout: 0.1,
        max_iters: STEPS,
        ..tiny_config(&tmp.path().join(name))
    };
    let modes: Vec<(&str, TrainConfig)> = vec![
        ("plain", base("plain")),
        (
            "remat every:1",
            TrainConfig {
                remat: "every:1".parse().unwrap(),
                ..base("remat")
            },
        ),
        (
            "amp bf16",
            TrainConfig {
                dtype: "bf16".parse().unwrap(),
                ..base("bf16")
            },
        ),
        (
            "amp f16",
            TrainConfig {
                dtype: "f16".parse().unwrap(),
                ..base("f16")
            },
        ),
        (
            "pipeline 2 stages",
            TrainConfig {
                pipeline_stages: 2,
                microbatches: 2,
                pipeline_threads: 1,
                dropout: 0.0,
                ..base("pipeline")
            },
        ),
        (
            "grad_accum 3",
            TrainConfig {
                grad_accum: 3,
                ..base("accum")
            },
        ),
    ];
    for (mode, cfg) in modes {
        let live = live_heap_per_step(cfg);
        let (at_warmup, at_end) = (live[WARMUP - 1], live[STEPS - 1]);
        assert!(
            at_end <= at_warmup + MAX_GROWTH,
            "{mode}: live heap grew from {at_warmup} B at step {WARMUP} to {at_end} B at step \
             {STEPS}: {live:?}"
        );
    }
}
