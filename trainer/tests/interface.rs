//! The model interface is the only door: a small model defined here, outside the trainer's
//! model modules (two attention blocks, a token embedding tied to the head, learned positions,
//! an `[out, in]` projection), trains through the plain, remat, pipeline and data-parallel
//! executors and a checkpoint/resume, each against the plain step, with no change to any of
//! them. The same file checks that every link owns and reads exactly the parameters it lists,
//! for this model and for GPT-2, and that a wrong list is caught.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_comm::{run_threads, ThreadComm};
use candle_core::{DType, Device, Tensor, Var};
use candle_remat::{BlockCost, ChainCosts};
use common::{finish, tiny_config, values, Run};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use trainer::config::TrainConfig;
use trainer::data::Batch;
use trainer::model::gpt2::{Gpt, GptConfig};
use trainer::model::{
    self, Architecture, Builder, Ctx, Kernels, KvCache, Layout, Linear, Link, LinkOps, Model,
    ModelConfig, Params, Role, Rows, Shape, WeightMap,
};
use trainer::train::Trainer;

// ---------------------------------------------------------------------------------------
// The model: `tiny.tok [V, C]`, `tiny.pos [P, C]`, blocks `tiny.blocks.{i}` with a norm
// scale, a qkv projection `[C, 3C]` and an output projection stored `[out, in]`, and a head
// with its own norm scale reading the token embedding.

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct TinyConfig {
    vocab_size: usize,
    n_embd: usize,
    n_positions: usize,
    dropout: f32,
    /// A fault to inject: the head forgets to list its norm scale (ownership test only).
    #[serde(skip)]
    forget: bool,
}

const BLOCKS: usize = 2;
const HEADS: usize = 2;

#[derive(Debug)]
struct Embed {
    tok: Tensor,
    pos: Tensor,
    dropout: f32,
}

#[derive(Debug)]
struct Block {
    norm: Tensor,
    qkv: Linear,
    out: Linear,
    dropout: f32,
    site: u64,
}

#[derive(Debug)]
struct Head {
    norm: Tensor,
    tok: Tensor,
    forget: bool,
}

#[derive(Debug)]
struct Tiny {
    config: TinyConfig,
    embed: Arc<Embed>,
    blocks: Vec<Arc<Block>>,
    head: Arc<Head>,
}

impl LinkOps for Embed {
    fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let pos = match &ctx.rows.positions {
            Some(p) => p.clone(),
            None => Tensor::arange(0u32, t as u32, idx.device())?
                .unsqueeze(0)?
                .repeat((b, 1))?,
        };
        let emb = |w: &Tensor, ids: &Tensor| -> candle_core::Result<Tensor> {
            w.to_dtype(ctx.dtype)?
                .embedding(&ids.flatten_all()?)?
                .reshape((b, t, ()))
        };
        let x = (emb(&self.tok, idx)? + emb(&self.pos, &pos)?)?;
        ctx.kernels.dropout(&x, self.dropout, ctx, 0)
    }
    fn params(&self) -> Vec<Tensor> {
        vec![self.tok.clone(), self.pos.clone()]
    }
    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(Embed {
            tok: f(&self.tok)?,
            pos: f(&self.pos)?,
            dropout: self.dropout,
        }))
    }
}

impl LinkOps for Block {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let g = self.norm.to_dtype(x.dtype())?;
        let h = ctx.kernels.layer_norm(x, &g, None, 1e-5)?;
        let qkv = self.qkv.forward(&h, ctx)?;
        let a = ctx
            .kernels
            .causal_attention(&qkv, HEADS, self.dropout, ctx, self.site)?;
        let y = ctx.kernels.dropout(
            &self.out.forward(&a, ctx)?,
            self.dropout,
            ctx,
            self.site + 1,
        )?;
        x + y
    }
    fn params(&self) -> Vec<Tensor> {
        std::iter::once(&self.norm)
            .chain(self.qkv.weights())
            .chain(self.out.weights())
            .cloned()
            .collect()
    }
    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(Block {
            norm: f(&self.norm)?,
            qkv: self.qkv.map(f)?,
            out: self.out.map(f)?,
            dropout: self.dropout,
            site: self.site,
        }))
    }
}

impl LinkOps for Head {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let g = self.norm.to_dtype(x.dtype())?;
        let h = ctx.kernels.layer_norm(x, &g, None, 1e-5)?;
        let w = self.tok.to_dtype(ctx.dtype)?;
        ctx.kernels.linear(&h, &w.t()?, None)?.to_dtype(DType::F32)
    }
    fn params(&self) -> Vec<Tensor> {
        if self.forget {
            return Vec::new();
        }
        vec![self.norm.clone()]
    }
    fn tied(&self) -> Vec<Tensor> {
        vec![self.tok.clone()]
    }
    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>> {
        Ok(Arc::new(Head {
            norm: f(&self.norm)?,
            tok: f(&self.tok)?,
            forget: self.forget,
        }))
    }
}

impl Model for Tiny {
    fn config(&self) -> &dyn ModelConfig {
        &self.config
    }
    fn links(&self) -> Vec<Link> {
        let mut links = vec![Link::new(Role::Embed, self.embed.clone())];
        links.extend(
            self.blocks
                .iter()
                .map(|b| Link::new(Role::Block, b.clone())),
        );
        links.push(Link::new(Role::Head, self.head.clone()));
        links
    }
    fn map(&self, f: WeightMap) -> candle_core::Result<Box<dyn Model>> {
        Mapped::of(&self.config, &self.links(), f)
    }
    /// No real cache: recomputes the whole sequence, kept in the cache's first slot.
    fn forward_cached(&self, idx: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let (all, _) = cache.append(0, idx, idx)?;
        cache.len += idx.dim(1)?;
        let logits = self.forward_links(&all)?;
        let t = logits.dim(1)?;
        logits.narrow(1, t - idx.dim(1)?, idx.dim(1)?)
    }
}

impl Tiny {
    fn forward_links(&self, idx: &Tensor) -> candle_core::Result<Tensor> {
        model::run_links(&self.links(), idx, &Ctx::eval())
    }
}

/// The model with mapped weights (the step's cast copy): only its links are used.
#[derive(Debug)]
struct Mapped {
    config: TinyConfig,
    links: Vec<Link>,
}

impl Mapped {
    /// `links` with their weights mapped by `f`. Each link maps its own reads (the tied
    /// embedding once per link that reads it).
    fn of(
        config: &TinyConfig,
        links: &[Link],
        f: WeightMap,
    ) -> candle_core::Result<Box<dyn Model>> {
        let links = links
            .iter()
            .map(|l| l.map(f))
            .collect::<candle_core::Result<_>>()?;
        Ok(Box::new(Mapped {
            config: config.clone(),
            links,
        }))
    }
}

impl Model for Mapped {
    fn config(&self) -> &dyn ModelConfig {
        &self.config
    }
    fn links(&self) -> Vec<Link> {
        self.links.clone()
    }
    fn map(&self, f: WeightMap) -> candle_core::Result<Box<dyn Model>> {
        Mapped::of(&self.config, &self.links, f)
    }
    fn forward_cached(&self, _: &Tensor, _: &mut KvCache) -> candle_core::Result<Tensor> {
        candle_core::bail!("the mapped copy is for training only")
    }
}

impl ModelConfig for TinyConfig {
    fn architecture(&self) -> &'static str {
        "tiny-test"
    }
    fn clone_box(&self) -> Box<dyn ModelConfig> {
        Box::new(self.clone())
    }
    fn validate(&self) -> trainer::Result<()> {
        Ok(())
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.n_positions
    }
    fn shape(&self) -> Shape {
        Shape {
            n_layer: BLOCKS,
            n_head: HEADS,
            n_embd: self.n_embd,
            bias: true,
        }
    }
    fn special_tokens(&self) -> (Option<u32>, Option<u32>) {
        (None, None)
    }
    fn with_run_settings(
        &self,
        dropout: f32,
        _: Option<u32>,
        _: Option<u32>,
    ) -> Box<dyn ModelConfig> {
        Box::new(TinyConfig {
            dropout,
            ..self.clone()
        })
    }
    fn build(&self, b: &Builder) -> trainer::Result<Box<dyn Model>> {
        let (v, c, p) = (self.vocab_size, self.n_embd, self.n_positions);
        let t = b.pp("tiny");
        let tok = t.get(&[v, c], "tok")?;
        let blocks = (0..BLOCKS)
            .map(|i| {
                let bb = t.pp("blocks").pp(i);
                Ok(Arc::new(Block {
                    norm: bb.get(&[c], "norm")?,
                    qkv: Linear::build(&bb.pp("qkv"), c, 3 * c, true, Layout::InOut)?,
                    out: Linear::build(&bb.pp("out"), c, c, false, Layout::OutIn)?,
                    dropout: self.dropout,
                    site: 1 + 2 * i as u64,
                }))
            })
            .collect::<trainer::Result<_>>()?;
        Ok(Box::new(Tiny {
            config: self.clone(),
            embed: Arc::new(Embed {
                tok: tok.clone(),
                pos: t.get(&[p, c], "pos")?,
                dropout: self.dropout,
            }),
            blocks,
            head: Arc::new(Head {
                norm: t.pp("head").get(&[c], "norm")?,
                tok,
                forget: self.forget,
            }),
        }))
    }
    fn init(&self, name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> trainer::Result<Vec<f32>> {
        let n = shape.iter().product();
        if name.ends_with("norm") {
            return Ok(vec![1.0; n]);
        }
        let normal = Normal::new(0f32, 0.05).unwrap();
        Ok((0..n).map(|_| normal.sample(rng)).collect())
    }
    fn num_params(&self) -> usize {
        self.shapes()
            .values()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }
    fn flops_per_token(&self, _: usize) -> f64 {
        6.0 * self.num_params() as f64
    }
    fn chain_costs(&self, batch: usize, seq: usize, dtype: DType, _: Kernels) -> ChainCosts {
        let btc = (batch * seq * self.n_embd * dtype.size_in_bytes()) as u64;
        let block = BlockCost {
            act_bytes: 8 * btc,
            out_bytes: btc,
            fwd_ns: btc,
        };
        ChainCosts::uniform(BLOCKS, block)
    }
    fn to_hf_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap();
        v["model_type"] = "tiny-test".into();
        v
    }
    fn describe(&self) -> String {
        format!("tiny-test, {BLOCKS} blocks x {}", self.n_embd)
    }
}

struct TinyArch;

impl Architecture for TinyArch {
    fn name(&self) -> &'static str {
        "tiny-test"
    }
    fn config_from_hf_json(
        &self,
        json: &serde_json::Value,
        path: &Path,
    ) -> trainer::Result<Box<dyn ModelConfig>> {
        let mut json = json.clone();
        json.as_object_mut().unwrap().remove("model_type");
        let cfg: TinyConfig = serde_json::from_value(json)
            .map_err(|e| trainer::Error::checkpoint(path, e.to_string()))?;
        Ok(Box::new(cfg))
    }
}

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

fn train(cfg: TrainConfig) -> Run {
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

fn tmp(name: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join(name);
    (t, p)
}

#[test]
fn a_model_of_its_own_trains_through_every_executor_like_the_plain_step() {
    let (_t, dir) = tmp("runs");
    let plain = train(config(&dir.join("plain")));
    assert!(plain.0.last().unwrap().loss < plain.0[0].loss, "it learns");
    // Remat recomputes the blocks with the same dropout masks: bit-identical.
    for remat in ["every:1", "sqrt"] {
        let r = train(TrainConfig {
            remat: remat.parse().unwrap(),
            ..config(&dir.join(format!("remat-{remat}")))
        });
        assert_eq!(compare(&plain, &r), (0.0, 0.0), "remat {remat}");
    }
    // Pipelines cut the same chain into stages: summation order only. Losses and norms within
    // 1e-5 relative; AdamW moves every weight by about lr per step whatever the gradient's
    // scale, so the weights are compared against 5% of one update (lr 1e-3 here).
    for (schedule, stages, mbs) in [("1f1b", 2, 2), ("gpipe", 2, 4), ("interleaved:2", 2, 2)] {
        let p = train(TrainConfig {
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
    let p = train(TrainConfig {
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
    let single = train(TrainConfig {
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
    let whole = train(config(&dir.join("whole")));
    let part = dir.join("part");
    let first = train(TrainConfig {
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
    };
    let ctx = Ctx::train(3).with_rows(batch.rows.clone());
    let run = |t: &Trainer, batch: &Batch, ctx: &Ctx| {
        let (loss, count, g) = t
            .executor()
            .forward_backward(t.model.as_ref(), batch, ctx, 1.0)
            .unwrap();
        let gw = g.get(t.params.get("tiny.pos").unwrap()).unwrap().clone();
        (loss, count, values::<f32>(&gw))
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
    let gpt = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: 8,
        vocab_size: 11,
        ..GptConfig::default()
    };
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
    assert!(
        e.contains("tiny.head.norm") && e.contains("owned by no link"),
        "{e}"
    );
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
    assert!(
        e.contains("tiny.tok") && e.contains("owned by links 0 and 3"),
        "{e}"
    );
}
