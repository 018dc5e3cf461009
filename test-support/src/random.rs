//! Seeded random test data (Candle's own CPU RNG cannot be seeded).
//!
//! Every generator is a [`ChaCha8Rng`]: the same seed gives the same values on every machine
//! and in every process (an MPI rank rebuilds exactly what its peers hold).

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
pub use rand_chacha::ChaCha8Rng;

/// A generator seeded with `seed`.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// An f32 tensor of `shape` on `dev` with values uniform in `[lo, hi)`.
pub fn uniform(rng: &mut ChaCha8Rng, shape: &[usize], lo: f32, hi: f32, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| lo + (hi - lo) * rng.random::<f32>())
        .collect();
    Tensor::from_vec(v, shape, dev).expect("uniform tensor")
}

/// A tensor of `shape` and `dtype` on `dev` with normal values of mean 0 and standard
/// deviation `std` (Box-Muller in f64, then converted).
pub fn normal(
    rng: &mut ChaCha8Rng,
    shape: &[usize],
    std: f64,
    dtype: DType,
    dev: &Device,
) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            let u1: f64 = rng.random::<f64>().max(1e-12);
            let u2: f64 = rng.random();
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        })
        .collect();
    Tensor::from_vec(v, shape, dev)
        .and_then(|t| t.to_dtype(dtype))
        .expect("normal tensor")
}

/// A fresh [`Var`] holding a copy of `t`.
pub fn var(t: &Tensor) -> Var {
    Var::from_tensor(t).expect("var")
}
