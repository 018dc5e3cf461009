//! A custom objective plugged into the trainer: label-smoothed cross-entropy (written in
//! `objective.rs`, next to this file) trains a tiny Llama (chunked head, bf16, activation
//! checkpointing) on the embedded addition task. With epsilon 0 every step's loss is the
//! built-in cross-entropy's bit for bit; with 0.1 the run trains on the smoothed loss.
//!
//! ```text
//! cargo run --release --example label_smoothing
//! ```

mod objective;

use objective::LabelSmoothing;
use trainer::config::{Arch, TrainConfig};
use trainer::train::Trainer;

/// The losses of `steps` optimiser steps under label smoothing `eps` (`None`: the trainer's
/// built-in cross-entropy), writing nothing.
pub fn losses(eps: Option<f64>, steps: usize) -> anyhow::Result<Vec<f32>> {
    let config = TrainConfig {
        arch: Arch::Llama,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        batch_size: 8,
        max_iters: steps,
        dtype: "bf16".parse().map_err(anyhow::Error::msg)?,
        remat: "every:1".parse().map_err(anyhow::Error::msg)?,
        // a given peak skips the start-up matmul benchmark (MFU only)
        peak_flops: 1e12,
        ..TrainConfig::default()
    };
    let mut t = match eps {
        Some(eps) => Trainer::builder()
            .config(config)
            .objective(LabelSmoothing { eps }),
        None => Trainer::builder().config(config),
    }
    .build()?;
    (0..steps).map(|_| Ok(t.train_step()?.loss)).collect()
}

pub fn main() -> anyhow::Result<()> {
    let steps = 10;
    let built_in = losses(None, steps)?;
    let zero = losses(Some(0.0), steps)?;
    let smoothed = losses(Some(0.1), steps)?;
    println!("step  cross-entropy  smoothing 0    smoothing 0.1");
    for (i, ((a, b), c)) in built_in.iter().zip(&zero).zip(&smoothed).enumerate() {
        println!("{:>4}  {a:<13}  {b:<13}  {c}", i + 1);
    }
    let same = built_in
        .iter()
        .zip(&zero)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    anyhow::ensure!(
        same,
        "smoothing 0 is not the built-in cross-entropy bit for bit"
    );
    anyhow::ensure!(smoothed != built_in, "smoothing 0.1 changed nothing");
    println!("smoothing 0: the built-in objective's losses, bit for bit");
    Ok(())
}
