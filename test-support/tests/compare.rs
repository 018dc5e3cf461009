//! The comparison helpers catch a NaN or an infinity wherever it sits (not only at element 0,
//! where Candle's `abs().max_all()` happens to see it), and measure finite differences exactly.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;
use test_support::compare::{
    assert_bits_eq, assert_close, diff, grads_rel_err, rel_err, values, Diff,
};
use test_support::random::{rng, uniform};

/// Element `i` of `n` smooth values replaced by `bad`.
fn with_bad(n: usize, i: usize, bad: f64) -> Vec<f64> {
    let mut v: Vec<f64> = (0..n).map(|k| (k as f64 * 0.37).sin()).collect();
    v[i] = bad;
    v
}

fn panics(f: impl FnOnce()) -> bool {
    catch_unwind(AssertUnwindSafe(f)).is_err()
}

#[test]
fn helpers_catch_nan_and_inf_at_any_index() {
    let dev = Device::Cpu;
    let mut rng = rng(4);
    let n = 97;
    let clean = with_bad(n, 0, 0.0);
    let t = |v: &[f64]| Tensor::from_slice(v, n, &dev).unwrap();
    for trial in 0..12 {
        // Never element 0: there Candle's max_all would propagate a NaN by luck.
        let i = rng.random_range(1..n);
        let bad = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][trial % 3];
        let poisoned = with_bad(n, i, bad);
        for (a, b) in [(&poisoned, &clean), (&clean, &poisoned)] {
            assert!(diff(a, b).is_err(), "{bad} at {i} passed");
            for dtype in [DType::F32, DType::F64] {
                let (ta, tb) = (t(a).to_dtype(dtype).unwrap(), t(b).to_dtype(dtype).unwrap());
                assert!(panics(|| {
                    rel_err(&ta, &tb);
                }));
                assert!(panics(|| assert_close(&ta, &tb, 1.0, "x")));
                assert!(panics(|| assert_bits_eq(&ta, &tb, "x")));
            }
        }
        // A NaN on both sides at the same place still fails; equal infinities compare equal.
        if bad.is_nan() {
            assert!(diff(&poisoned, &poisoned).is_err());
        } else {
            assert_eq!(diff(&poisoned, &poisoned).map(|r| r.max_abs), Ok(0.0));
        }
    }
    // Finite values are still compared: a small difference is measured, and found.
    let mut near = clean.clone();
    near[50] += 1e-3;
    let max_ref = clean.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let d = diff(&near, &clean).unwrap();
    assert_eq!(d.at, 50);
    assert!((d.max_abs - 1e-3).abs() < 1e-12 && d.max_ref == max_ref);
    assert!((rel_err(&t(&near), &t(&clean)) - 1e-3 / max_ref).abs() < 1e-12);
    assert_close(&t(&near), &t(&clean), 1.01e-3 / max_ref, "near");
    assert!(panics(|| assert_close(
        &t(&near),
        &t(&clean),
        0.99e-3 / max_ref,
        "near"
    )));
    assert!(diff(&near, &clean[1..]).is_err(), "lengths differ");
}

#[test]
fn diff_of_an_all_zero_reference_is_finite() {
    let d = diff(&[1e-13, 0.0], &[0.0, 0.0]).unwrap();
    assert_eq!(
        d,
        Diff {
            max_abs: 1e-13,
            at: 0,
            max_ref: 0.0
        }
    );
    assert!((d.rel() - 0.1).abs() < 1e-15);
}

#[test]
fn gradient_comparison_catches_nan_and_inf_anywhere() {
    let dev = Device::Cpu;
    let mut rng = rng(11);
    let vars: Vec<Var> = [[4, 6], [6, 6], [6, 1]]
        .iter()
        .map(|s| Var::from_tensor(&uniform(&mut rng, s, -1.0, 1.0, &dev)).unwrap())
        .collect();
    let mut want = GradStore::default();
    for v in &vars {
        want.insert(v.as_tensor(), uniform(&mut rng, v.dims(), -1.0, 1.0, &dev));
    }
    assert_eq!(grads_rel_err(&vars, &want, &want), 0.0);
    for trial in 0..12 {
        let which = rng.random_range(0..vars.len());
        let g = want.get(vars[which].as_tensor()).unwrap();
        let at = rng.random_range(1..g.elem_count());
        let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][trial % 3];
        let mut v: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
        v[at] = bad;
        let poisoned = Tensor::from_vec(v, g.shape(), &dev).unwrap();
        let mut got = GradStore::default();
        for var in &vars {
            got.insert(var.as_tensor(), want.get(var.as_tensor()).unwrap().clone());
        }
        got.insert(vars[which].as_tensor(), poisoned);
        for (a, b) in [(&got, &want), (&want, &got)] {
            assert!(
                panics(|| {
                    grads_rel_err(&vars, a, b);
                }),
                "{bad} at element {at} of var {which} passed"
            );
        }
    }
    // A missing gradient fails too.
    let mut partial = GradStore::default();
    partial.insert(
        vars[0].as_tensor(),
        want.get(vars[0].as_tensor()).unwrap().clone(),
    );
    assert!(panics(|| {
        grads_rel_err(&vars, &partial, &want);
    }));
}

#[test]
fn values_widen_every_float_dtype_exactly() {
    let t = Tensor::new(&[1.5f32, -0.25, 3.0], &Device::Cpu).unwrap();
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        assert_eq!(values(&t.to_dtype(dt).unwrap()), vec![1.5, -0.25, 3.0]);
    }
}
