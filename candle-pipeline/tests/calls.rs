//! Stages told which microbatch they run for ([`Call`]), and layers recomputed inside a stage
//! ([`Sequential::with_recompute`]).
//!
//! A "dropout" layer keyed by `call.key` and the global row (`call.row + r`) draws the same mask
//! for a row whichever microbatch holds it, so a pipeline step equals the full batch computed
//! in one go with the same per-row masks. Tolerance 1e-5 relative, as in `equivalence.rs`
//! (only the order of f32 sums differs); recomputed stages are compared with the same pipeline
//! without recompute bit for bit (the same ops on the same values, one pass per range).

#![allow(clippy::single_range_in_vec_init)] // ranges of layers, as `with_recompute` takes

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use candle_nn::loss::mse;
use candle_pipeline::{
    split_layers, Call, Layer, LossReduction, Microbatches, Pipeline, Schedule, Sequential, Stage,
};
use common::*;
use test_support::compare::{grads_rel_err, values};

const TOL: f64 = 1e-5;

/// A keep mask `[rows, DIM]` (0 or 2, p = 0.5) for global rows `row..row + rows`, a pure
/// function of `(key, global row, column)`.
fn mask(key: u64, row: usize, rows: usize, dev: &Device) -> candle_core::Result<Tensor> {
    let v: Vec<f32> = (0..rows * DIM)
        .map(|i| {
            let (r, c) = ((row + i / DIM) as u64, (i % DIM) as u64);
            let mut z = key ^ r.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c.wrapping_mul(0xBF58_476D);
            z ^= z >> 29;
            z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
            if (z >> 40) & 1 == 0 {
                0.0
            } else {
                2.0
            }
        })
        .collect();
    Tensor::from_vec(v, (rows, DIM), dev)
}

/// The MLP with a keyed dropout after every hidden layer; counts the forward calls.
fn dropout_mlp(
    n: usize,
    seed: u64,
    dev: &Device,
    calls: Arc<AtomicUsize>,
) -> (Vec<Layer>, Vec<Var>) {
    let (base, vars) = mlp(n, seed, dev);
    let layers = base
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let vars = l.vars().to_vec();
            let calls = calls.clone();
            Layer::with_call(vars, move |x, call: &Call| {
                calls.fetch_add(1, Ordering::SeqCst);
                let y = l.forward_call(x, call)?;
                if i + 1 == n {
                    return Ok(y);
                }
                let key = call.key ^ (i as u64).wrapping_mul(0x1234_5677);
                let m = mask(key, call.row, y.dim(0)?, y.device())?;
                y * m
            })
        })
        .collect();
    (layers, vars)
}

fn stages(layers: &[Layer], n: usize, recompute: bool) -> Vec<Box<dyn Stage>> {
    let ranges = candle_pipeline::balance_by_params(layers, n).unwrap();
    split_layers(layers.to_vec(), &ranges)
        .unwrap()
        .into_iter()
        .map(|s: Sequential| {
            let len = s.layers().len();
            let s = if recompute && len >= 2 {
                // Two recomputed runs with a kept layer between where possible.
                let r = if len >= 3 {
                    vec![0..1, 2..len]
                } else {
                    vec![0..len]
                };
                s.with_recompute(r).unwrap()
            } else {
                s
            };
            Box::new(s) as Box<dyn Stage>
        })
        .collect()
}

#[test]
fn keyed_masks_and_recompute_match_the_full_batch() {
    let dev = Device::Cpu;
    let calls = Arc::new(AtomicUsize::new(0));
    let (layers, vars) = dropout_mlp(8, 3, &dev, calls.clone());
    let (x, t) = batch(5, 11, &dev);
    let key = 0xD00D;
    // Full batch in one go: one call with the key, rows from 0.
    let full = Call {
        key,
        ..Call::default()
    };
    let mut h = x.clone();
    for l in &layers {
        h = l.forward_call(&h, &full).unwrap();
    }
    let l = mse(&h, &t).unwrap();
    let ref_loss = l.to_scalar::<f32>().unwrap() as f64;
    let ref_grads = l.backward().unwrap();
    for (s, sched, v) in [
        (2, Schedule::gpipe(2, 3).unwrap(), 1),
        (2, Schedule::one_f_one_b(2, 4).unwrap(), 1),
        (2, Schedule::interleaved(2, 2, 4).unwrap(), 2),
    ] {
        let m = sched.microbatches;
        let batch = Microbatches::split(&x, &t, m, LossReduction::Mean)
            .unwrap()
            .with_key(key);
        let run = |recompute: bool| {
            let pipe = Pipeline::new(stages(&layers, s * v, recompute), vec![dev.clone(); s], mse)
                .unwrap();
            calls.store(0, Ordering::SeqCst);
            let out = pipe.step(&sched, &batch).unwrap();
            (out, calls.load(Ordering::SeqCst))
        };
        let (plain, plain_calls) = run(false);
        assert!(
            (plain.loss - ref_loss).abs() / ref_loss <= TOL,
            "{sched:?}: loss"
        );
        let err = grads_rel_err(&vars, &plain.grads, &ref_grads);
        assert!(err <= TOL, "{sched:?}: grads {err:e}");
        assert_eq!(plain_calls, 8 * m, "every layer runs once per microbatch");

        let (re, re_calls) = run(true);
        assert!(
            re_calls > plain_calls,
            "recomputed layers run again in backward"
        );
        assert_eq!(re.loss, plain.loss);
        for (i, v) in vars.iter().enumerate() {
            let (a, b) = (re.grads.get(v.as_tensor()), plain.grads.get(v.as_tensor()));
            assert_eq!(
                values(a.unwrap()),
                values(b.unwrap()),
                "{sched:?}: var {i}: recompute differs"
            );
        }
    }
}

#[test]
fn without_the_row_the_masks_differ() {
    // The check above can fail: a layer that ignores `call.row` draws every microbatch's mask
    // from row 0, and the gradients leave the full batch's.
    let dev = Device::Cpu;
    let (base, vars) = mlp(4, 9, &dev);
    let layers: Vec<Layer> = base
        .into_iter()
        .map(|l| {
            let vars = l.vars().to_vec();
            Layer::with_call(vars, move |x, call: &Call| {
                let y = l.forward_call(x, call)?;
                let m = mask(call.key, 0, y.dim(0)?, y.device())?;
                y * m
            })
        })
        .collect();
    let (x, t) = batch(6, 8, &dev);
    let full = Call {
        key: 1,
        ..Call::default()
    };
    let mut h = x.clone();
    for l in &layers {
        h = l.forward_call(&h, &full).unwrap();
    }
    let ref_grads = mse(&h, &t).unwrap().backward().unwrap();
    let batch = Microbatches::split(&x, &t, 4, LossReduction::Mean)
        .unwrap()
        .with_key(1);
    let pipe = Pipeline::new(stages(&layers, 2, false), vec![dev.clone(); 2], mse).unwrap();
    let out = pipe.step(&Schedule::gpipe(2, 4).unwrap(), &batch).unwrap();
    assert!(grads_rel_err(&vars, &out.grads, &ref_grads) > 1e-3);
}

#[test]
fn bad_recompute_ranges_are_refused() {
    let (layers, _) = mlp(3, 1, &Device::Cpu);
    for r in [vec![1..1], vec![0..2, 1..3], vec![2..3, 0..1], vec![0..4]] {
        let e = Sequential::new(layers.clone()).with_recompute(r.clone());
        assert!(e.is_err(), "{r:?} accepted");
    }
}
