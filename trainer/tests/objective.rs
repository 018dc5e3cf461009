//! The `Objective` door: a label-smoothed cross-entropy written outside the trainer (the
//! objective of `examples/label_smoothing/`) plugged into trainer runs.
//!
//! - With epsilon 0 a run is the built-in cross-entropy's bit for bit (every step's loss and
//!   gradient norm, the final weights): Llama with its chunked head under remat and bf16 with
//!   accumulated micro-batches, a pipeline, and two data-parallel ranks.
//! - With epsilon 0.1 the loss equals `torch.nn.CrossEntropyLoss(label_smoothing=0.1)`
//!   (`tests/fixtures/objective/label_smoothing.json`, made by
//!   `scripts/python/make_objective_fixtures.py` from the `llama` fixture's transformers
//!   logits): on those logits within 1e-6 relative (both sides f32, sums of 301 classes and
//!   18 targets in different orders: a few ulps), and through the model's chain (the executor's
//!   `run_chain`) within 1e-5 relative, the tolerance of the model's own loss against
//!   transformers (`llama_hf.rs`: the forward's f32 sums in another order).
//! - The per-token log-probabilities the head hands an objective, chunked, equal the whole
//!   logits' log-softmax, with their gradients; GPT-2's tied head chunks its loss too.
//! - Registry and config: an unknown `objective` is refused naming the known ones.

mod common;
#[path = "../../examples/label_smoothing/objective.rs"]
mod label_smoothing;

use std::sync::Arc;
use std::time::Duration;

use candle_comm::run_threads;
use candle_core::{DType, Device, Tensor, Var, D};
use common::llama::{expected, fixture};
use common::{assert_same_steps, finish, max_abs, max_abs_diff, tiny_config};
use label_smoothing::LabelSmoothing;
use trainer::checkpoint;
use trainer::config::{Arch, TrainConfig};
use trainer::model::{Ctx, Kernels, Link, LinkOps, Model, Role, WeightMap, IGNORE};
use trainer::objective::{CrossEntropy, HeadOutput, Objective};
use trainer::train::run_chain;
use trainer::train::Trainer;

/// torch's label-smoothed losses of the `llama` fixture: `(epsilon, loss)`.
fn torch_losses() -> Vec<(f64, f64)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/objective/label_smoothing.json");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["epsilon"].as_f64().unwrap(), c["loss"].as_f64().unwrap()))
        .collect()
}

/// A head whose input already is the logits (`[B, T, V]` f32): the fixture's.
#[derive(Clone, Debug)]
struct Logits;

impl LinkOps for Logits {
    fn forward(&self, x: &Tensor, _: &Ctx) -> candle_core::Result<Tensor> {
        Ok(x.clone())
    }
    fn params(&self) -> Vec<Tensor> {
        Vec::new()
    }
    fn map(&self, _: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(self.clone()))
    }
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

#[test]
fn label_smoothing_equals_torch_on_transformers_logits() {
    let ex = expected("llama");
    let head = Link::new(Role::Head, Arc::new(Logits));
    let ctx = Ctx::train(0);
    for (eps, want) in torch_losses() {
        let out = HeadOutput::new(&head, &ex.logits, &ex.targets, &ctx);
        let got = LabelSmoothing { eps }.loss(&out).unwrap();
        let got = f64::from(got.to_scalar::<f32>().unwrap());
        assert!(rel(got, want) <= 1e-6, "eps {eps}: {got} vs torch {want}");
    }
}

#[test]
fn label_smoothing_through_the_models_chain_equals_torch() {
    let (config, params) = checkpoint::load_model(&fixture("llama"), &Device::Cpu).unwrap();
    let model: Box<dyn Model> = trainer::model::build(config.as_ref(), &params).unwrap();
    let ex = expected("llama");
    for kernels in [Kernels::Fused, Kernels::Reference] {
        let ctx = Ctx::train(0).with_kernels(kernels);
        for (eps, want) in torch_losses() {
            let objective = LabelSmoothing { eps };
            let links = model.links();
            let loss = run_chain(&links, &ex.idx, &ex.targets, &ctx, None, &objective).unwrap();
            let got = f64::from(loss.mean.to_scalar::<f32>().unwrap());
            assert!(
                rel(got, want) <= 1e-5,
                "{kernels} eps {eps}: {got} vs torch {want}"
            );
        }
    }
}

#[test]
fn chunked_token_log_probs_equal_the_whole_logits_log_softmax() {
    let (config, params) = checkpoint::load_model(&fixture("llama"), &Device::Cpu).unwrap();
    let model: Box<dyn Model> = trainer::model::build(config.as_ref(), &params).unwrap();
    let ex = expected("llama");
    let links = model.links();
    let (head, body) = links.split_last().unwrap();
    let ctx = Ctx::train(0);
    let h = Var::from_tensor(&trainer::model::run_links(body, &ex.idx, &ctx).unwrap()).unwrap();
    // per-token weights with 0 and a negative one: the upstream gradient of each row
    let (b, t) = ex.targets.dims2().unwrap();
    let weights: Vec<f32> = (0..b * t).map(|i| [1.0, 0.0, -0.5, 2.0][i % 4]).collect();
    let weights = Tensor::from_vec(weights, (b, t), &Device::Cpu).unwrap();
    let mut results = Vec::new();
    for chunked in [true, false] {
        let ctx = ctx.clone().with_chunked_loss(chunked);
        let out = HeadOutput::new(head, h.as_tensor(), &ex.targets, &ctx);
        let lp = out.token_log_probs().unwrap();
        let g = (&lp * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        results.push((lp.detach(), g.get(&h).unwrap().clone()));
    }
    // the reference: log_softmax of the whole logits at the targets, 0 where ignored
    let logits = ex.logits.clone();
    let ls = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let keep = ex.targets.ne(IGNORE).unwrap();
    let t0 = keep
        .where_cond(&ex.targets, &ex.targets.zeros_like().unwrap())
        .unwrap();
    let want = ls
        .gather(&t0.unsqueeze(2).unwrap(), 2)
        .unwrap()
        .squeeze(2)
        .unwrap()
        .mul(&keep.to_dtype(DType::F32).unwrap())
        .unwrap();
    // against transformers' logits: the model's forward within the tolerance of llama_hf.rs
    assert!(max_abs_diff(&results[0].0, &want) < 1e-4);
    // chunked against whole logits on the same hidden states: the same sums in f32
    assert!(max_abs_diff(&results[0].0, &results[1].0) < 1e-5);
    let scale = max_abs(&results[1].1);
    assert!(scale > 0.0);
    assert!(max_abs_diff(&results[0].1, &results[1].1) <= 1e-5 * scale);
}

/// GPT-2's tied head takes the chunked loss when the context asks for it (the default) and
/// the whole logits otherwise: the same mean and gradients (f32 sums in another order: 1e-6
/// relative for the loss, 1e-5 of the largest gradient), and the chunked path is the one
/// that ran (an out-of-range target is refused by `linear_cross_entropy`, not by the
/// whole-logits `cross_entropy`).
#[test]
fn gpt2_head_takes_the_chunked_loss() {
    let cfg = trainer::model::gpt2::GptConfig {
        n_layer: 1,
        ..common::hf::tiny_gpt(8, 37)
    };
    let (model, params) = trainer::model::init(&cfg, 3, &Device::Cpu).unwrap();
    let links = model.links();
    let (head, body) = links.split_last().unwrap();
    let idx = Tensor::new(&[[1u32, 5, 9, 2, 7], [3, 3, 36, 0, 11]], &Device::Cpu).unwrap();
    let targets = Tensor::new(
        &[[5u32, 9, IGNORE, 7, 1], [3, 36, 0, 11, IGNORE]],
        &Device::Cpu,
    )
    .unwrap();
    let ctx = Ctx::train(0);
    let h = Var::from_tensor(&trainer::model::run_links(body, &idx, &ctx).unwrap()).unwrap();
    let wte = params.vars_of(&head.tied())[0].clone();
    let mut results = Vec::new();
    for chunked in [true, false] {
        let ctx = ctx.clone().with_chunked_loss(chunked);
        let loss = HeadOutput::new(head, h.as_tensor(), &targets, &ctx)
            .mean_cross_entropy()
            .unwrap();
        let g = loss.backward().unwrap();
        let grads = [g.get(&h).unwrap().clone(), g.get(&wte).unwrap().clone()];
        results.push((loss.to_scalar::<f32>().unwrap(), grads));
        let bad = targets.clamp(0u32, 40u32).unwrap(); // IGNORE -> 40, out of range
        let err = HeadOutput::new(head, h.as_tensor(), &bad, &ctx)
            .mean_cross_entropy()
            .unwrap_err()
            .to_string();
        assert_eq!(err.contains("linear_cross_entropy"), chunked, "{err}");
    }
    let (a, b) = (&results[0], &results[1]);
    assert!((a.0 - b.0).abs() <= 1e-6 * b.0.abs(), "{} vs {}", a.0, b.0);
    for (x, y) in a.1.iter().zip(&b.1) {
        let scale = max_abs(y);
        assert!(scale > 0.0 && max_abs_diff(x, y) <= 1e-5 * scale);
    }
}

/// A tiny Llama run (chunked head) changed by `set`.
fn llama(dir: &std::path::Path, set: impl FnOnce(&mut TrainConfig)) -> TrainConfig {
    let mut c = TrainConfig {
        arch: Arch::Llama,
        max_iters: 3,
        grad_accum: 2,
        ..tiny_config(dir)
    };
    set(&mut c);
    c
}

#[test]
fn label_smoothing_at_zero_is_the_built_in_objective_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    type Set = fn(&mut TrainConfig);
    let cases: [(&str, Set); 2] = [
        ("remat bf16", |c| {
            c.remat = "every:1".parse().unwrap();
            c.dtype = "bf16".parse().unwrap();
        }),
        ("pipeline", |c| {
            c.pipeline_stages = 2;
            c.microbatches = 2;
        }),
    ];
    for (what, set) in cases {
        let dir = |n: &str| tmp.path().join(format!("{what}-{n}"));
        let (built_in, w_built_in) = finish(Trainer::new(llama(&dir("ce"), set)).unwrap());
        let mut t = Trainer::new(llama(&dir("ls"), set)).unwrap();
        t.objective = Arc::new(LabelSmoothing { eps: 0.0 });
        let (ours, w_ours) = finish(t);
        assert_same_steps(&built_in, &ours, what);
        assert!(w_built_in == w_ours, "{what}: weights differ");
        // and a smoothing that is not zero trains another model
        let mut t = Trainer::new(llama(&dir("ls01"), set)).unwrap();
        t.objective = Arc::new(LabelSmoothing { eps: 0.1 });
        let (smoothed, _) = finish(t);
        assert_ne!(smoothed[0].loss, built_in[0].loss, "{what}");
    }
}

#[test]
fn data_parallel_ranks_run_the_plugged_objective() {
    let tmp = tempfile::tempdir().unwrap();
    // 2 ranks of 2 rows each: every rank weighs its shard by the objective's units
    let cfg = |name: &str| llama(&tmp.path().join(name), |c| c.batch_size = 2);
    let run = |name: &str, eps: Option<f64>| {
        let cfg = cfg(name);
        run_threads(2, Duration::from_secs(60), move |comm| {
            let mut t = Trainer::new(cfg.clone())
                .unwrap()
                .with_comm(Box::new(comm))
                .unwrap();
            if let Some(eps) = eps {
                t.objective = Arc::new(LabelSmoothing { eps });
            }
            finish(t)
        })
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")))
        .collect::<Vec<_>>()
    };
    let built_in = run("ce", None);
    let zero = run("ls", Some(0.0));
    for (rank, (a, b)) in built_in.iter().zip(&zero).enumerate() {
        assert_same_steps(&a.0, &b.0, &format!("rank {rank}"));
        assert!(a.1 == b.1, "rank {rank}: weights differ");
    }
    let smoothed = run("ls01", Some(0.1));
    assert_ne!(smoothed[0].0[0].loss, built_in[0].0[0].loss);
}

/// Cross-entropy over rows that come in pairs (as a preference objective's would).
#[derive(Debug)]
struct Pairs;

impl Objective for Pairs {
    fn name(&self) -> &str {
        "pairs"
    }
    fn row_units(&self, batch: &trainer::data::Batch) -> candle_core::Result<Vec<f64>> {
        CrossEntropy.row_units(batch)
    }
    fn loss(&self, out: &HeadOutput<'_>) -> candle_core::Result<Tensor> {
        CrossEntropy.loss(out)
    }
    fn rows_per_group(&self) -> usize {
        2
    }
}

#[test]
fn rows_kept_together_are_never_split() {
    let tmp = tempfile::tempdir().unwrap();
    let step = |name: &str, set: fn(&mut TrainConfig)| {
        let mut t = Trainer::new(llama(&tmp.path().join(name), set)).unwrap();
        t.objective = Arc::new(Pairs);
        t.train_step().map(|s| s.loss).map_err(|e| e.to_string())
    };
    let e = step("odd", |c| c.batch_size = 3).unwrap_err();
    common::assert_mentions(&e, &["`pairs` keeps 2 rows together", "batch_size"]);
    let e = step("pipe-1", |c| {
        c.pipeline_stages = 2;
        c.microbatches = 4;
    })
    .unwrap_err();
    assert!(e.contains("a pipeline microbatch has 1 rows"), "{e}");
    // whole pairs: trains as cross-entropy does
    let pairs = step("pipe-2", |c| {
        c.pipeline_stages = 2;
        c.microbatches = 2;
    })
    .unwrap();
    let mut t = Trainer::new(llama(&tmp.path().join("ce"), |c| {
        c.pipeline_stages = 2;
        c.microbatches = 2;
    }))
    .unwrap();
    assert_eq!(pairs.to_bits(), t.train_step().unwrap().loss.to_bits());
}

#[test]
fn an_unknown_objective_is_refused_naming_the_known_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        objective: "ppo".into(),
        ..tiny_config(tmp.path())
    };
    let e = Trainer::new(cfg).err().unwrap().to_string();
    common::assert_mentions(&e, &["`ppo`", "cross-entropy, dpo"]);
    assert_eq!(
        trainer::objective::build(&TrainConfig::default())
            .unwrap()
            .name(),
        "cross-entropy"
    );
}
