//! The fused kernels (`candle-fused`) against the reference composite ops on the whole model:
//! the same weights and tokens give the same logits, loss and parameter gradients.
//!
//! The reference path is `candle-fused`'s composite expressions, with the same Philox dropout
//! masks (drawn on the host), so the two paths agree with dropout as without it.
//!
//! Tolerances: in f64 both paths compute the same function with different summation orders,
//! which alone agree to ~1e-13 (checked at 1e-7); in f32 the reordering costs a few ulps per
//! op through 2 blocks and the loss (checked at 2e-4 relative to each tensor's max). A
//! missing or wrong backward term is off by O(1) and fails, and so does a dropout mask that
//! differs in one element (it zeroes or keeps an activation of O(1)).

mod common;

use candle_core::{DType, Device, Tensor};
use common::values;
use trainer::model::gpt2::{Gpt, GptConfig};
use trainer::model::{Ctx, Kernels, Params};

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (values::<f64>(a), values::<f64>(b));
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let mut worst = 0f64;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.is_nan(), y.is_nan(), "NaN in one path only");
        if !x.is_nan() {
            worst = worst.max((x - y).abs() / scale);
        }
    }
    worst
}

fn compare(cfg: &GptConfig, dtype: DType, with_mask: bool, tol: f64) {
    let dev = Device::Cpu;
    let (_, p32) = Gpt::new(cfg, 3, &dev).unwrap();
    let params = Params::from_tensors(
        p32.iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().to_dtype(dtype).unwrap())),
    )
    .unwrap();
    let model = Gpt::from_params(cfg, &params).unwrap();
    let (b, t) = (3, cfg.block_size);
    let ids: Vec<u32> = (0..b * (t + 1))
        .map(|i| ((i * 7 + 3) % cfg.vocab_size) as u32)
        .collect();
    let all = Tensor::from_vec(ids, (b, t + 1), &dev).unwrap();
    let (x, y) = (all.narrow(1, 0, t).unwrap(), all.narrow(1, 1, t).unwrap());
    let mask = with_mask.then(|| {
        let m: Vec<f32> = (0..b * t).map(|i| (i % 4 != 1) as u8 as f32).collect();
        Tensor::from_vec(m, (b, t), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    });
    let run = |kernels: Kernels| {
        let ctx = Ctx::train(9).with_dtype(dtype).with_kernels(kernels);
        let logits = model.forward(&x, &ctx).unwrap();
        let loss = kernels.cross_entropy(&logits, &y, mask.as_ref()).unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<Tensor> = params
            .iter()
            .map(|(n, v)| {
                grads
                    .get(v)
                    .unwrap_or_else(|| panic!("{kernels}: no gradient for {n}"))
                    .clone()
            })
            .collect();
        (logits, loss, g)
    };
    let (lf, sf, gf) = run(Kernels::Fused);
    let (lr, sr, gr) = run(Kernels::Reference);
    let d = max_rel_diff(&lf, &lr);
    assert!(d <= tol, "logits differ by {d:e} (tolerance {tol:e})");
    let d = max_rel_diff(&sf, &sr);
    assert!(d <= tol, "loss differs by {d:e}");
    for ((name, _), (a, b)) in params.iter().zip(gf.iter().zip(&gr)) {
        let d = max_rel_diff(a, b);
        assert!(
            d <= tol,
            "gradient of {name} differs by {d:e} (tolerance {tol:e})"
        );
    }
}

fn cfg(
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    block: usize,
    vocab: usize,
    bias: bool,
) -> GptConfig {
    GptConfig {
        n_layer,
        n_head,
        n_embd,
        block_size: block,
        vocab_size: vocab,
        dropout: 0.0,
        bias,
        ..GptConfig::default()
    }
}

#[test]
fn fused_equals_reference_f64() {
    compare(&cfg(2, 2, 16, 7, 11, true), DType::F64, false, 1e-7);
    compare(&cfg(1, 4, 32, 33, 65, false), DType::F64, true, 1e-7);
}

#[test]
fn fused_equals_reference_f32() {
    compare(&cfg(2, 4, 64, 65, 67, true), DType::F32, true, 2e-4);
    compare(&cfg(2, 2, 32, 9, 13, false), DType::F32, false, 2e-4);
}

/// With dropout (on the embeddings, the attention probabilities and the residual branches),
/// at the tolerances of the runs without it: both paths draw the same masks.
#[test]
fn fused_equals_reference_with_dropout() {
    let drop = |c: GptConfig| GptConfig { dropout: 0.2, ..c };
    compare(&drop(cfg(2, 4, 64, 65, 67, true)), DType::F32, true, 2e-4);
    compare(&drop(cfg(2, 2, 16, 7, 11, true)), DType::F64, false, 1e-7);
}
