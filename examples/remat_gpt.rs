//! Training a small GPT with activation checkpointing (`candle-remat`) over fused attention and
//! LayerNorm (`candle-fused`).
//!
//! `cargo run --release --example remat_gpt -- [none|sqrt|k<K>|budget<MiB>]`
//!
//! The blocks are plain structs with `forward(&self, x)`; the only changes to an ordinary
//! training step are `plan.forward(&tape, ..)` over the blocks and `tape.backward(&loss)`
//! instead of `loss.backward()`. The first step also checks that the checkpointed gradients are
//! bit-identical to plain Candle's.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_fused::attention::{attention, AttentionConfig};
use candle_fused::norm::layer_norm;
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_remat::{BlockCost, ChainCosts, Plan, Policy, Tape};

const VOCAB: usize = 64;
const C: usize = 64;
const H: usize = 4;
const T: usize = 32;
const B: usize = 4;
const LAYERS: usize = 8;

struct Ln {
    w: Tensor,
    b: Tensor,
}

impl Ln {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            w: vb.get_with_hints(C, "w", candle_nn::Init::Const(1.0))?,
            b: vb.get_with_hints(C, "b", candle_nn::Init::Const(0.0))?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        layer_norm(x, &self.w, Some(&self.b), 1e-5) // fused LayerNorm: saves mean/rstd
    }
}

struct Block {
    ln1: Ln,
    qkv: candle_nn::Linear,
    proj: candle_nn::Linear,
    ln2: Ln,
    fc: candle_nn::Linear,
    fc2: candle_nn::Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            ln1: Ln::new(vb.pp("ln1"))?,
            qkv: candle_nn::linear(C, 3 * C, vb.pp("qkv"))?,
            proj: candle_nn::linear(C, C, vb.pp("proj"))?,
            ln2: Ln::new(vb.pp("ln2"))?,
            fc: candle_nn::linear(C, 4 * C, vb.pp("fc"))?,
            fc2: candle_nn::linear(4 * C, C, vb.pp("fc2"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let head = |i: usize| {
            qkv.narrow(D::Minus1, i * C, C)?
                .reshape((b, t, H, C / H))?
                .transpose(1, 2)?
                .contiguous()
        };
        // fused causal attention (candle-fused): keeps q, k, v, the output and the row
        // log-sum-exp, not T x T; its recompute under checkpointing is bit-identical
        let att = AttentionConfig::causal().with_scale(1.0 / ((C / H) as f64).sqrt());
        let y = attention(&head(0)?, &head(1)?, &head(2)?, &att)?;
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b, t, C))?;
        let x = (x + candle_remat::dropout(&self.proj.forward(&y)?, 0.1)?)?;
        let h = self.fc.forward(&self.ln2.forward(&x)?)?.gelu()?;
        &x + candle_remat::dropout(&self.fc2.forward(&h)?, 0.1)?
    }
}

struct Model {
    wte: candle_nn::Embedding,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: Ln,
    head: candle_nn::Linear,
}

impl Model {
    /// The tape borrows the model for `'a`: segment closures keep `&self.blocks[i]`.
    fn loss<'a>(
        &'a self,
        tape: &Tape<'a>,
        plan: &Plan,
        idx: &Tensor,
        tgt: &Tensor,
    ) -> Result<Tensor> {
        let h = self.wte.forward(idx)?.broadcast_add(&self.wpe)?;
        let h = plan.forward(tape, &h, |i, x| self.blocks[i].forward(x))?;
        let logits = self
            .head
            .forward(&self.ln_f.forward(&h)?)?
            .reshape((B * T, VOCAB))?;
        Ok(candle_nn::loss::cross_entropy(&logits, tgt)?)
    }
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let arg = std::env::args().nth(1).unwrap_or_else(|| "sqrt".into());
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let model = Model {
        wte: candle_nn::embedding(VOCAB, C, vb.pp("wte"))?,
        wpe: vb.get_with_hints(
            (T, C),
            "wpe",
            candle_nn::Init::Randn {
                mean: 0.,
                stdev: 0.02,
            },
        )?,
        blocks: (0..LAYERS)
            .map(|i| Block::new(vb.pp(format!("h{i}"))))
            .collect::<Result<_>>()?,
        ln_f: Ln::new(vb.pp("ln_f"))?,
        head: candle_nn::linear_no_bias(C, VOCAB, vb.pp("head"))?,
    };

    // Per-block costs: here estimated by hand (candle_remat::measure_chain measures them).
    let act = (B * T * C * 4 * 20 + B * H * T * T * 4 * 4) as u64;
    let costs = ChainCosts::uniform(
        LAYERS,
        BlockCost {
            act_bytes: act,
            out_bytes: (B * T * C * 4) as u64,
            fwd_ns: 1,
        },
    );
    let policy = match arg.as_str() {
        "none" => Policy::None,
        "sqrt" => Policy::SqrtN,
        s if s.starts_with('k') => Policy::EveryK(s[1..].parse()?),
        s if s.starts_with("budget") => Policy::Budget(s[6..].parse::<u64>()? << 20),
        s => anyhow::bail!("unknown policy {s}"),
    };
    let plan = policy.plan(&costs)?;
    println!("{plan}");

    // A learnable toy task: predict (token + 1) mod VOCAB.
    let x: Vec<u32> = (0..B * T)
        .map(|i| ((i * 7 + i / T) % VOCAB) as u32)
        .collect();
    let idx = Tensor::from_vec(x.clone(), (B, T), &dev)?;
    let tgt = Tensor::from_vec(
        x.iter().map(|v| (v + 1) % VOCAB as u32).collect::<Vec<_>>(),
        B * T,
        &dev,
    )?;
    let vars: Vec<candle_core::Var> = {
        // sorted by name: all_vars() comes in HashMap order
        let data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned varmap"))?;
        let mut named: Vec<_> = data.iter().collect();
        named.sort_by(|a, b| a.0.cmp(b.0));
        named.into_iter().map(|(_, v)| v.clone()).collect()
    };
    let mut opt = candle_nn::AdamW::new(
        vars.clone(),
        candle_nn::ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )?;

    for step in 0..20u64 {
        let tape = Tape::new(step); // per-step seed: dropout masks are reproduced on recompute
        let loss = model.loss(&tape, &plan, &idx, &tgt)?;
        let grads = tape.backward(&loss)?;
        if step == 0 {
            let plain_tape = Tape::new(step);
            let plain = model
                .loss(&plain_tape, &Policy::None.plan(&costs)?, &idx, &tgt)?
                .backward()?;
            let identical = vars.iter().all(|v| match (grads.get(v), plain.get(v)) {
                (Some(a), Some(b)) => a
                    .eq(b)
                    .and_then(|e| e.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>())
                    .map(|m| m == 1.0)
                    .unwrap_or(false),
                (None, None) => true,
                _ => false,
            });
            println!("gradients bit-identical to plain loss.backward(): {identical}");
        }
        opt.step(&grads)?;
        if step % 5 == 0 || step == 19 {
            println!("step {step:2}  loss {:.4}", loss.to_scalar::<f32>()?);
        }
    }
    Ok(())
}
