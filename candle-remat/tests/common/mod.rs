//! Test and bench support: a compact GPT written with differentiable Candle ops (optionally
//! with candle-fused's fused attention and LayerNorm).
#![allow(dead_code)]

use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_fused::attention::{attention, attention_composite, AttentionConfig};
use candle_fused::norm::{layer_norm, layer_norm_composite};
use candle_remat::{BlockCost, ChainCosts, Plan, Tape};
use rand::Rng;
use test_support::random::{normal, rng, var, ChaCha8Rng};

/// A parameter of `shape` with normal values of standard deviation `std`.
pub fn param(rng: &mut ChaCha8Rng, shape: &[usize], std: f64, dtype: DType, dev: &Device) -> Var {
    var(&normal(rng, shape, std, dtype, dev))
}

/// A LayerNorm (gain around 1, bias around 0) of width `c`.
fn ln_params(rng: &mut ChaCha8Rng, c: usize, dtype: DType, dev: &Device) -> Result<(Var, Var)> {
    let gain = Var::from_tensor(&(normal(rng, &[c], 0.1, dtype, dev) + 1.0)?)?;
    Ok((gain, param(rng, &[c], 0.1, dtype, dev)))
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cfg {
    pub vocab: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_layer: usize,
    pub block: usize,
    /// Dropout on attention output and MLP output (inside blocks) and on the embeddings (glue).
    pub dropout: f64,
    /// Use candle-fused's fused attention op instead of its composite expression.
    pub fused_attention: bool,
    /// Use candle-fused's fused LayerNorm op instead of its composite expression.
    pub fused_ln: bool,
}

impl Cfg {
    pub fn tiny(n_embd: usize, n_head: usize, n_layer: usize, block: usize) -> Self {
        Self {
            vocab: 11,
            n_embd,
            n_head,
            n_layer,
            block,
            dropout: 0.1,
            fused_attention: false,
            fused_ln: false,
        }
    }
}

pub struct Block {
    pub ln1: (Var, Var),
    pub attn_w: Var,
    pub attn_b: Var,
    pub proj_w: Var,
    pub proj_b: Var,
    pub ln2: (Var, Var),
    pub fc_w: Var,
    pub fc_b: Var,
    pub fc2_w: Var,
    pub fc2_b: Var,
    pub cfg: Cfg,
}

fn ln(x: &Tensor, p: &(Var, Var), fused: bool) -> Result<Tensor> {
    if fused {
        layer_norm(x, p.0.as_tensor(), Some(p.1.as_tensor()), 1e-5)
    } else {
        layer_norm_composite(x, p.0.as_tensor(), Some(p.1.as_tensor()), 1e-5)
    }
}

fn linear(x: &Tensor, w: &Var, b: &Var) -> Result<Tensor> {
    let (bsz, t, c) = x.dims3()?;
    let y = x
        .reshape((bsz * t, c))?
        .matmul(w.as_tensor())?
        .broadcast_add(b.as_tensor())?;
    y.reshape((bsz, t, w.dim(1)?))
}

fn drop_in_block(x: &Tensor, p: f64) -> Result<Tensor> {
    if p > 0.0 {
        Ok(candle_remat::dropout(x, p)?)
    } else {
        Ok(x.clone())
    }
}

impl Block {
    pub fn new(rng: &mut ChaCha8Rng, cfg: Cfg, dtype: DType, dev: &Device) -> Result<Self> {
        let c = cfg.n_embd;
        let s = 0.02 * 4.0;
        Ok(Self {
            ln1: ln_params(rng, c, dtype, dev)?,
            attn_w: param(rng, &[c, 3 * c], s, dtype, dev),
            attn_b: param(rng, &[3 * c], s, dtype, dev),
            proj_w: param(rng, &[c, c], s, dtype, dev),
            proj_b: param(rng, &[c], s, dtype, dev),
            ln2: ln_params(rng, c, dtype, dev)?,
            fc_w: param(rng, &[c, 4 * c], s, dtype, dev),
            fc_b: param(rng, &[4 * c], s, dtype, dev),
            fc2_w: param(rng, &[4 * c, c], s, dtype, dev),
            fc2_b: param(rng, &[c], s, dtype, dev),
            cfg,
        })
    }

    pub fn vars(&self) -> Vec<&Var> {
        vec![
            &self.ln1.0,
            &self.ln1.1,
            &self.attn_w,
            &self.attn_b,
            &self.proj_w,
            &self.proj_b,
            &self.ln2.0,
            &self.ln2.1,
            &self.fc_w,
            &self.fc_b,
            &self.fc2_w,
            &self.fc2_b,
        ]
    }

    pub fn attn(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = self.cfg.n_head;
        let hd = c / h;
        let qkv = linear(
            &ln(x, &self.ln1, self.cfg.fused_ln)?,
            &self.attn_w,
            &self.attn_b,
        )?;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(D::Minus1, i * c, c)?
                .reshape((b, t, h, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = AttentionConfig::causal().with_scale(1.0 / (hd as f64).sqrt());
        let y = if self.cfg.fused_attention {
            attention(&q, &k, &v, &att)?
        } else {
            attention_composite(&q, &k, &v, &att)?
        };
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b, t, c))?;
        drop_in_block(&linear(&y, &self.proj_w, &self.proj_b)?, self.cfg.dropout)
    }

    pub fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let h = linear(
            &ln(x, &self.ln2, self.cfg.fused_ln)?,
            &self.fc_w,
            &self.fc_b,
        )?
        .gelu()?;
        drop_in_block(&linear(&h, &self.fc2_w, &self.fc2_b)?, self.cfg.dropout)
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attn(x)?)?;
        &x + self.mlp(&x)?
    }
}

pub struct Gpt {
    pub wte: Var,
    pub wpe: Var,
    pub blocks: Vec<Block>,
    pub ln_f: (Var, Var),
    pub cfg: Cfg,
}

impl Gpt {
    pub fn new(seed: u64, cfg: Cfg, dtype: DType, dev: &Device) -> Result<Self> {
        let mut rng = rng(seed);
        let c = cfg.n_embd;
        Ok(Self {
            wte: param(&mut rng, &[cfg.vocab, c], 0.3, dtype, dev),
            wpe: param(&mut rng, &[cfg.block, c], 0.1, dtype, dev),
            blocks: (0..cfg.n_layer)
                .map(|_| Block::new(&mut rng, cfg, dtype, dev))
                .collect::<Result<_>>()?,
            ln_f: ln_params(&mut rng, c, dtype, dev)?,
            cfg,
        })
    }

    pub fn vars(&self) -> Vec<&Var> {
        let mut v = vec![&self.wte, &self.wpe, &self.ln_f.0, &self.ln_f.1];
        for b in &self.blocks {
            v.extend(b.vars());
        }
        v
    }

    /// Embedding glue (with tape-seeded dropout on the embeddings).
    pub fn embed(&self, tape: &Tape<'_>, idx: &Tensor) -> Result<Tensor> {
        let (_b, t) = idx.dims2()?;
        let tok = candle_nn::Embedding::new(self.wte.as_tensor().clone(), self.cfg.n_embd)
            .forward(idx)?;
        let pos = self.wpe.as_tensor().narrow(0, 0, t)?;
        let x = tok.broadcast_add(&pos)?;
        Ok(tape.dropout(&x, self.cfg.dropout)?)
    }

    /// Head glue: final LN and tied lm_head, cross-entropy loss.
    pub fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = ln(x, &self.ln_f, false)?.reshape((b * t, c))?;
        let logits = h.matmul(&self.wte.as_tensor().t()?)?;
        candle_nn::loss::cross_entropy(&logits, &targets.reshape(b * t)?)
    }

    /// Full loss with the blocks run according to `plan`.
    pub fn loss<'a>(
        &'a self,
        tape: &Tape<'a>,
        plan: &Plan,
        idx: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor> {
        let x = self.embed(tape, idx)?;
        let x = plan.forward(tape, &x, |i, h| self.blocks[i].forward(h))?;
        self.head_loss(&x, targets)
    }
}

pub fn tokens(
    seed: u64,
    b: usize,
    t: usize,
    vocab: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut rng = rng(seed);
    let v: Vec<u32> = (0..b * (t + 1))
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    let all = Tensor::from_vec(v, (b, t + 1), dev)?;
    Ok((all.narrow(1, 0, t)?, all.narrow(1, 1, t)?.contiguous()?))
}

/// Costs of a chain of `n` identical blocks (for planning in tests, not measured).
pub fn uniform_costs(n: usize, act_bytes: u64, out_bytes: u64, fwd_ns: u64) -> ChainCosts {
    ChainCosts::uniform(
        n,
        BlockCost {
            act_bytes,
            out_bytes,
            fwd_ns,
        },
    )
}
