//! Host syncs and host-to-device copies per training step, counted at the trainer's transfer
//! points (`trainer::transfer`) through the real `Trainer::train_step` on the CPU: what a GPU
//! run of the same step would transfer.
//!
//! A step reads back from the device exactly once (the loss summed on the device and the
//! gradients' sum of squares, stacked: the scaler's overflow check and the clipping
//! coefficient come from that norm) and copies only its batch to the device (`x`, `y` and the
//! addition task's loss mask: 3 tensors a micro-batch), for plain and remat steps, in f32,
//! bf16 and f16 with dynamic loss scaling, with and without clipping, with accumulated
//! micro-batches, for GPT-2 and Llama (whose RoPE tables and positions are copied to the
//! device once, at the first step, then reused). The token embedding's backward reads no ids
//! back either: it orders its sums by the batch's host copy of `x` (`Rows::tokens`; counted by
//! `candle_fused::embedding::id_reads`, which must not move; f32 tables on the CPU take
//! Candle's own `embedding`, so the bf16 and f16 steps are the ones that show it).
//!
//! A pipeline step's cross-entropy reads nothing back either (its microbatches' targets come
//! with the batch's host copy).
//!
//! Not counted here: the reads of an inf/NaN step (the scaler names the non-finite
//! parameters: one read per parameter, on that failure path only), evaluation and logging
//! between steps (they read what the step returned: nothing more), a pipeline's own reads
//! (candle-pipeline reads each microbatch's loss; the trainer reads the rows' target counts
//! once), data parallelism (the loss is read before the ranks average it: 2 reads), and what
//! Candle's ops and candle-fused's composite fallbacks copy to a device themselves (on CUDA
//! today: masks and dropout draws built on the host). candle-fused's own reads back
//! (`candle_fused::host::read_count`: the cross-entropy ops read their targets unless the
//! batch's host copy reaches them) are counted with the trainer's.

mod common;

use std::sync::Mutex;

use common::tiny_config;
use trainer::config::{Arch, TrainConfig};
use trainer::train::Trainer;
use trainer::transfer::Transfers;

/// The transfers counted so far: the trainer's transfer points, and candle-fused's own reads
/// back to the host (the cross-entropy ops' targets when the batch's host copy does not
/// reach them, `global_norm`), each a device-to-host read.
fn counts() -> Transfers {
    let t = trainer::transfer::counts();
    Transfers {
        device_to_host: t.device_to_host + candle_fused::host::read_count(),
        ..t
    }
}

/// The counters are process-wide: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Steps measured after the first (which also copies Llama's RoPE constants).
const STEPS: usize = 3;

/// The transfers of the first step and of each of `STEPS` steps after it, for `cfg`.
fn per_step(cfg: TrainConfig) -> Vec<Transfers> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut t = Trainer::new(cfg).unwrap();
    (0..=STEPS)
        .map(|_| {
            let (before, ids) = (counts(), candle_fused::embedding::id_reads());
            let stats = t.train_step().unwrap();
            // A skipped step (inf/NaN gradients) takes the scaler's failure path.
            assert!(stats.loss.is_finite() && !stats.skipped, "{stats:?}");
            let read = candle_fused::embedding::id_reads() - ids;
            assert_eq!(read, 0, "the token embedding read its ids back");
            counts() - before
        })
        .collect()
}

/// One read back in every step; `uploads` copies to the device in every step after the
/// first, `first_extra` more in the first. Returns nothing: it asserts.
fn assert_steps_after(what: &str, cfg: TrainConfig, uploads: u64, first_extra: u64) {
    for (i, got) in per_step(cfg).into_iter().enumerate() {
        let extra = if i == 0 { first_extra } else { 0 };
        let want = Transfers {
            device_to_host: 1,
            host_to_device: uploads + extra,
        };
        assert_eq!(got, want, "{what}: step {}", i + 1);
    }
}

/// One read back, and `uploads` copies to the device, in every step.
fn assert_steps(what: &str, cfg: TrainConfig, uploads: u64) {
    assert_steps_after(what, cfg, uploads, 0);
}

/// `tiny_config` (GPT-2, 2 layers, addition data with a loss mask) changed by `set`.
fn config(dir: &tempfile::TempDir, set: impl FnOnce(&mut TrainConfig)) -> TrainConfig {
    let mut cfg = tiny_config(&dir.path().join("run"));
    set(&mut cfg);
    cfg
}

#[test]
fn a_step_reads_back_once_and_copies_only_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    // x, y and the loss mask of each micro-batch.
    const BATCH: u64 = 3;
    assert_steps(
        "plain f32, no clipping",
        config(&dir, |c| c.grad_clip = 0.0),
        BATCH,
    );
    assert_steps("plain f32, clipping at 1", config(&dir, |_| {}), BATCH);
    assert_steps(
        "clipping that bites (0.01)",
        config(&dir, |c| c.grad_clip = 0.01),
        BATCH,
    );
    assert_steps(
        "f16, dynamic loss scaling",
        config(&dir, |c| {
            c.dtype = "f16".parse().unwrap();
            c.loss_scale = "dynamic".parse().unwrap();
        }),
        BATCH,
    );
    assert_steps(
        "bf16",
        config(&dir, |c| c.dtype = "bf16".parse().unwrap()),
        BATCH,
    );
    assert_steps(
        "f32 with a static loss scale",
        config(&dir, |c| c.loss_scale = "128".parse().unwrap()),
        BATCH,
    );
    assert_steps(
        "remat every:1, dropout 0.1",
        config(&dir, |c| {
            c.remat = "every:1".parse().unwrap();
            c.dropout = 0.1;
        }),
        BATCH,
    );
    assert_steps(
        "3 accumulated micro-batches",
        config(&dir, |c| c.grad_accum = 3),
        3 * BATCH,
    );
    assert_steps(
        "reference kernels",
        config(&dir, |c| c.kernels = "reference".parse().unwrap()),
        BATCH,
    );
}

#[test]
fn a_llama_step_copies_its_rope_constants_once() {
    let dir = tempfile::tempdir().unwrap();
    let llama = |c: &mut TrainConfig| {
        c.arch = Arch::Llama;
        c.n_kv_head = 1;
        c.bias = false;
    };
    // The first step also copies each block's inv_freq and positions 0..T (2 blocks).
    let rope = 2 * 2;
    let bf16 = config(&dir, |c| {
        llama(c);
        c.dtype = "bf16".parse().unwrap();
    });
    assert_steps_after("llama, bf16", bf16, 3, rope);
    let remat = config(&dir, |c| {
        llama(c);
        c.remat = "every:1".parse().unwrap();
        c.grad_accum = 2;
    });
    assert_steps_after("llama, remat every:1, 2 micro-batches", remat, 6, rope);
}

/// A pipeline hands each microbatch's rows of the batch's host targets to its loss: the
/// cross-entropy ops read nothing back (the pipeline's own reads are not counted here).
#[test]
fn a_pipeline_step_reads_no_targets_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, |c| {
        c.pipeline_stages = 2;
        c.microbatches = 2;
    });
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut t = Trainer::new(cfg).unwrap();
    for step in 1..=2 {
        let before = candle_fused::host::read_count();
        let stats = t.train_step().unwrap();
        assert!(stats.loss.is_finite() && !stats.skipped, "{stats:?}");
        let reads = candle_fused::host::read_count() - before;
        assert_eq!(
            reads, 0,
            "step {step}: candle-fused read back {reads} times"
        );
    }
}

/// The step's code transfers only through `trainer::transfer` (candle-data's, which counts): no raw
/// `to_scalar` / `to_vec*` read or tensor made from host memory in the files a step runs
/// through (outside comments and unit tests). Model initialisation (`model/params.rs`) and
/// the data-parallel collectives (`train/parallel.rs`, host tensors) are not in the step's
/// device path.
#[test]
fn the_step_path_transfers_only_through_the_counters() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let trainer = [
        "train/step.rs",
        "train/executor.rs",
        "train/pipeline.rs",
        "optim/mod.rs",
        "optim/adamw.rs",
        "objective/mod.rs",
        "objective/cross_entropy.rs",
        "model/chain.rs",
        "model/ctx.rs",
        "model/layers/mod.rs",
        "model/layers/attention.rs",
        "model/layers/block.rs",
        "model/layers/decoder.rs",
        "model/layers/head.rs",
        "model/layers/rms_norm.rs",
        "model/layers/rope.rs",
        "model/linear.rs",
        "model/kernels.rs",
        "model/gpt2/mod.rs",
        "model/llama/mod.rs",
    ];
    let data = [
        "lib.rs",
        "addition.rs",
        "sft/mod.rs",
        "sft/layout.rs",
        "shards/source.rs",
    ];
    // The models moved to the models crate keep their paths under its src/.
    let crate_of = |f: &str| match f.starts_with("model/") {
        true => "candle-models/src",
        false => "trainer/src",
    };
    let files = (trainer.iter().map(|f| format!("{}/{f}", crate_of(f))))
        .chain(data.iter().map(|f| format!("candle-data/src/{f}")));
    let raw = [
        ".to_scalar",
        ".to_vec0",
        ".to_vec1",
        ".to_vec2",
        ".to_vec3",
        "Tensor::new(",
        "Tensor::from_vec(",
        "Tensor::from_slice(",
        "Tensor::arange(",
    ];
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(root.join(&f)).unwrap();
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("#[cfg(test)]") {
                break;
            }
            if line.trim_start().starts_with("//") {
                continue;
            }
            if let Some(r) = raw.iter().find(|r| line.contains(*r)) {
                found.push(format!("{f}:{}: {r}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "raw transfers:\n{}", found.join("\n"));
}
