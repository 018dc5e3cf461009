//! A small model defined outside the trainer's model modules, for the interface tests: two
//! attention blocks, a token embedding tied to the head, learned positions (taken from the
//! rows' context when given) and an output projection stored `[out, in]`.
//!
//! Parameters: `tiny.tok [V, C]`, `tiny.pos [P, C]`, blocks `tiny.blocks.{i}` with a norm
//! scale, a qkv projection `[C, 3C]` and an output projection, and a head with its own norm
//! scale reading the token embedding. Registered as architecture `tiny-test`.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_remat::{BlockCost, ChainCosts};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use serde_json::Value;
use trainer::model::{
    self, Architecture, Builder, Ctx, Dims, Kernels, KvCache, Layout, Linear, Link, LinkOps, Model,
    ModelConfig, Role, SpecialTokens, WeightMap,
};
// The models crate's errors are candle-data's.
use trainer::data::Result;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TinyConfig {
    /// Token ids embedded.
    pub vocab_size: usize,
    /// Width.
    pub n_embd: usize,
    /// Learned positions.
    pub n_positions: usize,
    /// Dropout after the embedding, on attention and on each block's output.
    pub dropout: f32,
    /// A fault to inject: the head forgets to list its norm scale (ownership test only).
    #[serde(skip)]
    pub forget: bool,
}

pub const BLOCKS: usize = 2;
pub const HEADS: usize = 2;

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
        let mut w = vec![self.norm.clone()];
        w.extend(self.qkv.weights());
        w.extend(self.out.weights());
        w
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
        // Each link maps its own reads (the tied embedding once per link that reads it).
        Mapped::of(&self.config, &self.links(), f)
    }
    /// No real cache: recomputes the whole sequence, kept in the cache's first slot.
    fn forward_cached(&self, idx: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        // The ids, as a `[B, 1, T, 1]` "key" of block 0.
        let ids = idx.unsqueeze(1)?.unsqueeze(3)?;
        let (all, _) = cache.append(0, &ids, &ids)?;
        cache.len += idx.dim(1)?;
        let logits = self.forward_links(&all.squeeze(3)?.squeeze(1)?)?;
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
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    fn dims(&self) -> Dims {
        Dims {
            layers: BLOCKS,
            hidden: self.n_embd,
            heads: HEADS,
            kv_heads: HEADS,
            head_dim: self.n_embd / HEADS,
            vocab: self.vocab_size,
            positions: self.n_positions,
            bias: true,
            ..Dims::default()
        }
    }
    fn special_tokens(&self) -> SpecialTokens {
        SpecialTokens::default()
    }
    fn with_run_settings(&self, dropout: f32, _: SpecialTokens) -> Box<dyn ModelConfig> {
        Box::new(TinyConfig {
            dropout,
            ..self.clone()
        })
    }
    fn build(&self, b: &Builder) -> Result<Box<dyn Model>> {
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
            .collect::<Result<_>>()?;
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
    fn init(&self, name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> Result<Vec<f32>> {
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

pub struct TinyArch;

impl Architecture for TinyArch {
    fn name(&self) -> &'static str {
        "tiny-test"
    }
    fn class(&self) -> &'static str {
        "TinyTestForCausalLM"
    }
    fn config_from_hf_json(&self, json: &Value, path: &Path) -> Result<Box<dyn ModelConfig>> {
        let mut json = json.clone();
        json.as_object_mut().unwrap().remove("model_type");
        let cfg: TinyConfig = serde_json::from_value(json)
            .map_err(|e| trainer::Error::checkpoint(path, e.to_string()))?;
        Ok(Box::new(cfg))
    }
}
