//! Pipeline steps give the single-device full-batch loss and gradients.
//!
//! Tolerance: 1e-5 relative (max |diff| / max |reference| per parameter, f32). The pipeline
//! computes the same math in a different summation order (per-microbatch partial sums, weights
//! `rows_k / rows`), which changes f32 rounding by a few ulps of the gradient scale.

mod common;

use candle_core::{Device, Tensor};
use candle_nn::loss::mse;
use candle_pipeline::{split_layers, LossReduction, Microbatches, Pipeline, Schedule, Stage};
use common::*;
use test_support::compare::grads_rel_err;
use test_support::random::{rng, uniform};

const TOL: f64 = 1e-5;

fn schedules(s: usize, m: usize) -> Vec<(Schedule, usize)> {
    vec![
        (Schedule::gpipe(s, m).unwrap(), 1),
        (Schedule::one_f_one_b(s, m).unwrap(), 1),
        (Schedule::interleaved(s, 2, m).unwrap(), 2),
        (Schedule::circular(s, 2, m).unwrap(), 2),
    ]
}

fn stages_for(layers: &[candle_pipeline::Layer], n_stages: usize) -> Vec<Box<dyn Stage>> {
    let ranges = candle_pipeline::balance_by_params(layers, n_stages).unwrap();
    split_layers(layers.to_vec(), &ranges)
        .unwrap()
        .into_iter()
        .map(|s| Box::new(s) as Box<dyn Stage>)
        .collect()
}

/// Per worker, the most `(microbatch, stage)` activations held at once by definition of the
/// schedule: each forward keeps one until its backward. Counted here from the action lists,
/// independently of the executor's stash and of the simulator.
fn held_peak(sched: &Schedule) -> Vec<usize> {
    sched
        .actions
        .iter()
        .map(|list| {
            let (mut held, mut peak) = (0usize, 0usize);
            for a in list {
                if a.is_forward() {
                    held += 1;
                    peak = peak.max(held);
                } else {
                    held -= 1;
                }
            }
            peak
        })
        .collect()
}

#[test]
fn every_schedule_matches_full_batch() {
    let dev = Device::Cpu;
    let (layers, vars) = mlp(8, 1, &dev);
    // 11 rows: every m in {3, 8} gives uneven microbatches.
    let (x, t) = batch(7, 11, &dev);
    let (ref_loss, ref_grads) = reference(&layers, &x, &t, mse);
    let mut checked = 0;
    let mut worst = (0.0f64, 0.0f64);
    for s in [1, 2, 4] {
        for m in [1, 3, 8] {
            for (sched, v) in schedules(s, m) {
                let pipe = Pipeline::new(stages_for(&layers, s * v), vec![dev.clone(); s], mse)
                    .unwrap()
                    .with_cpu_threads(1)
                    .unwrap();
                let batch = Microbatches::split(&x, &t, m, LossReduction::Mean).unwrap();
                let out = pipe.step(&sched, &batch).unwrap();
                let lerr = (out.loss - ref_loss).abs() / ref_loss.abs();
                let gerr = grads_rel_err(&vars, &out.grads, &ref_grads);
                assert!(
                    lerr <= TOL,
                    "{} S={s} m={m}: loss rel err {lerr:e}",
                    sched.name
                );
                assert!(
                    gerr <= TOL,
                    "{} S={s} m={m}: grad rel err {gerr:e}",
                    sched.name
                );
                assert_eq!(
                    out.grads.get_ids().count(),
                    vars.len(),
                    "only parameter grads"
                );
                // The executor's peak (its stash of kept activations) against the schedule's
                // definition: closed forms where there is one, the running count of the
                // worker's action list always.
                let want_peak: Vec<usize> = match sched.name.as_str() {
                    "gpipe" => vec![m; s],
                    "1f1b" => (0..s).map(|st| (s - st).min(m)).collect(),
                    // Every forward (m microbatches through v chunks) before any backward.
                    "circular" => vec![m * v; s],
                    // Full groups of S microbatches: Megatron's warm-up 2 (S - w - 1) + (v - 1) S,
                    // then one more forward before the first backward.
                    "interleaved" if m % s == 0 => (0..s)
                        .map(|w| (2 * (s - w - 1) + (v - 1) * s + 1).min(m * v))
                        .collect(),
                    // A partial last group lengthens the warm-up (see Schedule::interleaved).
                    _ => held_peak(&sched),
                };
                assert_eq!(out.peak_in_flight, want_peak, "{} S={s} m={m}", sched.name);
                assert_eq!(
                    out.peak_in_flight,
                    held_peak(&sched),
                    "{} S={s} m={m}",
                    sched.name
                );
                worst = (worst.0.max(lerr), worst.1.max(gerr));
                assert_eq!(
                    out.timeline.spans.iter().map(Vec::len).sum::<usize>(),
                    2 * m * s * v
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 36);
    println!(
        "worst relative error over 36 runs: loss {:e}, gradients {:e}",
        worst.0, worst.1
    );
}

#[test]
fn uneven_chunks_and_sum_reduction() {
    let dev = Device::Cpu;
    let (layers, vars) = mlp(4, 2, &dev);
    let (x, t) = batch(8, 10, &dev);
    let sizes = candle_pipeline::chunk_sizes(10, 4).unwrap(); // 4, 4, 2
    assert_eq!(sizes, vec![4, 4, 2]);
    for (reduction, loss) in [
        (LossReduction::Mean, mse as fn(&Tensor, &Tensor) -> _),
        (LossReduction::Sum, sse),
    ] {
        let (ref_loss, ref_grads) = reference(&layers, &x, &t, loss);
        let pipe = Pipeline::new(stages_for(&layers, 2), vec![dev.clone(); 2], loss).unwrap();
        let batch = Microbatches::split_sizes(&x, &t, &sizes, reduction).unwrap();
        let out = pipe
            .step(&Schedule::one_f_one_b(2, 3).unwrap(), &batch)
            .unwrap();
        assert!(
            (out.loss - ref_loss).abs() / ref_loss.abs() <= TOL,
            "{reduction:?}"
        );
        assert!(
            grads_rel_err(&vars, &out.grads, &ref_grads) <= TOL,
            "{reduction:?}"
        );
    }
    // Without the row weighting (every microbatch weighted 1 with a mean loss) the gradients
    // are wrong: the check above can fail.
    let (_, ref_grads) = reference(&layers, &x, &t, mse);
    let pipe = Pipeline::new(stages_for(&layers, 2), vec![dev.clone(); 2], mse).unwrap();
    let batch = Microbatches::split_sizes(&x, &t, &sizes, LossReduction::Sum).unwrap();
    let out = pipe.step(&Schedule::gpipe(2, 3).unwrap(), &batch).unwrap();
    assert!(grads_rel_err(&vars, &out.grads, &ref_grads) > 0.1);
}

#[test]
fn cross_entropy_with_token_weights() {
    // Token-mean loss where microbatches hold different numbers of tokens: explicit weights.
    let dev = Device::Cpu;
    let (layers, vars) = mlp(4, 3, &dev);
    let mut rng = rng(9);
    let x = uniform(&mut rng, &[7, DIM], -1.0, 1.0, &dev);
    let labels: Vec<u32> = (0..7).map(|i| (i * 5 % DIM) as u32).collect();
    let t = Tensor::from_vec(labels, 7, &dev).unwrap();
    let ce = |y: &Tensor, t: &Tensor| candle_nn::loss::cross_entropy(y, t);
    let (ref_loss, ref_grads) = reference(&layers, &x, &t, ce);
    let sizes = [5usize, 2];
    let (mut xs, mut ts, mut ws) = (vec![], vec![], vec![]);
    let mut start = 0;
    for n in sizes {
        xs.push(x.narrow(0, start, n).unwrap());
        ts.push(t.narrow(0, start, n).unwrap());
        ws.push(n as f64 / 7.0);
        start += n;
    }
    let batch = Microbatches::with_weights(xs, ts, ws).unwrap();
    let pipe = Pipeline::new(stages_for(&layers, 2), vec![dev.clone(); 2], ce).unwrap();
    let out = pipe.step(&Schedule::gpipe(2, 2).unwrap(), &batch).unwrap();
    assert!((out.loss - ref_loss).abs() / ref_loss <= TOL);
    assert!(grads_rel_err(&vars, &out.grads, &ref_grads) <= TOL);
}

#[test]
fn forward_hook_wraps_every_stage_forward() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let dev = Device::Cpu;
    let (layers, vars) = mlp(4, 4, &dev);
    let (x, t) = batch(10, 6, &dev);
    let (_, ref_grads) = reference(&layers, &x, &t, mse);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let hook: Arc<dyn candle_pipeline::ForwardHook> = Arc::new(
        move |f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>, x: &Tensor| {
            c.fetch_add(1, Ordering::SeqCst);
            f(x)
        },
    );
    let stages: Vec<Box<dyn Stage>> = stages_for(&layers, 2)
        .into_iter()
        .map(|s| Box::new(candle_pipeline::Hooked::new(s, hook.clone())) as Box<dyn Stage>)
        .collect();
    let pipe = Pipeline::new(stages, vec![dev.clone(); 2], mse).unwrap();
    let batch = Microbatches::split(&x, &t, 3, LossReduction::Mean).unwrap();
    let out = pipe
        .step(&Schedule::one_f_one_b(2, 3).unwrap(), &batch)
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    assert!(grads_rel_err(&vars, &out.grads, &ref_grads) <= TOL);
}

#[test]
fn parameter_shared_across_stages_gets_the_summed_gradient() {
    // Tied weights (e.g. embedding and head) on two different workers.
    let dev = Device::Cpu;
    let (mut layers, mut vars) = mlp(4, 13, &dev);
    let mut rng = rng(14);
    let tied =
        candle_core::Var::from_tensor(&uniform(&mut rng, &[DIM, DIM], -0.5, 0.5, &dev)).unwrap();
    let (a, b) = (tied.as_tensor().clone(), tied.as_tensor().clone());
    layers.insert(
        0,
        candle_pipeline::Layer::new(vec![tied.clone()], move |x| x.matmul(&a)),
    );
    layers.push(candle_pipeline::Layer::new(vec![tied.clone()], move |x| {
        x.matmul(&b.t()?)
    }));
    vars.push(tied);
    let x = uniform(&mut rng, &[5, DIM], -1.0, 1.0, &dev);
    let t = uniform(&mut rng, &[5, DIM], -1.0, 1.0, &dev);
    let (ref_loss, ref_grads) = reference(&layers, &x, &t, mse);
    for (s, sched) in [
        (2, Schedule::one_f_one_b(2, 3).unwrap()),
        (3, Schedule::gpipe(3, 3).unwrap()),
    ] {
        let ranges = candle_pipeline::balance_by_params(&layers, s).unwrap();
        let stages: Vec<Box<dyn Stage>> = split_layers(layers.clone(), &ranges)
            .unwrap()
            .into_iter()
            .map(|st| Box::new(st) as Box<dyn Stage>)
            .collect();
        let pipe = Pipeline::new(stages, vec![dev.clone(); s], mse).unwrap();
        let batch = Microbatches::split(&x, &t, 3, LossReduction::Mean).unwrap();
        let out = pipe.step(&sched, &batch).unwrap();
        assert!((out.loss - ref_loss).abs() / ref_loss <= TOL);
        assert!(grads_rel_err(&vars, &out.grads, &ref_grads) <= TOL, "S={s}");
    }
}
