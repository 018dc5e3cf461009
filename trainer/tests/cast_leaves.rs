//! The bf16 step's weights in the compute dtype: under the plain executor they are leaves of
//! their own, whose gradients go onto the f32 master weights after backward
//! (`trainer/src/train/cast.rs`); under activation checkpointing they are cast differentiably
//! (Candle's `ToDType` backward). Both give the same losses, gradient norms, weights and AdamW
//! state, bit for bit, with a tied embedding (one master cast twice) and without, over
//! gradient accumulation.

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device};
use common::tiny_config;
use trainer::config::{Arch, TrainConfig};
use trainer::train::Trainer;

/// Each step's `(loss, grad_norm)` bits, and every tensor of the last checkpoint's weights and
/// optimiser state as f32 bits, after three bf16 steps.
type Run = (Vec<(u32, u32)>, BTreeMap<String, Vec<u32>>);

fn run(dir: &std::path::Path, tied: bool, remat: &str) -> Run {
    let config = TrainConfig {
        arch: Arch::Llama,
        n_kv_head: 1,
        bias: false,
        tie_embeddings: tied,
        dtype: "bf16".parse().unwrap(),
        remat: remat.parse().unwrap(),
        grad_accum: 2,
        warmup_iters: 0,
        lr: 3e-3,
        ..tiny_config(dir)
    };
    let mut t = Trainer::new(config).unwrap();
    let steps = (0..3)
        .map(|_| {
            let s = t.train_step().unwrap();
            (s.loss.to_bits(), s.grad_norm.to_bits())
        })
        .collect();
    let checkpoint = t.save_checkpoint().unwrap();
    let mut tensors = BTreeMap::new();
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let saved = candle_core::safetensors::load(checkpoint.join(file), &Device::Cpu).unwrap();
        for (name, tensor) in saved {
            let values = tensor.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let bits = values
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            tensors.insert(format!("{file} {name}"), bits);
        }
    }
    (steps, tensors)
}

#[test]
fn cast_leaves_train_as_the_differentiable_cast_bit_for_bit() {
    for tied in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let (leaf_steps, leaf) = run(&tmp.path().join("plain"), tied, "none");
        let (cast_steps, cast) = run(&tmp.path().join("remat"), tied, "every:1");
        assert_eq!(leaf_steps, cast_steps, "tied {tied}: losses and norms");
        assert_eq!(
            leaf.keys().collect::<Vec<_>>(),
            cast.keys().collect::<Vec<_>>(),
            "tied {tied}"
        );
        for (name, bits) in &leaf {
            assert!(bits == &cast[name], "tied {tied}: {name} differs");
        }
    }
}
