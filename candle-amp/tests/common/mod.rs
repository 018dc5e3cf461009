//! Shared helpers for the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Uniform values in `[lo, hi)` from a seeded host RNG (Candle's CPU RNG cannot be seeded).
pub fn uniform(seed: u64, shape: &[usize], lo: f32, hi: f32, dev: &Device) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| lo + (hi - lo) * rng.random::<f32>())
        .collect();
    Tensor::from_vec(v, shape, dev).expect("tensor")
}

/// A fresh f32 `Var` with seeded uniform values.
pub fn var(seed: u64, shape: &[usize], dev: &Device) -> Var {
    Var::from_tensor(&uniform(seed, shape, -1.0, 1.0, dev)).expect("var")
}

/// The values of a tensor as a flat f32 vector.
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("to_vec")
}

/// A tensor of the given shape filled with `v` except one element, which is `bad`: an index
/// other than 0 drawn from `seed` (Candle's `max_all` keeps a NaN only at element 0, so a
/// check built on it would pass a test that poisons element 0 only).
pub fn poisoned(shape: &[usize], v: f32, bad: f32, seed: u64, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    assert!(n >= 2, "poisoned needs at least 2 elements");
    let mut data = vec![v; n];
    data[ChaCha8Rng::seed_from_u64(seed).random_range(1..n)] = bad;
    Tensor::from_vec(data, shape, dev).expect("tensor")
}

/// A [`candle_amp::ScaledUpdate`] that changes nothing and records the coefficients it was
/// applied with (its norm is the trait's default).
#[derive(Debug, Default)]
pub struct Record {
    pub coefs: Vec<f64>,
}

impl candle_amp::ScaledUpdate for Record {
    type Error = candle_core::Error;

    fn apply(
        &mut self,
        _: &candle_core::backprop::GradStore,
        _: &[Var],
        coef: f64,
    ) -> candle_core::Result<()> {
        self.coefs.push(coef);
        Ok(())
    }
}
