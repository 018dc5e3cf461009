//! A step's memory does not grow with `grad_accum` (#32): micro-batches are drawn one at a
//! time, not all up front (10^12 of them were, until the OOM killer). Peak heap (dhat's
//! allocator) during a step of 2000 micro-batches must stay within one micro-batch's working
//! set of a warm step's: drawn up front, their 2000 batches (inputs and targets, 8 KiB of
//! data each and Candle's tensor headers) would add over 16 MB.

mod common;

use common::tiny_config;
use trainer::config::TrainConfig;
use trainer::train::Trainer;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// How far a step of many micro-batches may raise the peak heap of warm one-micro-batch
/// steps, in bytes (the accumulated gradients are the same size as one micro-batch's).
const MAX_STEP_PEAK: usize = 4 << 20;

#[test]
fn a_step_holds_one_micro_batch_whatever_grad_accum() {
    std::env::set_var("RAYON_NUM_THREADS", "1");
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    let _profiler = dhat::Profiler::builder().testing().build();
    let tmp = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(TrainConfig {
        batch_size: 64,
        n_layer: 1,
        ..tiny_config(&tmp.path().join("run"))
    })
    .unwrap();
    // Warm up (the optimiser's moments, the first step's caches): the peak so far is the
    // baseline a step of many micro-batches must not raise by much.
    t.train_step().unwrap();
    t.train_step().unwrap();
    let before = dhat::HeapStats::get().max_bytes;
    t.config.grad_accum = 2000;
    t.train_step().unwrap();
    let raised = dhat::HeapStats::get().max_bytes - before;
    assert!(
        raised < MAX_STEP_PEAK,
        "a step of 2000 micro-batches raised the peak heap by {raised} bytes (from {before})"
    );
}
