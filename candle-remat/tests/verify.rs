//! Verify mode: it names the segment whose recompute differs (the first in forward order) and
//! catches Candle's own unseeded dropout.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor, Var};
use candle_remat::{RematError, Tape};
use common::param;
use test_support::random::{normal, rng};

/// `tanh(x W + k * 1e-3)` where `k` counts the calls: every run gives different values.
fn drifting(x: &Tensor, w: &Tensor, calls: &AtomicU64) -> candle_core::Result<Tensor> {
    let k = calls.fetch_add(1, Ordering::SeqCst) as f64;
    (x.matmul(w)? + k * 1e-3)?.tanh()
}

/// A 6x6 weight and a 3x6 input from `seed`.
fn weight_and_input(seed: u64) -> (Var, Tensor) {
    let mut rng = rng(seed);
    let w = param(&mut rng, &[6, 6], 0.5, DType::F32, &Device::Cpu);
    (w, normal(&mut rng, &[3, 6], 1.0, DType::F32, &Device::Cpu))
}

fn mismatch_segment(r: candle_remat::Result<candle_core::backprop::GradStore>) -> String {
    match r {
        Err(RematError::RecomputeMismatch { segment, .. }) => segment,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("verify mode accepted non-deterministic segments"),
    }
}

#[test]
fn verify_mode_names_the_nondeterministic_segment() {
    let (w, x) = weight_and_input(1);
    let calls = AtomicU64::new(0);
    let tape = Tape::new(0).with_verify(true);
    let h = tape
        .checkpoint1(&x, |x| x.matmul(w.as_tensor())?.tanh())
        .unwrap();
    // Segment "1" is not deterministic: it adds a per-call offset.
    let h = tape
        .checkpoint1(&h, |x| drifting(x, w.as_tensor(), &calls))
        .unwrap();
    let h = tape
        .checkpoint1(&h, |x| x.matmul(w.as_tensor())?.tanh())
        .unwrap();
    let err = tape.backward(&h.sum_all().unwrap()).unwrap_err();
    match &err {
        RematError::RecomputeMismatch {
            segment,
            output,
            mismatches,
            ..
        } => {
            assert_eq!(segment, "1");
            assert_eq!(*output, 0);
            assert!(*mismatches > 0);
        }
        e => panic!("unexpected error {e}"),
    }
    assert!(err.to_string().contains("segment 1"), "{err}");

    // Candle's own (unseeded) dropout is caught too; ours is not flagged.
    let tape = Tape::new(0).with_verify(true);
    let h = tape
        .checkpoint1(&x, |x| {
            candle_nn::ops::dropout(&x.matmul(w.as_tensor())?, 0.5)
        })
        .unwrap();
    assert!(matches!(
        tape.backward(&h.sum_all().unwrap()),
        Err(RematError::RecomputeMismatch { .. })
    ));
    let tape = Tape::new(0).with_verify(true);
    let h = tape
        .checkpoint1(&x, |x| {
            Ok(candle_remat::dropout(&x.matmul(w.as_tensor())?, 0.5)?)
        })
        .unwrap();
    tape.backward(&h.sum_all().unwrap()).unwrap();
}

#[test]
fn verify_names_the_first_of_two_bad_segments() {
    let (w, x) = weight_and_input(2);
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
    let (w, x) = weight_and_input(3);
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
