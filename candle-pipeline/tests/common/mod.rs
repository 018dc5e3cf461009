//! The pipeline tests' model: a tiny MLP stack of [`Layer`]s with seeded host-side init, and
//! its plain full-batch loss and gradients (comparisons and random data: `test-support`).
#![allow(dead_code)]

use candle_core::{backprop::GradStore, DType, Device, Tensor, Var};
use candle_pipeline::Layer;
use test_support::random::{rng, uniform, var};

/// Width of every layer.
pub const DIM: usize = 6;

/// `n` layers `tanh(x W + b)` (the last one without tanh) and all their vars, `[w0, b0, ...]`.
pub fn mlp(n: usize, seed: u64, dev: &Device) -> (Vec<Layer>, Vec<Var>) {
    let mut rng = rng(seed);
    let mut layers = vec![];
    let mut all = vec![];
    for i in 0..n {
        let w = var(&uniform(&mut rng, &[DIM, DIM], -0.6, 0.6, dev));
        let b = var(&uniform(&mut rng, &[DIM], -0.1, 0.1, dev));
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

/// Inputs and targets of `rows` rows, uniform in [-1, 1), from `seed`.
pub fn batch(seed: u64, rows: usize, dev: &Device) -> (Tensor, Tensor) {
    let mut rng = rng(seed);
    let x = uniform(&mut rng, &[rows, DIM], -1.0, 1.0, dev);
    (x, uniform(&mut rng, &[rows, DIM], -1.0, 1.0, dev))
}

/// Sum of squared errors.
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
