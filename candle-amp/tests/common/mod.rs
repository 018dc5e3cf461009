//! The amp tests' own helpers: a seeded variable, gradients with a NaN or an infinity written in,
//! and a recording update (seeded data and comparisons come from `test-support`).
#![allow(dead_code)]

use candle_core::{Device, Tensor, Var};
use rand::Rng;
use test_support::random::{rng, uniform, var};

/// A fresh f32 `Var` of `shape` with values uniform in [-1, 1) from `seed`.
pub fn seeded_var(seed: u64, shape: &[usize], dev: &Device) -> Var {
    var(&uniform(&mut rng(seed), shape, -1.0, 1.0, dev))
}

/// A tensor of the given shape filled with `v` except one element, which is `bad`: an index
/// other than 0 drawn from `seed` (Candle's `max_all` keeps a NaN only at element 0, so a
/// check built on it would pass a test that poisons element 0 only).
pub fn poisoned(shape: &[usize], v: f32, bad: f32, seed: u64, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    assert!(n >= 2, "poisoned needs at least 2 elements");
    let mut data = vec![v; n];
    data[rng(seed).random_range(1..n)] = bad;
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
