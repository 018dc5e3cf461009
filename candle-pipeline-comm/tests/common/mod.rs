//! Shared by the thread-world tests and the MPI example: a small MLP with deterministic
//! weights (the same in every process), its pipeline, the batch, and the plain full-batch
//! reference.
#![allow(dead_code)]

pub mod grid;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::loss::mse;
use candle_pipeline::{
    split_layers, Layer, LossReduction, Microbatches, Pipeline, PipelineWorker, Schedule, Stage,
    StepOutput,
};
use test_support::compare::diff;

/// Width of every layer.
pub const DIM: usize = 512;
/// Rows of the batch.
pub const ROWS: usize = 12;
/// Microbatches per step.
pub const MICROBATCHES: usize = 4;

/// Deterministic pseudo-random values in `[-scale, scale)` (a 64-bit LCG: identical in every
/// process, no RNG crate needed).
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn tensor(seed: u64, dims: &[usize], scale: f32) -> candle_core::Result<Tensor> {
    Tensor::from_vec(
        values(seed, dims.iter().product(), scale),
        dims,
        &Device::Cpu,
    )
}

/// `n` layers `tanh(x W + b)` (the last without tanh). With `fail_at = Some((layer, call))`,
/// layer `layer` returns an error on its `call`-th forward (0-based).
pub fn mlp(
    n: usize,
    fail_at: Option<(usize, usize)>,
) -> candle_core::Result<(Vec<Layer>, Vec<Var>)> {
    let mut layers = vec![];
    let mut all = vec![];
    for i in 0..n {
        let w = Var::from_tensor(&tensor(100 + i as u64, &[DIM, DIM], 0.5)?)?;
        let b = Var::from_tensor(&tensor(200 + i as u64, &[DIM], 0.1)?)?;
        all.push(w.clone());
        all.push(b.clone());
        let last = i + 1 == n;
        let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
        let calls = Arc::new(AtomicUsize::new(0));
        layers.push(Layer::new(vec![w, b], move |x| {
            let call = calls.fetch_add(1, Ordering::SeqCst);
            if fail_at == Some((i, call)) {
                candle_core::bail!("layer {i} failed on purpose at call {call}");
            }
            let y = x.matmul(&wt)?.broadcast_add(&bt)?;
            if last {
                Ok(y)
            } else {
                y.tanh()
            }
        }));
    }
    Ok((layers, all))
}

/// The batch: inputs and targets, split into [`MICROBATCHES`] microbatches.
pub fn batch() -> anyhow::Result<(Tensor, Tensor, Microbatches)> {
    let x = tensor(1, &[ROWS, DIM], 1.0)?;
    let t = tensor(2, &[ROWS, DIM], 1.0)?;
    let mb = Microbatches::split(&x, &t, MICROBATCHES, LossReduction::Mean)?;
    Ok((x, t, mb))
}

/// The schedules checked, with their virtual stages per worker.
pub fn schedules(workers: usize) -> anyhow::Result<Vec<(Schedule, usize)>> {
    Ok(vec![
        (Schedule::gpipe(workers, MICROBATCHES)?, 1),
        (Schedule::one_f_one_b(workers, MICROBATCHES)?, 1),
        (Schedule::interleaved(workers, 2, MICROBATCHES)?, 2),
    ])
}

/// The whole pipeline of `workers` workers with `v` stages each, and its step in this process
/// on [`batch`] under `sched`.
pub fn single_process(
    workers: usize,
    v: usize,
    sched: &Schedule,
) -> anyhow::Result<(Pipeline, StepOutput)> {
    let pipe = pipeline(workers, v, None)?;
    let (_, _, batch) = batch()?;
    let out = pipe.step(sched, &batch)?;
    Ok((pipe, out))
}

/// The whole pipeline: one layer per virtual stage, `workers * v` stages on CPU workers.
pub fn pipeline(
    workers: usize,
    v: usize,
    fail_at: Option<(usize, usize)>,
) -> anyhow::Result<Pipeline> {
    let (layers, _) = mlp(workers * v, fail_at)?;
    pipeline_of(layers, workers)
}

/// A pipeline of `workers` CPU workers over `layers`, one layer per virtual stage (the layers
/// keep their variables: the pipeline and the layers share them).
pub fn pipeline_of(layers: Vec<Layer>, workers: usize) -> anyhow::Result<Pipeline> {
    let ranges: Vec<_> = (0..layers.len()).map(|i| i..i + 1).collect();
    let stages = split_layers(layers, &ranges)?
        .into_iter()
        .map(|s| Box::new(s) as Box<dyn Stage>)
        .collect();
    Ok(Pipeline::new(stages, vec![Device::Cpu; workers], mse)?)
}

/// Gradients of `worker`'s parameters (stage by stage, var by var) as flat f32 vectors.
pub fn worker_grads(worker: &PipelineWorker, grads: &GradStore) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut out = vec![];
    for vs in worker.local_stages() {
        let stage = worker
            .stage(vs)
            .ok_or_else(|| anyhow::anyhow!("stage {vs} missing"))?;
        for v in stage.vars() {
            let g = grads
                .get(v.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("stage {vs}: no gradient"))?;
            out.push(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
    }
    Ok(out)
}

/// The plain model on the full batch: loss and the gradients of every layer's parameters in
/// layer order (`[w0, b0, w1, b1, ...]`).
pub fn plain(n_layers: usize) -> anyhow::Result<(f64, Vec<Vec<f32>>)> {
    let (layers, vars) = mlp(n_layers, None)?;
    let (x, t, _) = batch()?;
    let mut h = x;
    for l in &layers {
        h = l.forward(&h)?;
    }
    let l = mse(&h, &t)?;
    let grads = l.backward()?;
    let loss = l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let g = vars
        .iter()
        .map(|v| {
            let g = grads
                .get(v.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no gradient"))?;
            Ok(g.flatten_all()?.to_vec1::<f32>()?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((loss, g))
}

/// The plain gradients of `worker`'s layers (one layer per virtual stage), in
/// [`worker_grads`]'s order.
pub fn plain_for_worker(plain: &[Vec<f32>], worker: &PipelineWorker) -> Vec<Vec<f32>> {
    worker
        .local_stages()
        .into_iter()
        .flat_map(|vs| [plain[2 * vs].clone(), plain[2 * vs + 1].clone()])
        .collect()
}

/// Max |a - b| / max |b| over all tensors together (NaN-aware: test-support's `diff`).
pub fn rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(b).all(|(x, y)| x.len() == y.len()));
    let flat = |v: &[Vec<f32>]| -> Vec<f64> { v.iter().flatten().map(|&x| f64::from(x)).collect() };
    diff(&flat(a), &flat(b))
        .unwrap_or_else(|e| panic!("{e}"))
        .rel()
}
