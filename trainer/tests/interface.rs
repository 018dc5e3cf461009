//! The model interface is the only door: a small model defined outside the trainer's model
//! modules (`common/tiny.rs`: two attention blocks, a token embedding tied to the head, learned
//! positions, an `[out, in]` projection), trains through the plain, remat, pipeline and data-parallel
//! executors and a checkpoint/resume, each against the plain step, with no change to any of
//! them. The same file checks that every link owns and reads exactly the parameters it lists,
//! for this model and for GPT-2, and that a wrong list is caught.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_comm::{run_threads, ThreadComm};
use candle_core::{DType, Device, Tensor, Var};
use common::tiny::{TinyArch, TinyConfig};
use common::{finish, tiny_config, Run};
use rand_chacha::ChaCha8Rng;
use trainer::config::TrainConfig;
use trainer::data::{Batch, DataSource, Fingerprint, Split};
use trainer::model::gpt2::{Gpt, GptConfig};
use trainer::model::{
    self, Builder, Ctx, KvCache, Layout, LinearAdapter, Link, LinkOps, Model, ModelConfig, Params,
    Role, Rows, WeightMap,
};
use trainer::train::Trainer;

// ---------------------------------------------------------------------------------------
// Runs.

fn tiny(dropout: f32) -> TinyConfig {
    TinyConfig {
        vocab_size: 16,
        n_embd: 16,
        n_positions: 32,
        dropout,
        forget: false,
    }
}

fn config(dir: &Path) -> TrainConfig {
    TrainConfig {
        grad_accum: 2,
        dropout: 0.1,
        max_iters: 6,
        lr_decay_iters: Some(6),
        eval_interval: 3,
        eval_problems: 0,
        sample_tokens: 0,
        ..tiny_config(dir)
    }
}

fn trainer_for(cfg: TrainConfig) -> Trainer {
    model::register(&TinyArch);
    let tc = tiny(cfg.dropout);
    let (m, params) = model::init(&tc, 7, &Device::Cpu).unwrap();
    Trainer::with_model(cfg, m, params).unwrap()
}

fn train_tiny(cfg: TrainConfig) -> Run {
    finish(trainer_for(cfg))
}

/// Relative difference of losses and gradient norms, and the largest weight difference.
fn compare(a: &Run, b: &Run) -> (f32, f32) {
    assert_eq!(a.0.len(), b.0.len());
    let mut worst_step = 0f32;
    for (x, y) in a.0.iter().zip(&b.0) {
        assert!(x.loss.is_finite() && y.loss.is_finite());
        let rel = |p: f32, q: f32| (p - q).abs() / p.abs().max(1e-6);
        worst_step = worst_step
            .max(rel(x.loss, y.loss))
            .max(rel(x.grad_norm, y.grad_norm));
    }
    let mut worst_w = 0f32;
    for ((n, x), (m, y)) in a.1.iter().zip(&b.1) {
        assert_eq!(n, m);
        for (p, q) in x.iter().zip(y) {
            assert!(p.is_finite() && q.is_finite(), "{n}");
            worst_w = worst_w.max((p - q).abs());
        }
    }
    (worst_step, worst_w)
}

/// A 2-layer GPT-2, 16 wide, over 11 token ids.
fn small_gpt(block_size: usize) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size,
        vocab_size: 11,
        ..GptConfig::default()
    }
}

fn tmp(name: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join(name);
    (t, p)
}

#[test]
fn a_model_of_its_own_trains_through_every_executor_like_the_plain_step() {
    let (_t, dir) = tmp("runs");
    let plain = train_tiny(config(&dir.join("plain")));
    assert!(plain.0.last().unwrap().loss < plain.0[0].loss, "it learns");
    // Remat recomputes the blocks with the same dropout masks: bit-identical.
    for remat in ["every:1", "sqrt"] {
        let r = train_tiny(TrainConfig {
            remat: remat.parse().unwrap(),
            ..config(&dir.join(format!("remat-{remat}")))
        });
        assert_eq!(compare(&plain, &r), (0.0, 0.0), "remat {remat}");
    }
    // Pipelines cut the same chain into stages: summation order only. Losses and norms within
    // 1e-5 relative; AdamW moves every weight by about lr per step whatever the gradient's
    // scale, so the weights are compared against 5% of one update (lr 1e-3 here).
    for (schedule, stages, mbs) in [("1f1b", 2, 2), ("gpipe", 2, 4), ("interleaved:2", 2, 2)] {
        let p = train_tiny(TrainConfig {
            pipeline_stages: stages,
            microbatches: mbs,
            schedule: schedule.parse().unwrap(),
            ..config(&dir.join(format!("pipe-{schedule}")))
        });
        let (steps, w) = compare(&plain, &p);
        assert!(
            steps < 1e-5 && w < 5e-5,
            "pipeline {schedule}: {steps:e} {w:e}"
        );
    }
    // Remat inside pipeline stages.
    let p = train_tiny(TrainConfig {
        pipeline_stages: 2,
        microbatches: 2,
        remat: "every:1".parse().unwrap(),
        ..config(&dir.join("pipe-remat"))
    });
    let (steps, w) = compare(&plain, &p);
    assert!(
        steps < 1e-5 && w < 5e-5,
        "pipeline + remat: {steps:e} {w:e}"
    );
}

#[test]
fn a_model_of_its_own_trains_data_parallel_like_one_process() {
    let (_t, dir) = tmp("dp");
    let single = train_tiny(TrainConfig {
        batch_size: 8,
        ..config(&dir.join("single"))
    });
    let ranks: Vec<Run> = run_threads(2, Duration::from_secs(120), |comm: ThreadComm| {
        let cfg = TrainConfig {
            batch_size: 4,
            ..config(&dir.join("ranks"))
        };
        finish(trainer_for(cfg).with_comm(Box::new(comm)).unwrap())
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")))
    .collect();
    assert_eq!(ranks[0].1, ranks[1].1, "replicas differ");
    let (steps, w) = compare(&single, &ranks[0]);
    assert!(steps < 1e-5 && w < 5e-5, "data parallel: {steps:e} {w:e}");
}

#[test]
fn a_model_of_its_own_resumes_bit_exactly() {
    let (_t, dir) = tmp("resume");
    let whole = train_tiny(config(&dir.join("whole")));
    let part = dir.join("part");
    let first = train_tiny(TrainConfig {
        max_iters: 3,
        ..config(&part)
    });
    assert_eq!(first.0.len(), 3);
    // The checkpoint names the architecture; the registered one loads it.
    let json = std::fs::read_to_string(part.join("checkpoints/latest")).unwrap();
    let ckpt = part.join("checkpoints").join(json.trim());
    let cfg = std::fs::read_to_string(ckpt.join("config.json")).unwrap();
    assert!(cfg.contains("tiny-test"), "{cfg}");
    let resumed = finish(Trainer::resume(&part, |c| c.max_iters = 6).unwrap());
    let tail = (whole.0[3..].to_vec(), whole.1.clone());
    assert_eq!(compare(&tail, &resumed), (0.0, 0.0));
}

#[test]
fn positions_travel_with_the_rows_to_every_executor() {
    let (_t, dir) = tmp("rows");
    let dev = Device::Cpu;
    let plain = trainer_for(config(&dir.join("plain")));
    let pipe = trainer_for(TrainConfig {
        pipeline_stages: 2,
        microbatches: 2,
        ..config(&dir.join("pipe"))
    });
    let (b, t) = (4, 16);
    let x: Vec<u32> = (0..b * t).map(|i| (i * 7 % 16) as u32).collect();
    let x = Tensor::from_vec(x, (b, t), &dev).unwrap();
    // Packed rows: positions restart at token 5 of each row.
    let pos: Vec<u32> = (0..b * t)
        .map(|i| (i % t) as u32 % 5 + (i % t >= 5) as u32)
        .collect();
    let pos = Tensor::from_vec(pos, (b, t), &dev).unwrap();
    let mut batch = Batch::new(x.clone(), x.clone());
    batch.rows = Rows {
        positions: Some(pos),
        doc_ids: None,
        tokens: None,
    };
    let ctx = Ctx::train(3).with_rows(batch.rows.clone());
    let run = |t: &Trainer, batch: &Batch, ctx: &Ctx| {
        let (loss, count, g) = t
            .executor()
            .forward_backward(t.model.as_ref(), batch, ctx, 1.0, &t.objective)
            .unwrap();
        let gw = g.get(t.params.get("tiny.pos").unwrap()).unwrap().clone();
        (
            loss,
            count,
            gw.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        )
    };
    let (l_plain, c_plain, g_plain) = run(&plain, &batch, &ctx);
    let (l_pipe, c_pipe, g_pipe) = run(&pipe, &batch, &ctx);
    assert_eq!(c_plain, b * t);
    assert_eq!(c_pipe, b * t);
    assert!(
        (l_plain - l_pipe).abs() <= 1e-6 * l_plain,
        "{l_plain} vs {l_pipe}"
    );
    for (i, (p, q)) in g_plain.iter().zip(&g_pipe).enumerate() {
        assert!(
            (p - q).abs() <= 1e-6 + 1e-5 * p.abs(),
            "pos grad {i}: {p} vs {q}"
        );
    }
    // Positions 6.. are never used by the packed rows: their gradient is zero, which it is
    // not with the default positions.
    let c = 16;
    assert!(g_plain[6 * c..].iter().all(|&v| v == 0.0));
    let plain_rows = Batch::new(x.clone(), x);
    let (_, _, g_default) = run(&plain, &plain_rows, &Ctx::train(3));
    assert!(g_default[6 * c..].iter().any(|&v| v != 0.0));
}

// ---------------------------------------------------------------------------------------
// Ownership and reads.

/// The parameters (by name) that receive a gradient when `link` alone runs on `x` (the head:
/// its loss against `y`).
fn read_by(link: &Link, params: &Params, x: &Tensor, y: &Tensor) -> Vec<String> {
    let ctx = Ctx::eval();
    let out = match link.role() {
        Role::Head => link.loss(x, y, &ctx).unwrap().mean,
        _ => link
            .forward(x, &ctx)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap(),
    };
    let grads = out.backward().unwrap();
    params
        .iter()
        .filter(|(_, v)| grads.get(v).is_some())
        .map(|(n, _)| n.clone())
        .collect()
}

/// Checks that each link's forward reads exactly the parameters it lists (owned and tied),
/// and that the links partition the parameters. Returns the first problem.
fn check_links(m: &dyn Model, params: &Params, idx: &Tensor) -> Result<(), String> {
    params
        .check_ownership(&m.links())
        .map_err(|e| e.to_string())?;
    let links = m.links();
    let mut x = idx.clone();
    for (i, link) in links.iter().enumerate() {
        let listed: Vec<String> = {
            let ids: Vec<_> = link.weights().iter().map(|t| t.id()).collect();
            params
                .iter()
                .filter(|(_, v)| ids.contains(&v.as_tensor().id()))
                .map(|(n, _)| n.clone())
                .collect()
        };
        let input = match link.role() {
            Role::Embed => x.clone(),
            // A leaf copy of the input, so only this link's parameters get gradients.
            _ => Var::from_tensor(&x).unwrap().as_tensor().clone(),
        };
        let read = read_by(link, params, &input, idx);
        if read != listed {
            return Err(format!("link {i} reads {read:?} but lists {listed:?}"));
        }
        if link.role() != Role::Head {
            x = link.forward(&input, &Ctx::eval()).unwrap().detach();
        }
    }
    Ok(())
}

fn ids(dev: &Device) -> Tensor {
    Tensor::new(&[[1u32, 2, 3, 4, 5], [6, 7, 0, 1, 2]], dev).unwrap()
}

#[test]
fn every_link_owns_and_reads_exactly_the_parameters_it_lists() {
    let dev = Device::Cpu;
    let tc = tiny(0.0);
    let (m, params) = model::init(&tc, 1, &dev).unwrap();
    check_links(m.as_ref(), &params, &ids(&dev)).unwrap();
    let gpt = small_gpt(8);
    let (g, gp) = Gpt::new(&gpt, 1, &dev).unwrap();
    check_links(&g, &gp, &ids(&dev)).unwrap();

    // A head that forgets to list its norm scale: the scale is owned by no link, and the
    // head reads a parameter it does not list.
    let forgetful = TinyConfig {
        forget: true,
        ..tiny(0.0)
    };
    let bad = model::build(&forgetful, &params).unwrap();
    let e = check_links(bad.as_ref(), &params, &ids(&dev)).unwrap_err();
    common::assert_mentions(&e, &["tiny.head.norm", "owned by no link"]);
    // The trainer refuses such a model before training.
    let (_t, dir) = tmp("bad");
    let err = Trainer::with_model(config(&dir), bad, params.clone())
        .err()
        .unwrap();
    assert!(err.to_string().contains("tiny.head.norm"), "{err}");
    // Listing a weight twice as owned (the head claiming the tied embedding) is caught too.
    let links = m.links();
    let mut wrong = links.clone();
    let head = &links[links.len() - 1];
    #[derive(Debug)]
    struct Claims(Link);
    impl LinkOps for Claims {
        fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
            self.0.forward(x, ctx)
        }
        fn params(&self) -> Vec<Tensor> {
            self.0.weights()
        }
        fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
            Ok(Arc::new(Claims(self.0.map(f)?)))
        }
    }
    *wrong.last_mut().unwrap() = Link::new(Role::Head, Arc::new(Claims(head.clone())));
    let e = params.check_ownership(&wrong).unwrap_err().to_string();
    common::assert_mentions(&e, &["tiny.tok", "owned by links 0 and 3"]);
}

/// A low-rank adapter `x W + b + x A B` (A `[in, r]`, B `[r, out]`).
#[derive(Debug)]
struct LowRank(Tensor, Tensor);

impl LinearAdapter for LowRank {
    fn forward(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let a = self.0.to_dtype(ctx.dtype)?;
        let b = self.1.to_dtype(ctx.dtype)?;
        let base = ctx.kernels.linear(x, w, bias)?;
        base + x.broadcast_matmul(&a)?.broadcast_matmul(&b)?
    }
    fn params(&self) -> Vec<Tensor> {
        vec![self.0.clone(), self.1.clone()]
    }
    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinearAdapter>> {
        Ok(Arc::new(LowRank(f(&self.0)?, f(&self.1)?)))
    }
}

#[test]
fn an_adapter_wraps_any_projection_by_its_module_path() {
    let dev = Device::Cpu;
    let cfg = small_gpt(8);
    let (plain, params) = Gpt::new(&cfg, 1, &dev).unwrap();
    let a = Var::from_tensor(&Tensor::randn(0f32, 0.1, (16, 4), &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::zeros((4, 48), DType::F32, &dev).unwrap()).unwrap();
    let seen = std::sync::Mutex::new(Vec::new());
    let wrap = |path: &str,
                _: usize,
                _: usize,
                _: Layout|
     -> trainer::data::Result<Option<Arc<dyn LinearAdapter>>> {
        seen.lock().unwrap().push(path.to_string());
        Ok((path == "transformer.h.1.attn.c_attn").then(|| {
            Arc::new(LowRank(a.as_tensor().clone(), b.as_tensor().clone()))
                as Arc<dyn LinearAdapter>
        }))
    };
    let src = |name: &str, _: &[usize]| params.tensor(name);
    let wrapped = cfg.build(&Builder::root(&src).with_wrap(&wrap)).unwrap();
    // Every projection is offered, by its Hugging Face module path.
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 2 * 4, "{seen:?}");
    assert!(
        seen.contains(&"transformer.h.0.mlp.c_fc".to_string()),
        "{seen:?}"
    );
    // B = 0: the same function as the plain model; A and B get gradients, through the step's
    // cast copy too.
    let x = ids(&dev);
    let ctx = Ctx::eval();
    let (p, w) = (
        plain.forward(&x, &ctx).unwrap(),
        wrapped.forward(&x, &ctx).unwrap(),
    );
    let diff = (p - w)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(diff.iter().all(|&d| d == 0.0));
    let cast = wrapped.to_dtype(DType::F32).unwrap();
    let g = cast.loss(&x, &x, &ctx).unwrap().mean.backward().unwrap();
    let gb = g
        .get(&b)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(gb > 0.0, "the delta's B gets a gradient");
    assert!(g.get(&a).is_some());
}

/// A data source whose rows count different numbers of targets: row `r` of a batch masks its
/// first `x[r, 0] % 7` targets (a function of the row's content, so a row is masked alike in
/// whichever batch it comes).
struct Ragged(Box<dyn DataSource>);

type R<T> = trainer::data::Result<T>;

impl DataSource for Ragged {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    // Rows, columns, generator, device.
    fn batch(&self, s: Split, b: usize, t: usize, g: &mut ChaCha8Rng, d: &Device) -> R<Batch> {
        let batch = self.0.batch(s, b, t, g, d)?;
        let first: Vec<u32> = batch.x.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        let mask: Vec<f32> = (0..b * t)
            .map(|i| f32::from((i % t) as u32 >= first[i / t] % 7))
            .collect();
        let mask = Tensor::from_vec(mask, (b, t), d)?;
        Ok(Batch::new(batch.x, batch.y).with_mask(Some(mask)))
    }
    fn encode(&self, text: &str) -> R<Vec<u32>> {
        self.0.encode(text)
    }
    fn decode(&self, ids: &[u32]) -> R<String> {
        self.0.decode(ids)
    }
    fn fingerprint(&self) -> Fingerprint {
        self.0.fingerprint()
    }
}

#[test]
fn an_accumulated_step_is_the_token_mean_of_the_whole_step() {
    // Two micro-batches of 4 rows train like one batch of the same 8 rows (the data stream
    // draws rows one after another, so both see the same rows), although the rows count
    // different numbers of targets.
    let (_t, dir) = tmp("accum");
    let run = |accum: usize, batch_size: usize, name: &str| {
        let cfg = TrainConfig {
            data: "char".parse().unwrap(),
            data_path: Some(dir.join("corpus.txt")),
            grad_accum: accum,
            batch_size,
            dropout: 0.0,
            max_iters: 3,
            eval_problems: 0,
            sample_tokens: 0,
            ..tiny_config(&dir.join(name))
        };
        let data = cfg.open_data().unwrap();
        let mut t = Trainer::new(cfg).unwrap();
        t.data = Box::new(Ragged(data));
        finish(t)
    };
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("corpus.txt"),
        "the quick brown fox jumps over the lazy dog. ".repeat(60),
    )
    .unwrap();
    let (two, one) = (run(2, 4, "two"), run(1, 8, "one"));
    let (steps, w) = compare(&one, &two);
    // f32 summation order only.
    assert!(steps < 1e-5 && w < 5e-5, "{steps:e} {w:e}");
}

#[test]
fn the_kv_cache_gives_the_logits_of_the_whole_sequence() {
    let dev = Device::Cpu;
    let cfg = small_gpt(12);
    let (gpt, _) = Gpt::new(&cfg, 5, &dev).unwrap();
    let seq = Tensor::new(
        &[[1u32, 4, 2, 9, 3, 3, 7, 0, 5], [2, 2, 8, 1, 6, 4, 10, 3, 1]],
        &dev,
    )
    .unwrap();
    let whole = gpt.forward(&seq, &Ctx::eval()).unwrap();
    // A prompt of 4 tokens, then one token at a time.
    let mut cache = KvCache::new();
    let mut parts = vec![gpt
        .forward_cached(&seq.narrow(1, 0, 4).unwrap(), &mut cache)
        .unwrap()];
    for t in 4..9 {
        parts.push(
            gpt.forward_cached(&seq.narrow(1, t, 1).unwrap(), &mut cache)
                .unwrap(),
        );
    }
    assert_eq!(cache.len, 9);
    let cached = Tensor::cat(&parts, 1).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (flat(&whole), flat(&cached));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        // The same function, summed in another order (online softmax over other key tiles).
        assert!(
            x.is_finite() && (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
            "logit {i}: {x} vs {y}"
        );
    }
    // Greedy decoding with the cache equals decoding by whole-sequence forwards.
    let prompt = vec![vec![1u32, 4, 2], vec![2, 2, 8]];
    let got = trainer::sample::greedy_batch(&gpt, &prompt, 6, &dev).unwrap();
    for (p, g) in prompt.iter().zip(&got) {
        let mut toks = p.clone();
        for _ in 0..6 {
            let x = Tensor::new(toks.as_slice(), &dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let logits = gpt.forward(&x, &Ctx::eval()).unwrap();
            let last = logits
                .narrow(1, toks.len() - 1, 1)
                .unwrap()
                .flatten_all()
                .unwrap();
            toks.push(last.argmax(0).unwrap().to_scalar::<u32>().unwrap());
        }
        assert_eq!(&toks[p.len()..], g.as_slice());
    }
}
