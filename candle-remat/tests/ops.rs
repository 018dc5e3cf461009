//! Memory-lean ops against their composite Candle expressions: values and gradients, random
//! shapes, f32 and f64.
//!
//! Tolerances: forward values of attention and LayerNorm are computed with the same ops as the
//! composite, so they are compared bit for bit. Gradients use a different (analytic) formula,
//! so they are compared with max-abs-error relative to the largest gradient entry:
//! 1e-5 in f32 (a few ulps accumulated over reductions of length <= 64) and 1e-12 in f64.
//! GELU's forward is also the composite formula, so bit-identical.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_remat::ops::{attention, gelu, layer_norm};
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1e-12
    } else {
        1e-5
    }
}

#[test]
fn attention_matches_composite() {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    for dtype in [DType::F32, DType::F64] {
        for _ in 0..6 {
            let (b, h, t, d) = (
                rng.random_range(1..3),
                rng.random_range(1..4),
                rng.random_range(1..12),
                rng.random_range(1..9),
            );
            let tk = t + rng.random_range(0..3);
            for causal in [true, false] {
                let q = var(&mut rng, &[b, h, t, d], 1.0, dtype, &dev).unwrap();
                let k = var(&mut rng, &[b, h, tk, d], 1.0, dtype, &dev).unwrap();
                let v = var(&mut rng, &[b, h, tk, d + 1], 1.0, dtype, &dev).unwrap();
                let g = randn(&mut rng, &[b, h, t, d + 1], 1.0, dtype, &dev).unwrap();
                let scale = 1.0 / (d as f64).sqrt();
                let ours = attention::attention(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    scale,
                    causal,
                )
                .unwrap();
                let refr = attention::attention_composite(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    scale,
                    causal,
                )
                .unwrap();
                assert_bits_eq(&ours, &refr, "attention values");
                let go = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let gr = (refr * &g).unwrap().sum_all().unwrap().backward().unwrap();
                for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                    let e = rel_err(go.get(x).unwrap(), gr.get(x).unwrap());
                    assert!(
                        e < tol(dtype),
                        "{dtype:?} causal={causal} d{name}: rel err {e}"
                    );
                }
            }
        }
    }
}

#[test]
fn layer_norm_matches_composite() {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for dtype in [DType::F32, DType::F64] {
        for _ in 0..8 {
            let c = rng.random_range(2..40);
            let shape: Vec<usize> = match rng.random_range(0..3) {
                0 => vec![rng.random_range(1..9), c],
                1 => vec![rng.random_range(1..4), rng.random_range(1..6), c],
                _ => vec![c],
            };
            let x = var(&mut rng, &shape, 2.0, dtype, &dev).unwrap();
            let x = Var::from_tensor(&(x.as_tensor() + 0.5).unwrap()).unwrap();
            let w = var(&mut rng, &[c], 1.0, dtype, &dev).unwrap();
            let bb = var(&mut rng, &[c], 1.0, dtype, &dev).unwrap();
            let g = randn(&mut rng, &shape, 1.0, dtype, &dev).unwrap();
            let ours =
                layer_norm::layer_norm(x.as_tensor(), w.as_tensor(), bb.as_tensor(), 1e-5).unwrap();
            let refr = layer_norm::layer_norm_composite(
                x.as_tensor(),
                w.as_tensor(),
                bb.as_tensor(),
                1e-5,
            )
            .unwrap();
            assert_bits_eq(&ours, &refr, "layer norm values");
            let go = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gr = (refr * &g).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, v) in [("x", &x), ("w", &w), ("b", &bb)] {
                let e = rel_err(go.get(v).unwrap(), gr.get(v).unwrap());
                assert!(e < tol(dtype), "{dtype:?} {shape:?} d{name}: rel err {e}");
            }
        }
    }
}

#[test]
fn gelu_matches_composite() {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for dtype in [DType::F32, DType::F64] {
        for _ in 0..5 {
            let shape = vec![rng.random_range(1..7), rng.random_range(1..30)];
            let x = var(&mut rng, &shape, 3.0, dtype, &dev).unwrap();
            let g = randn(&mut rng, &shape, 1.0, dtype, &dev).unwrap();
            let ours = gelu::gelu(x.as_tensor()).unwrap();
            let refr = gelu::gelu_composite(x.as_tensor()).unwrap();
            assert_bits_eq(&ours, &refr, "gelu values");
            let go = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gr = (refr * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let e = rel_err(go.get(&x).unwrap(), gr.get(&x).unwrap());
            assert!(e < tol(dtype), "{dtype:?} gelu grad rel err {e}");
        }
    }
}

#[test]
fn lean_ops_without_grad_return_plain_values() {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (1, 2, 4, 3), &dev).unwrap();
    let y = attention::attention(&q, &q, &q, 0.5, true).unwrap();
    assert!(!y.track_op());
    let w = Tensor::ones(3, DType::F32, &dev).unwrap();
    assert!(!layer_norm::layer_norm(&q, &w, &w, 1e-5).unwrap().track_op());
    assert!(!gelu::gelu(&q).unwrap().track_op());
}
