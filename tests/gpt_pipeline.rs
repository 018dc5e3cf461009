//! Composition: the trainer's GPT-2 (a chain embed -> blocks -> head) cut into candle-pipeline
//! stages gives the loss and gradients of the plain full-batch step; the same chain with
//! candle-remat checkpointing gives bit-identical gradients; and candle-amp steps the trainer's
//! AdamW from either `GradStore`.
//!
//! Tolerance for the pipeline: 1e-5 relative (+1e-7 absolute), as in candle-pipeline's own
//! tests: microbatching changes the order of the f32 sums over the batch (per-microbatch means
//! weighted and added), which moves results by a few ulps.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_train::amp::{Amp, MasterWeights, ScalerConfig, WeightMode};
use candle_train::pipeline::{Layer, LossReduction, Microbatches, Pipeline, Schedule, Stage};
use candle_train::remat::{Policy, Tape};
use candle_train::trainer::model::gpt2::{Gpt, GptConfig};
use candle_train::trainer::model::ModelConfig;
use candle_train::trainer::model::{cross_entropy, Ctx, Kernels, Model, Params};
use candle_train::trainer::objective::CrossEntropy;
use candle_train::trainer::optim::{AdamW, AdamWConfig};
use candle_train::trainer::train::run_chain;

fn config(n_layer: usize, n_embd: usize) -> GptConfig {
    GptConfig {
        n_layer,
        n_head: 2,
        n_embd,
        block_size: 8,
        vocab_size: 13,
        dropout: 0.0,
        bias: true,
        ..GptConfig::default()
    }
}

/// Deterministic pseudo-random token ids.
fn tokens(b: usize, t: usize, vocab: usize, seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let ids: Vec<u32> = (0..b * t)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect();
    Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap()
}

/// The GPT's chain as pipeline layers: each link (embed, each block, head) with the parameters
/// it reads. The head lists the tied `wte` too, so its gradient contribution is kept.
fn layers(model: &Gpt, params: &Params) -> Vec<Layer> {
    let ctx = Ctx::eval();
    model
        .links()
        .into_iter()
        .map(|link| {
            let ctx = ctx.clone();
            Layer::new(params.vars_of(&link.weights()), move |x| {
                link.forward(x, &ctx)
            })
        })
        .collect()
}

fn assert_close(name: &str, a: &Tensor, b: &Tensor) {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-7 + 1e-5 * x.abs().max(y.abs()),
            "{name}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn gpt_pipeline_matches_full_batch() {
    // One worker puts the tied embedding and head in the same stage.
    for (n_layer, n_embd, batch, workers, m) in [
        (2, 16, 6, 2, 3),
        (4, 8, 8, 4, 8),
        (3, 16, 5, 2, 2),
        (2, 8, 4, 1, 2),
    ] {
        let cfg = config(n_layer, n_embd);
        let (model, params) = Gpt::new(&cfg, n_layer as u64, &Device::Cpu).unwrap();
        let x = tokens(batch, 8, cfg.vocab_size, 1);
        let y = tokens(batch, 8, cfg.vocab_size, 2);
        let logits = model.forward(&x, &Ctx::eval()).unwrap();
        let loss = cross_entropy(&logits, &y, None).unwrap();
        let plain = loss.backward().unwrap();

        let ls = layers(&model, &params);
        // Even split of the chain's layers over `workers` stages.
        let n = ls.len();
        let ranges: Vec<_> = (0..workers)
            .map(|w| (w * n / workers)..((w + 1) * n / workers))
            .collect();
        let stages: Vec<Box<dyn Stage>> = candle_train::pipeline::split_layers(ls, &ranges)
            .unwrap()
            .into_iter()
            .map(|s| Box::new(s) as Box<dyn Stage>)
            .collect();
        let pipe = Pipeline::new(stages, vec![Device::Cpu; workers], |logits, t| {
            cross_entropy(logits, t, None)
        })
        .unwrap();
        let mbs = Microbatches::split(&x, &y, m, LossReduction::Mean).unwrap();
        for schedule in [
            Schedule::gpipe(workers, m).unwrap(),
            Schedule::one_f_one_b(workers, m).unwrap(),
        ] {
            let out = pipe.step(&schedule, &mbs).unwrap();
            let l = loss.to_scalar::<f32>().unwrap();
            assert!((out.loss as f32 - l).abs() <= 1e-5 * l.abs(), "loss");
            for (name, var) in params.iter() {
                let want = plain.get(var).unwrap();
                let got = out
                    .grads
                    .get(var)
                    .unwrap_or_else(|| panic!("pipeline lost the gradient of {name}"));
                assert_close(name, want, got);
            }
        }
    }
}

#[test]
fn remat_gpt_gradients_are_bit_identical_and_amp_steps_them() {
    let cfg = GptConfig {
        dropout: 0.2,
        ..config(4, 16)
    };
    let (model, params) = Gpt::new(&cfg, 7, &Device::Cpu).unwrap();
    let x = tokens(3, 8, cfg.vocab_size, 3);
    let y = tokens(3, 8, cfg.vocab_size, 4);
    for kernels in [Kernels::Fused, Kernels::Reference] {
        remat_is_bit_identical(&cfg, &model, &params, &x, &y, kernels);
    }
    amp_steps_remat_grads(&cfg, &model, &params, &x, &y);
}

/// Remat with dropout (Philox masks regenerated in the recompute: in the kernel for fused, on
/// the host for reference) gives the gradients of plain backward bit for bit.
fn remat_is_bit_identical(
    cfg: &GptConfig,
    model: &Gpt,
    params: &Params,
    x: &Tensor,
    y: &Tensor,
    kernels: Kernels,
) {
    let (x, y) = (x.clone(), y.clone());
    let ctx = Ctx::train(11).with_kernels(kernels);
    let model: &dyn Model = model;
    let plain = model.loss(&x, &y, &ctx).unwrap().mean.backward().unwrap();
    for policy in [Policy::EveryK(1), Policy::EveryK(3), Policy::SqrtN] {
        let costs = cfg.chain_costs(3, cfg.block_size, DType::F32, kernels);
        let plan = policy.plan(&costs).unwrap();
        let (links, tape) = (model.links(), Tape::new(11));
        let loss = run_chain(&links, &x, &y, &ctx, Some((&tape, &plan)), &CrossEntropy).unwrap();
        let grads = tape.backward(&loss.mean).unwrap();
        for (name, var) in params.iter() {
            let values = |g: &GradStore| -> Vec<f32> {
                g.get(var)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let (a, b) = (values(&plain), values(&grads));
            assert_eq!(a, b, "{kernels} kernels, {policy:?}: gradient of {name}");
        }
    }
}

fn amp_steps_remat_grads(cfg: &GptConfig, model: &Gpt, params: &Params, x: &Tensor, y: &Tensor) {
    // candle-amp drives the trainer's AdamW (a candle_nn::Optimizer) from a remat GradStore.
    let weights = MasterWeights::new(
        params.iter().map(|(n, v)| (n.clone(), v.clone())),
        DType::BF16,
        WeightMode::Cast,
    )
    .unwrap();
    let mut amp = Amp::new(weights, ScalerConfig::none()).unwrap();
    let mut opt = AdamW::new(params, AdamWConfig::default()).unwrap();
    let before = params
        .tensor("transformer.h.0.mlp.c_fc.weight")
        .unwrap()
        .copy()
        .unwrap();
    let ctx16 = Ctx::train(11).with_dtype(DType::BF16);
    let plan = Policy::SqrtN
        .plan(&cfg.chain_costs(3, cfg.block_size, DType::BF16, Kernels::Fused))
        .unwrap();
    let (links, tape) = (model.links(), Tape::new(11));
    let loss = run_chain(&links, x, y, &ctx16, Some((&tape, &plan)), &CrossEntropy)
        .unwrap()
        .mean;
    let grads = tape.backward(&amp.scale_loss(&loss).unwrap()).unwrap();
    let outcome = amp.step(&grads, &mut opt).unwrap();
    assert!(outcome.is_applied(), "{outcome}");
    let after = params.tensor("transformer.h.0.mlp.c_fc.weight").unwrap();
    let moved = (after - before).unwrap().abs().unwrap().sum_all().unwrap();
    assert!(moved.to_scalar::<f32>().unwrap() > 0.0);
}
