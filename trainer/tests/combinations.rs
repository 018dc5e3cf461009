//! Every way of running a step composes, and each gives the plain f32 computation.
//!
//! Cells: {plain, remat every:1, remat budget} x {f32, bf16, f16 with a dynamic scale} x
//! {no pipeline, 2-stage 1F1B, 2-stage interleaved (4 virtual stages)}, with dropout 0.1 and
//! 2 accumulated micro-batches (27 cells), plus the 9 f32 cells with dropout 0 and no
//! accumulation: 36 cells. Each cell's gradients (per parameter), global gradient norm and
//! loss are compared with the plain f32 run of the same (dropout, accumulation), on the same
//! batches and dropout seeds; then one `train_step` of the cell is compared with the
//! reference's.
//!
//! Tolerances (relative; per parameter: ||g - g_ref|| / ||g_ref||):
//! - f32 without pipeline: 0, bit for bit (remat recomputes the same ops on the same values);
//! - f32 with a pipeline: 1e-5 per parameter, 1e-6 norm and loss: only the order of f32 sums
//!   over microbatches differs (measured <= 2e-7);
//! - bf16: 3e-2 per parameter, 5e-3 norm and loss: bf16 keeps 8 significant bits (2^-8 =
//!   3.9e-3 per rounding) and the error compounds over 4 blocks (measured 1.0e-2 on the worst
//!   parameter, a LayerNorm scale, whose gradient sums over every position; 1.1e-3 on the
//!   norm): about 3x and 5x margin;
//! - f16: 4e-3 per parameter, 5e-4 norm and loss (11 bits, 2^-11 = 4.9e-4 per rounding;
//!   measured 1.2e-3 and 1.1e-4).
//!
//! And remat is exact everywhere: a cell with remat gives the same bits as the same cell
//! without (pipeline stages recompute their blocks with the same masks).
//!
//! The f16 cells see the loss scale in their gradients (2^16), which is divided out, and
//! check that it is there: forgetting to scale (or to unscale) fails by 2^16.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod common;

use candle_core::backprop::GradStore;
use common::{tiny_config, values};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use trainer::config::{Arch, TrainConfig};
use trainer::data::{Batch, Split};
use trainer::model::Ctx;
use trainer::train::{Executor, Trainer};

struct Cell {
    arch: Arch,
    remat: &'static str,
    dtype: &'static str,
    pipeline: &'static str,
    dropout: f32,
    accum: usize,
}

impl Cell {
    fn name(&self) -> String {
        format!(
            "{} / remat {} / {} / pipeline {} / dropout {} / accum {}",
            self.arch, self.remat, self.dtype, self.pipeline, self.dropout, self.accum
        )
    }

    fn config(&self, dir: &std::path::Path) -> TrainConfig {
        let (stages, schedule) = match self.pipeline {
            "none" => (1, "1f1b"),
            "1f1b" => (2, "1f1b"),
            _ => (2, "interleaved:2"),
        };
        TrainConfig {
            n_layer: 4,
            batch_size: 6,
            microbatches: 3,
            pipeline_stages: stages,
            schedule: schedule.parse().unwrap(),
            pipeline_threads: 1,
            remat: match self.remat {
                // Stores some blocks and recomputes others: each block keeps ~170 KiB of
                // activations in f32 at batch 6, half of that in 16-bit.
                BUDGET if self.dtype == "f32" => "budget:400KiB".parse().unwrap(),
                BUDGET => "budget:200KiB".parse().unwrap(),
                r => r.parse().unwrap(),
            },
            dtype: self.dtype.parse().unwrap(),
            loss_scale: if self.dtype == "f16" {
                "dynamic".parse().unwrap()
            } else {
                "auto".parse().unwrap()
            },
            dropout: self.dropout,
            grad_accum: self.accum,
            arch: self.arch,
            // GQA: 2 query heads share 1 key/value head.
            n_kv_head: 1,
            tie_embeddings: self.arch == Arch::Gpt2,
            // Llama: no biases (a k bias gets almost no gradient, so its relative error in
            // bf16 measures noise; the transformers fixtures check the biases).
            bias: self.arch == Arch::Gpt2,
            ..tiny_config(dir)
        }
    }
}

/// Remat under a byte budget (see [`Cell::config`]).
const BUDGET: &str = "budget";

fn cells() -> Vec<Cell> {
    let mut v = Vec::new();
    for remat in ["none", "every:1", BUDGET] {
        for dtype in ["f32", "bf16", "f16"] {
            for pipeline in ["none", "1f1b", "interleaved"] {
                v.push(Cell {
                    arch: Arch::Gpt2,
                    remat,
                    dtype,
                    pipeline,
                    dropout: 0.1,
                    accum: 2,
                });
                if dtype == "f32" {
                    v.push(Cell {
                        arch: Arch::Gpt2,
                        remat,
                        dtype,
                        pipeline,
                        dropout: 0.0,
                        accum: 1,
                    });
                }
            }
        }
    }
    v
}

/// The micro-batches of a step (the same for every cell: a fixed RNG).
fn batches(t: &mut Trainer, accum: usize) -> Vec<Batch> {
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let (bs, block) = (t.config.batch_size, t.config.block_size);
    (0..accum)
        .map(|_| {
            t.data
                .batch(Split::Train, bs, block, &mut rng, &t.device)
                .unwrap()
        })
        .collect()
}

/// Loss and unscaled gradients (keyed by parameter name) of one accumulated step.
fn gradients(t: &mut Trainer, accum: usize) -> (f64, Vec<(String, Vec<f64>)>) {
    let dtype = t.config.dtype.dtype();
    let model = t.model.to_dtype(dtype).unwrap();
    let scale = t.amp().scale();
    let mut total = GradStore::default();
    let mut loss = 0.0;
    for (k, batch) in batches(t, accum).iter().enumerate() {
        let ctx = Ctx::train(1000 + k as u64)
            .with_dtype(dtype)
            .with_kernels(t.config.kernels);
        let weight = scale / accum as f64;
        let (l, _, g) = t
            .executor()
            .forward_backward(model.as_ref(), batch, &ctx, weight, &t.objective)
            .unwrap();
        loss += f64::from(l) / accum as f64;
        for (_, v) in t.params.iter() {
            if let Some(g) = g.get(v) {
                let sum = match total.get(v) {
                    Some(prev) => (prev + g).unwrap(),
                    None => g.clone(),
                };
                total.insert(v, sum);
            }
        }
    }
    let grads = t
        .params
        .iter()
        .map(|(name, v)| {
            let g = total
                .get(v)
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            let g: Vec<f64> = values(g);
            (name.clone(), g.into_iter().map(|x| x / scale).collect())
        })
        .collect();
    (loss, grads)
}

fn norm(g: &[(String, Vec<f64>)]) -> f64 {
    g.iter()
        .flat_map(|(_, v)| v)
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
}

/// Worst per-parameter relative L2 difference, and which parameter.
fn worst(got: &[(String, Vec<f64>)], want: &[(String, Vec<f64>)]) -> (f64, String) {
    let mut w = (0.0, String::new());
    for ((name, g), (_, r)) in got.iter().zip(want) {
        let (mut d2, mut r2) = (0.0, 0.0);
        for (a, b) in g.iter().zip(r) {
            assert!(a.is_finite(), "{name}: non-finite gradient {a}");
            d2 += (a - b) * (a - b);
            r2 += b * b;
        }
        let rel = if r2 > 0.0 {
            (d2 / r2).sqrt()
        } else {
            d2.sqrt()
        };
        if rel > w.0 {
            w = (rel, name.clone());
        }
    }
    w
}

#[test]
fn every_combination_matches_the_plain_f32_step() {
    let all = cells();
    assert!(all.len() >= 24);
    check_cells(&all);
}

/// A Llama-family model (GQA, RoPE, RMSNorm, SwiGLU, untied head with the chunked loss) in
/// every executor and precision: {no remat, every:1} x {f32, bf16} x {no pipeline, 1F1B,
/// interleaved}, attention dropout 0.1, 2 accumulated micro-batches, no biases (12 cells; f16 shares
/// bf16's code path and GPT-2's cells cover its scaler). Same tolerances as GPT-2's.
#[test]
fn llama_combinations_match_the_plain_f32_step() {
    let mut all = Vec::new();
    for remat in ["none", "every:1"] {
        for dtype in ["f32", "bf16"] {
            for pipeline in ["none", "1f1b", "interleaved"] {
                all.push(Cell {
                    arch: Arch::Llama,
                    remat,
                    dtype,
                    pipeline,
                    dropout: 0.1,
                    accum: 2,
                });
            }
        }
    }
    check_cells(&all);
}

fn check_cells(all: &[Cell]) {
    let tmp = tempfile::tempdir().unwrap();
    let mut report = Vec::new();
    let mut no_remat = std::collections::HashMap::new();
    for (i, cell) in all.iter().enumerate() {
        let reference = Cell {
            remat: "none",
            dtype: "f32",
            pipeline: "none",
            ..*cell
        };
        let mut r = Trainer::new(reference.config(&tmp.path().join(format!("ref{i}")))).unwrap();
        let mut t = Trainer::new(cell.config(&tmp.path().join(format!("cell{i}")))).unwrap();
        let name = cell.name();
        match (cell.remat, cell.pipeline, t.executor()) {
            ("none", "none", Executor::Plain) => {}
            (_, "none", Executor::Remat(plan)) if cell.remat == BUDGET => {
                let ck = (0..plan.len()).filter(|&b| plan.is_checkpointed(b)).count();
                assert!(0 < ck && ck < plan.len(), "{name}: budget plan {plan}");
            }
            (_, "none", Executor::Remat(_)) | (_, _, Executor::Pipeline(_)) => {}
            _ => panic!("{name}: unexpected executor"),
        }
        let (loss_ref, g_ref) = gradients(&mut r, cell.accum);
        let (loss, g) = gradients(&mut t, cell.accum);
        let (w, at) = worst(&g, &g_ref);
        let key = (
            cell.dtype,
            cell.pipeline,
            cell.dropout.to_bits(),
            cell.accum,
        );
        match no_remat.get(&key) {
            None => {
                assert_eq!(cell.remat, "none", "cells without remat come first");
                no_remat.insert(key, g.clone());
            }
            Some(plain) => assert!(g == *plain, "{name}: remat changed the gradients"),
        }
        let dn = (norm(&g) - norm(&g_ref)).abs() / norm(&g_ref);
        let dl = (loss - loss_ref).abs() / loss_ref;
        let (tp, tn) = match (cell.dtype, cell.pipeline) {
            ("f32", "none") => (0.0, 0.0),
            ("f32", _) => (1e-5, 1e-6),
            ("bf16", _) => (3e-2, 5e-3),
            _ => (4e-3, 5e-4),
        };
        assert!(w <= tp, "{name}: gradient of {at} off by {w:e}");
        assert!(dn <= tn, "{name}: gradient norm off by {dn:e}");
        assert!(dl <= tn, "{name}: loss off by {dl:e}");
        if cell.dtype == "f16" {
            assert_eq!(t.amp().scale(), 65536.0, "{name}: the f16 cells run scaled");
        }
        // One whole step (data, dropout seeds, accumulation, scaler, clipping, AdamW).
        let (s_ref, s) = (r.train_step().unwrap(), t.train_step().unwrap());
        let dl = (f64::from(s.loss) - f64::from(s_ref.loss)).abs() / f64::from(s_ref.loss);
        assert!(dl <= tn, "{name}: step loss {} vs {}", s.loss, s_ref.loss);
        assert!(!s.skipped, "{name}: skipped a step");
        let dsn = (f64::from(s.grad_norm) - f64::from(s_ref.grad_norm)).abs()
            / f64::from(s_ref.grad_norm);
        assert!(
            dsn <= tn.max(1e-6),
            "{name}: step grad norm {} vs {}",
            s.grad_norm,
            s_ref.grad_norm
        );
        report.push(format!("{name}: grad {w:.1e} ({at}), norm {dn:.1e}"));
    }
    eprintln!("{}", report.join("\n"));
}
