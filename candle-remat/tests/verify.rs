//! Verify mode names the first bad segment in forward order, and the tests' comparison helpers
//! catch a NaN or an infinity wherever it sits (not only at element 0, where Candle's
//! `abs().max_all()` happens to see it).

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use candle_remat::{RematError, Tape};
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `tanh(x W + k * 1e-3)` where `k` counts the calls: every run gives different values.
fn drifting(x: &Tensor, w: &Tensor, calls: &AtomicU64) -> candle_core::Result<Tensor> {
    let k = calls.fetch_add(1, Ordering::SeqCst) as f64;
    (x.matmul(w)? + k * 1e-3)?.tanh()
}

fn mismatch_segment(r: candle_remat::Result<candle_core::backprop::GradStore>) -> String {
    match r {
        Err(RematError::RecomputeMismatch { segment, .. }) => segment,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("verify mode accepted non-deterministic segments"),
    }
}

#[test]
fn verify_names_the_first_of_two_bad_segments() {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let w = var(&mut rng, &[6, 6], 0.5, DType::F32, &dev).unwrap();
    let x = randn(&mut rng, &[3, 6], 1.0, DType::F32, &dev).unwrap();
    let w = w.as_tensor();
    let (c1, c3) = (AtomicU64::new(0), AtomicU64::new(0));
    // Segments 1 and 3 of 0..4 recompute different values; the backward meets 3 first.
    let tape = Tape::new(0).with_verify(true);
    let mut h = x.clone();
    for i in 0..4 {
        let (c1, c3) = (&c1, &c3);
        h = tape
            .checkpoint1(&h, move |x| match i {
                1 => drifting(x, w, c1),
                3 => drifting(x, w, c3),
                _ => x.matmul(w)?.tanh(),
            })
            .unwrap();
    }
    let err = tape.backward(&h.sum_all().unwrap());
    assert_eq!(mismatch_segment(err), "1");
    // Both were recomputed: the backward went on past segment 3.
    assert_eq!(
        (c1.load(Ordering::SeqCst), c3.load(Ordering::SeqCst)),
        (2, 2)
    );
}

#[test]
fn verify_names_a_nested_segment_before_its_parent_and_later_ones() {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let w = var(&mut rng, &[6, 6], 0.5, DType::F32, &dev).unwrap();
    let x = randn(&mut rng, &[3, 6], 1.0, DType::F32, &dev).unwrap();
    let w = w.as_tensor();
    let (inner, later) = (AtomicU64::new(0), AtomicU64::new(0));
    let tape = Tape::new(0).with_verify(true);
    // Segment 0 holds 0/0 (deterministic) and 0/1 (not): 0/1 and 0 itself differ on
    // recompute; top-level segment 1 differs too. The first values that differ in forward
    // order are 0/1's.
    let inner_ref = &inner;
    let h = tape
        .checkpoint_nested(&[&x], move |t, xs| {
            let a = t.checkpoint1(&xs[0], move |x| x.matmul(w)?.tanh())?;
            let b = t.checkpoint1(&a, move |x| drifting(x, w, inner_ref))?;
            Ok(vec![b])
        })
        .unwrap()
        .remove(0);
    let h = tape.checkpoint1(&h, |x| drifting(x, w, &later)).unwrap();
    assert_eq!(
        mismatch_segment(tape.backward(&h.sum_all().unwrap())),
        "0/1"
    );
}

/// Element `i` of a vector of `n` smooth values replaced by `bad`.
fn with_bad(n: usize, i: usize, bad: f64) -> Vec<f64> {
    let mut v: Vec<f64> = (0..n).map(|k| (k as f64 * 0.37).sin()).collect();
    v[i] = bad;
    v
}

#[test]
fn helpers_catch_nan_and_inf_at_any_index() {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let n = 97;
    let clean = with_bad(n, 0, 0.0);
    let t = |v: &[f64]| Tensor::from_slice(v, n, &dev).unwrap();
    for trial in 0..12 {
        // Never element 0: there Candle's max_all would propagate a NaN by luck.
        let i = rng.random_range(1..n);
        let bad = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][trial % 3];
        let poisoned = with_bad(n, i, bad);
        for (a, b) in [(&poisoned, &clean), (&clean, &poisoned)] {
            assert!(compare_finite(a, b).is_err(), "{bad} at {i} passed");
            for dtype in [DType::F32, DType::F64] {
                let (ta, tb) = (t(a).to_dtype(dtype).unwrap(), t(b).to_dtype(dtype).unwrap());
                let r = catch_unwind(AssertUnwindSafe(|| rel_err(&ta, &tb)));
                assert!(r.is_err(), "rel_err: {bad} at {i} ({dtype:?}) passed");
                let r = catch_unwind(AssertUnwindSafe(|| assert_bits_eq(&ta, &tb, "x")));
                assert!(
                    r.is_err(),
                    "assert_bits_eq: {bad} at {i} ({dtype:?}) passed"
                );
            }
        }
        // A NaN on both sides at the same place still fails; equal infinities compare equal.
        if bad.is_nan() {
            assert!(compare_finite(&poisoned, &poisoned).is_err());
        } else {
            assert_eq!(compare_finite(&poisoned, &poisoned).map(|r| r.0), Ok(0.0));
        }
    }
    // Finite values are still compared: a small difference is measured, not hidden.
    let mut near = clean.clone();
    near[50] += 1e-3;
    let (d, m) = compare_finite(&near, &clean).unwrap();
    assert!((d - 1e-3).abs() < 1e-12 && m == max_abs(&clean));
    assert!((rel_err(&t(&near), &t(&clean)) - 1e-3 / m).abs() < 1e-12);
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}
