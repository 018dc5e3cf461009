//! Shared helpers: a tiny MLP stack with seeded host-side init and the full-batch reference.
#![allow(dead_code)]

use candle_core::{backprop::GradStore, DType, Device, Tensor, Var};
use candle_pipeline::Layer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const DIM: usize = 6;

pub fn randn(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape, dev).unwrap()
}

/// `n` layers `tanh(x W + b)` (the last one without tanh) and all their vars.
pub fn mlp(n: usize, seed: u64, dev: &Device) -> (Vec<Layer>, Vec<Var>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut layers = vec![];
    let mut all = vec![];
    for i in 0..n {
        let w = Var::from_tensor(&randn(&mut rng, &[DIM, DIM], 0.6, dev)).unwrap();
        let b = Var::from_tensor(&randn(&mut rng, &[DIM], 0.1, dev)).unwrap();
        all.push(w.clone());
        all.push(b.clone());
        let last = i + 1 == n;
        let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
        layers.push(Layer::new(vec![w, b], move |x| {
            let y = x.matmul(&wt)?.broadcast_add(&bt)?;
            if last {
                Ok(y)
            } else {
                y.tanh()
            }
        }));
    }
    (layers, all)
}

pub fn mse(y: &Tensor, t: &Tensor) -> candle_core::Result<Tensor> {
    (y - t)?.sqr()?.mean_all()
}

pub fn sse(y: &Tensor, t: &Tensor) -> candle_core::Result<Tensor> {
    (y - t)?.sqr()?.sum_all()
}

/// Plain single-device full-batch loss and gradients.
pub fn reference(
    layers: &[Layer],
    x: &Tensor,
    t: &Tensor,
    loss: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> (f64, GradStore) {
    let mut h = x.clone();
    for l in layers {
        h = l.forward(&h).unwrap();
    }
    let l = loss(&h, t).unwrap();
    let v = l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    (v, l.backward().unwrap())
}

/// The values of a tensor (any float dtype) as a flat f64 vector.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("tensor values")
}

/// NaN-aware comparison of `a` with the reference `b`, element by element on the host:
/// `(max |a - b|, max |b|)` over the finite values, or a description of the first bad element.
///
/// A NaN on either side is an error, and so is a non-finite value the other side does not
/// hold (an infinity against a finite value or the opposite infinity). Candle's
/// `abs().max_all()` cannot do this: its max keeps the running value when it meets a NaN, so
/// a NaN anywhere but at element 0 vanishes.
pub fn compare_finite(a: &[f64], b: &[f64]) -> Result<(f64, f64), String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if x.is_nan() || y.is_nan() {
            return Err(format!("NaN at element {i}: {x:e} vs {y:e}"));
        }
        if x.is_finite() && y.is_finite() {
            diff = diff.max((x - y).abs());
            scale = scale.max(y.abs());
        } else if x != y {
            return Err(format!(
                "non-finite mismatch at element {i}: {x:e} vs {y:e}"
            ));
        }
    }
    Ok((diff, scale))
}

/// Max |a - b| / max |b| over every var; panics if a var lacks a gradient, or on a NaN or a
/// non-finite mismatch anywhere in a gradient (see [`compare_finite`]).
pub fn max_rel_err(vars: &[Var], got: &GradStore, want: &GradStore) -> f64 {
    let mut worst: f64 = 0.0;
    for (i, v) in vars.iter().enumerate() {
        let g = got
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("var {i}: no gradient"));
        let r = want
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("var {i}: no reference"));
        assert_eq!(g.dims(), r.dims(), "var {i}: shapes differ");
        let (diff, scale) = compare_finite(&values(g), &values(r))
            .unwrap_or_else(|e| panic!("var {i}: non-finite gradient: {e}"));
        worst = worst.max(diff / scale.max(1e-12));
    }
    worst
}
