//! Pipeline-parallel training of the trainer's GPT on CPU threads: the model's chain
//! (`Gpt::links`: embedding, blocks, head) cut into `candle-pipeline` stages.
//!
//! ```text
//! cargo run --release --example pipeline_gpt -- [--recompute]
//! ```
//!
//! Each link becomes a `Layer` with the parameters it reads (`Params::vars_of`), told which
//! microbatch it runs for (`Layer::with_call`): dropout is keyed by the step (`call.key`) and
//! the microbatch's first row (`call.row`), so every row draws the mask the whole batch would.
//! The layers are split into 2 stages balanced by parameter count (with `--recompute`, each
//! block keeps only its input and is recomputed in backward), run by a 1F1B schedule on 2
//! worker threads; the trainer's AdamW applies the returned gradients.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_nn::Optimizer as _;
use candle_train::pipeline::{
    balance_by_params, split_layers, Call, Layer, LossReduction, Microbatches, Pipeline, Schedule,
    Stage,
};
use candle_train::trainer::model::gpt2::{Gpt, GptConfig};
use candle_train::trainer::model::{cross_entropy, Ctx, Model};
use candle_train::trainer::optim::{AdamW, AdamWConfig};

const SEQ: usize = 32;
const BATCH: usize = 8;
const STEPS: usize = 30;

fn main() -> Result<()> {
    let recompute = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--recompute") => true,
        Some(other) => bail!("unknown argument `{other}` (expected --recompute or nothing)"),
    };
    let dev = Device::Cpu;
    let cfg = GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 64,
        block_size: SEQ,
        vocab_size: 16,
        dropout: 0.1,
        ..GptConfig::default()
    };
    let (model, params) = Gpt::new(&cfg, 7, &dev)?;

    // The chain as layers (dropout keyed by the call), balanced into 2 stages.
    let links = model.links();
    let layers: Vec<Layer> = (links.iter().cloned())
        .map(|link| {
            Layer::with_call(params.vars_of(&link.weights()), move |x, call: &Call| {
                link.forward(x, &Ctx::train(call.key).with_row(call.row))
            })
        })
        .collect();
    let ranges = balance_by_params(&layers, 2)?;
    let mut stages: Vec<Box<dyn Stage>> = Vec::new();
    for (stage, range) in split_layers(layers, &ranges)?.into_iter().zip(&ranges) {
        // With --recompute, each block keeps only its input and is recomputed in backward.
        let blocks = (0..range.len()).filter(|&i| recompute && links[range.start + i].is_block());
        let stage = stage.with_recompute(blocks.map(|i| i..i + 1).collect())?;
        println!(
            "stage: links {range:?}, recomputed {:?}",
            stage.recomputed()
        );
        stages.push(Box::new(stage));
    }
    let loss = |logits: &Tensor, targets: &Tensor| cross_entropy(logits, targets, None);
    let pipe = Pipeline::new(stages, vec![dev.clone(); 2], loss)?.with_cpu_threads(1)?;

    // Toy task: predict the next token of `t -> (3t + 1) mod 16` sequences.
    let seqs: Vec<u32> = (0..BATCH * (SEQ + 1))
        .map(|i| {
            let (row, pos) = (i / (SEQ + 1), i % (SEQ + 1));
            (0..pos).fold(row as u32, |t, _| (3 * t + 1) % cfg.vocab_size as u32)
        })
        .collect();
    let data = Tensor::from_vec(seqs, (BATCH, SEQ + 1), &dev)?;
    let (x, y) = (data.narrow(1, 0, SEQ)?, data.narrow(1, 1, SEQ)?);
    let schedule = Schedule::one_f_one_b(2, 4)?;
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    opt.set_learning_rate(3e-3);

    let mut last = None;
    for step in 0..STEPS {
        // 4 microbatches; the step is the dropout key.
        let batch = Microbatches::split(&x, &y, 4, LossReduction::Mean)?.with_key(step as u64);
        let out = pipe.step(&schedule, &batch)?;
        opt.apply(&out.grads)?;
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
