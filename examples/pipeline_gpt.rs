//! Pipeline-parallel training of a small GPT-like chain (embed -> blocks -> head) on CPU threads.
//!
//! Run: `cargo run --release --example pipeline_gpt`
//!
//! Shows the path from a model written as plain structs with `forward(&self, x)` and a `VarMap`
//! to a pipeline step: wrap each link as a `Layer` with its variables, split by parameter count,
//! run a 1F1B schedule on 2 worker threads, apply the returned `GradStore` with AdamW.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, Optimizer, VarBuilder, VarMap};
use candle_pipeline::{
    split_by_params, vars_with_prefix, Layer, LossReduction, Microbatches, Pipeline, Schedule,
};

const VOCAB: usize = 16;
const D_MODEL: usize = 64;
const SEQ: usize = 32;
const BATCH: usize = 8;

/// A residual MLP block (pre-norm with a differentiable RMS norm).
struct Block {
    up: Linear,
    down: Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            up: candle_nn::linear(D_MODEL, 4 * D_MODEL, vb.pp("up"))?,
            down: candle_nn::linear(4 * D_MODEL, D_MODEL, vb.pp("down"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rms = x
            .sqr()?
            .mean_keepdim(D::Minus1)?
            .affine(1.0, 1e-5)?
            .sqrt()?;
        let h = x.broadcast_div(&rms)?;
        x + self.down.forward(&self.up.forward(&h)?.gelu()?)?
    }
}

fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);

    // The model as a chain of plain structs.
    let embed = candle_nn::embedding(VOCAB, D_MODEL, vb.pp("embed"))?;
    let blocks = (0..4)
        .map(|i| Block::new(vb.pp(format!("blocks.{i}"))))
        .collect::<Result<Vec<_>>>()?;
    let head = candle_nn::linear(D_MODEL, VOCAB, vb.pp("head"))?;

    // Chain -> layers with their variables -> 2 stages balanced by parameter count.
    let mut layers = vec![Layer::new(
        vars_with_prefix(&varmap, "embed."),
        move |x: &Tensor| Embedding::forward(&embed, x),
    )];
    for (i, b) in blocks.into_iter().enumerate() {
        layers.push(Layer::new(
            vars_with_prefix(&varmap, &format!("blocks.{i}.")),
            move |x: &Tensor| b.forward(x),
        ));
    }
    layers.push(Layer::new(
        vars_with_prefix(&varmap, "head."),
        move |x: &Tensor| head.forward(x),
    ));
    let stages = split_by_params(layers, 2)?;
    let loss = |logits: &Tensor, targets: &Tensor| {
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)
    };
    let pipe = Pipeline::new(stages, vec![dev.clone(); 2], loss)?.with_cpu_threads(1)?;

    // Toy task: predict the next token of `t -> (3t + 1) mod VOCAB` sequences.
    let seqs: Vec<u32> = (0..BATCH * (SEQ + 1))
        .map(|i| {
            let (row, pos) = (i / (SEQ + 1), i % (SEQ + 1));
            (0..pos).fold(row as u32, |t, _| (3 * t + 1) % VOCAB as u32)
        })
        .collect();
    let data = Tensor::from_vec(seqs, (BATCH, SEQ + 1), &dev)?;
    let (x, y) = (data.narrow(1, 0, SEQ)?, data.narrow(1, 1, SEQ)?);
    let batch = Microbatches::split(&x, &y, 4, LossReduction::Mean)?;
    let schedule = Schedule::one_f_one_b(2, 4)?;

    let mut opt = candle_nn::AdamW::new_lr(varmap.all_vars(), 3e-3)?;
    let mut last = None;
    for step in 0..30 {
        let out = pipe.step(&schedule, &batch)?;
        opt.step(&out.grads)?;
        if step % 10 == 0 {
            println!("step {step:2}: loss {:.4}", out.loss);
        }
        last = Some(out);
    }
    if let Some(out) = last {
        println!("last step: loss {:.4}\n{}", out.loss, out.report(64));
        println!(
            "predicted bubble with the measured stage times: {:.1}%",
            100.0 * out.predicted(&schedule)?.bubble()
        );
    }
    Ok(())
}
