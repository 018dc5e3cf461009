//! Every parameter of the GPT receives a non-zero gradient, and that gradient matches central
//! finite differences in f64, with the fused kernels and with the reference composite ops.
//!
//! Tolerance: with step h = 1e-5 in f64 the truncation error of a central difference is
//! O(h^2 * f''') ~ 1e-10 and the rounding error O(eps_f64 * |loss| / h) ~ 1e-11, so analytic and
//! numeric derivatives must agree to |a - n| <= 1e-7 + 1e-5 |n|: a wrong or missing backward
//! (e.g. a detached fused LayerNorm or softmax) is off by O(|n|) and fails.

mod common;

use candle_core::{DType, Device, Tensor};
use common::values;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trainer::model::gpt2::{Gpt, GptConfig};
use trainer::model::{Ctx, Kernels, ModelConfig, Params};

fn random_tokens(rng: &mut ChaCha8Rng, b: usize, t: usize, vocab: usize) -> Tensor {
    let ids: Vec<u32> = (0..b * t)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap()
}

fn loss_of(model: &Gpt, x: &Tensor, y: &Tensor, mask: Option<&Tensor>, ctx: &Ctx) -> Tensor {
    let logits = model.forward(x, ctx).unwrap();
    ctx.kernels.cross_entropy(&logits, y, mask).unwrap()
}

fn check(cfg: GptConfig, b: usize, t: usize, seed: u64, train: bool, with_mask: bool) {
    for kernels in [Kernels::Fused, Kernels::Reference] {
        check_with(cfg.clone(), b, t, seed, train, with_mask, kernels);
    }
}

fn check_with(
    cfg: GptConfig,
    b: usize,
    t: usize,
    seed: u64,
    train: bool,
    with_mask: bool,
    kernels: Kernels,
) {
    let dev = Device::Cpu;
    let (_, params32) = Gpt::new(&cfg, seed, &dev).unwrap();
    // Bigger-than-default weights so that every path carries a signal well above rounding.
    let params = Params::from_tensors(params32.iter().map(|(n, v)| {
        let t = v.as_tensor().to_dtype(DType::F64).unwrap();
        let t = if n.contains(".ln_") || n.ends_with(".bias") {
            (t + 0.1).unwrap()
        } else {
            (t * 10.0).unwrap()
        };
        (n.clone(), t)
    }))
    .unwrap();
    let model = Gpt::from_params(&cfg, &params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    let x = random_tokens(&mut rng, b, t, cfg.vocab_size);
    let y = random_tokens(&mut rng, b, t, cfg.vocab_size);
    let mask = with_mask.then(|| {
        let m: Vec<f64> = (0..b * t)
            .map(|i| if i % 3 == 0 { 0.0 } else { 1.0 })
            .collect();
        Tensor::from_vec(m, (b, t), &dev).unwrap()
    });
    let ctx = if train {
        Ctx::train(seed + 2).with_dtype(DType::F64)
    } else {
        Ctx::eval().with_dtype(DType::F64)
    }
    .with_kernels(kernels);
    let loss = loss_of(&model, &x, &y, mask.as_ref(), &ctx);
    let grads = loss.backward().unwrap();
    let h = 1e-5;
    for (name, var) in params.iter() {
        let g: Vec<f64> = values(
            grads
                .get(var)
                .unwrap_or_else(|| panic!("`{name}` got no gradient")),
        );
        let gnorm: f64 = g.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!(gnorm > 0.0, "`{name}` got an all-zero gradient");
        let base: Vec<f64> = values(var.as_tensor());
        // Check up to 24 entries per tensor, spread over it.
        let n = base.len();
        let picks: Vec<usize> = if n <= 24 {
            (0..n).collect()
        } else {
            (0..24).map(|_| rng.random_range(0..n)).collect()
        };
        for i in picks {
            let eval_at = |delta: f64| -> f64 {
                let mut p = base.clone();
                p[i] += delta;
                var.set(&Tensor::from_vec(p, var.shape(), &dev).unwrap())
                    .unwrap();
                let l = loss_of(&model, &x, &y, mask.as_ref(), &ctx)
                    .to_scalar::<f64>()
                    .unwrap();
                l
            };
            let numeric = (eval_at(h) - eval_at(-h)) / (2.0 * h);
            var.set(&Tensor::from_vec(base.clone(), var.shape(), &dev).unwrap())
                .unwrap();
            let analytic = g[i];
            assert!(
                (analytic - numeric).abs() <= 1e-7 + 1e-5 * numeric.abs(),
                "{kernels} kernels: `{name}`[{i}]: analytic {analytic:e} vs finite difference {numeric:e}"
            );
        }
    }
}

fn tiny(n_layer: usize, n_head: usize, n_embd: usize, bias: bool, dropout: f32) -> GptConfig {
    GptConfig {
        n_layer,
        n_head,
        n_embd,
        block_size: 6,
        vocab_size: 7,
        dropout,
        bias,
        ..GptConfig::default()
    }
}

#[test]
fn gradients_match_finite_differences() {
    check(tiny(2, 2, 8, true, 0.0), 2, 6, 1, false, false);
}

#[test]
fn gradients_match_with_dropout_mask_and_no_bias() {
    check(tiny(1, 4, 8, false, 0.2), 3, 5, 2, true, true);
    check(tiny(3, 1, 4, true, 0.1), 1, 6, 3, true, false);
}

#[test]
fn fp32_model_gives_every_parameter_a_gradient() {
    let cfg = GptConfig::default();
    let (model, params) = Gpt::new(&cfg, 5, &Device::Cpu).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let x = random_tokens(&mut rng, 2, 16, cfg.vocab_size);
    let loss = loss_of(&model, &x, &x, None, &Ctx::train(1));
    let grads = loss.backward().unwrap();
    for (name, var) in params.iter() {
        let g: Vec<f32> = values(
            grads
                .get(var)
                .unwrap_or_else(|| panic!("`{name}` got no gradient")),
        );
        let norm: f32 = g.iter().map(|v| v * v).sum();
        // wpe rows past T=16 get no gradient; every tensor as a whole must.
        assert!(norm > 0.0, "`{name}` has an all-zero gradient");
    }
    assert_eq!(params.len(), cfg.shapes().len());
}
