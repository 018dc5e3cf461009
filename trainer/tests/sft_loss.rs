//! Supervised fine-tuning's loss, where it can go wrong: a packed row equals its examples run
//! one by one (and padded), masked targets (prompts, padding) count for nothing while counted
//! ones do, and a step's loss and gradient are the same however it is split (1 x 8, 2 x 4 and
//! 4 x 2 micro-batches, 2 data-parallel ranks): the sum of token losses over the counted
//! targets of the whole step, as the Hugging Face Trainer computes it.
//!
//! The model: a tiny fresh Llama saved as a base, with LoRA adapters whose B is set non-zero
//! (so every adapter parameter has a gradient); the data: chats rendered with the Qwen2.5
//! template of `tests/fixtures/chat/qwen2_5` (loss on the assistant turns only).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_comm::run_threads;
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use common::{max_abs, max_abs_diff, run_to_end, tiny_config};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use trainer::config::{Arch, TrainConfig};
use trainer::data::{Batch, DataKind, Split};
use trainer::model::{Ctx, IGNORE};
use trainer::train::Trainer;

/// A base model directory (fresh tiny Llama, vocabulary 336) with the Qwen2.5-style
/// tokenizer and chat template, and a JSONL file of chats.
fn setup(tmp: &Path) -> (PathBuf, PathBuf) {
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/qwen2_5");
    let base = tmp.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(chat.join(f), base.join(f)).unwrap();
    }
    let fresh = TrainConfig {
        arch: Arch::Llama,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 32,
        block_size: 256,
        ..TrainConfig::default()
    };
    let config = fresh.model_config(336).unwrap();
    let (_, params) = trainer::model::init(config.as_ref(), 5, &Device::Cpu).unwrap();
    trainer::checkpoint::save_model(&base, config.as_ref(), &params).unwrap();
    let words = [
        "the", "king", "is", "dead", "long", "live", "queen", "what", "say", "you", "good",
        "night", "sweet", "prince", "my", "lord", "to", "be", "or", "not",
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut text = |n: usize| -> String {
        use rand::Rng;
        (0..n)
            .map(|_| words[rng.random_range(0..words.len())])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut lines = Vec::new();
    for i in 0..24 {
        let mut msgs = Vec::new();
        // Most with a short system turn (the template's default one is long).
        if i % 6 != 0 {
            msgs.push(serde_json::json!({"role": "system", "content": text(3)}));
        }
        for _ in 0..1 + i % 2 {
            msgs.push(serde_json::json!({"role": "user", "content": text(2 + i % 5)}));
            msgs.push(serde_json::json!({"role": "assistant", "content": text(1 + i % 4)}));
        }
        lines.push(serde_json::json!({ "messages": msgs }).to_string());
    }
    let data = tmp.join("chats.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    (base, data)
}

fn sft_config(tmp: &Path, base: &Path, data: &Path, packing: bool) -> TrainConfig {
    TrainConfig {
        init_from: Some(base.display().to_string()),
        data: DataKind::Sft,
        data_path: Some(data.to_path_buf()),
        packing,
        lora_r: 4,
        lora_alpha: 8.0,
        block_size: 160,
        batch_size: 2,
        max_iters: 1,
        lr: 1e-3,
        weight_decay: 0.0,
        val_fraction: 0.2,
        ..tiny_config(&tmp.join("run"))
    }
}

/// A trainer whose adapters' B are non-zero (drawn from a fixed seed).
fn trainer_with_live_adapters(cfg: TrainConfig) -> Trainer {
    let t = Trainer::new(cfg).unwrap();
    for (i, (name, var)) in t.params.iter().enumerate() {
        if name.ends_with("lora_B.weight") {
            let b = Tensor::randn(0f32, 0.5, var.shape(), &Device::Cpu).unwrap();
            let _ = i;
            var.set(&b).unwrap();
        }
    }
    t
}

/// A training batch of 2 rows of 160 tokens drawn with seed `seed`.
fn train_batch(t: &Trainer, seed: u64) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    t.data
        .batch(Split::Train, 2, 160, &mut rng, &Device::Cpu)
        .unwrap()
}

/// The sum of the counted targets' losses of `batch` and its gradients.
fn loss_sum(t: &Trainer, batch: &Batch) -> (f64, usize, GradStore) {
    let ctx = Ctx::eval().with_rows(batch.rows.clone());
    let loss = t
        .model
        .loss(&batch.x, &batch.targets().unwrap(), &ctx)
        .unwrap();
    let sum = loss.sum().unwrap();
    let grads = sum.backward().unwrap();
    (
        f64::from(sum.to_scalar::<f32>().unwrap()),
        loss.count().unwrap(),
        grads,
    )
}

fn vec2(t: &Tensor) -> Vec<Vec<u32>> {
    t.to_vec2().unwrap()
}

/// max |a - b| over max |b|, over every adapter gradient.
fn grads_rel(t: &Trainer, a: &GradStore, b: &GradStore) -> f32 {
    let mut worst = 0f32;
    for (_, v) in t.params.iter() {
        let (x, y) = (a.get(v.as_tensor()).unwrap(), b.get(v.as_tensor()).unwrap());
        worst = worst.max(max_abs_diff(x, y) / max_abs(y).max(1e-12));
    }
    worst
}

fn add_into(acc: &mut Option<GradStore>, g: GradStore, t: &Trainer) {
    match acc {
        None => *acc = Some(g),
        Some(a) => {
            for (_, v) in t.params.iter() {
                let s = (a.get(v.as_tensor()).unwrap() + g.get(v.as_tensor()).unwrap()).unwrap();
                a.insert(v.as_tensor(), s);
            }
        }
    }
}

#[test]
fn a_packed_row_equals_its_examples_one_by_one_and_padded() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = setup(tmp.path());
    let t = trainer_with_live_adapters(sft_config(tmp.path(), &base, &data, true));
    let batch = train_batch(&t, 11);
    let (packed, count, packed_grads) = loss_sum(&t, &batch);
    let (x, y, docs) = (
        vec2(&batch.x),
        vec2(&batch.y),
        vec2(batch.rows.doc_ids.as_ref().unwrap()),
    );
    let mask: Vec<Vec<f32>> = batch.mask.as_ref().unwrap().to_vec2().unwrap();
    let (mut alone, mut alone_count, mut padded) = (0f64, 0usize, 0f64);
    let mut alone_grads = None;
    let mut examples = 0;
    for r in 0..2 {
        let mut start = 0;
        while start < 160 {
            let mut end = start;
            while end < 160 && docs[r][end] == docs[r][start] {
                end += 1;
            }
            let counted: Vec<f32> = mask[r][start..end].to_vec();
            if counted.iter().any(|&m| m > 0.0) {
                examples += 1;
                let n = end - start;
                let seg = |v: &[u32]| {
                    Tensor::new(&v[start..end], &Device::Cpu)
                        .unwrap()
                        .reshape((1, n))
                        .unwrap()
                };
                let one = Batch::new(seg(&x[r]), seg(&y[r])).with_mask(Some(
                    Tensor::new(counted.as_slice(), &Device::Cpu)
                        .unwrap()
                        .reshape((1, n))
                        .unwrap(),
                ));
                let (s, c, g) = loss_sum(&t, &one);
                alone += s;
                alone_count += c;
                add_into(&mut alone_grads, g, &t);
                // Padded to the block with masked padding: the same loss.
                let pad = |v: &[u32]| {
                    let mut p = v[start..end].to_vec();
                    p.resize(160, 0);
                    Tensor::new(p.as_slice(), &Device::Cpu)
                        .unwrap()
                        .reshape((1, 160))
                        .unwrap()
                };
                let mut m = counted.clone();
                m.resize(160, 0.0);
                let row = Batch::new(pad(&x[r]), pad(&y[r])).with_mask(Some(
                    Tensor::new(m.as_slice(), &Device::Cpu)
                        .unwrap()
                        .reshape((1, 160))
                        .unwrap(),
                ));
                padded += loss_sum(&t, &row).0;
            }
            start = end;
        }
    }
    assert!(
        examples >= 3,
        "a packed batch of several examples ({examples})"
    );
    assert_eq!(count, alone_count);
    // f32 sums in another order: 1e-5 relative.
    assert!(
        (packed - alone).abs() < 1e-5 * alone.abs(),
        "{packed} vs {alone}"
    );
    assert!(
        (padded - alone).abs() < 1e-5 * alone.abs(),
        "{padded} vs {alone}"
    );
    let r = grads_rel(&t, &packed_grads, alone_grads.as_ref().unwrap());
    assert!(r < 1e-4, "gradients differ by {r:e}");
}

#[test]
fn masked_targets_count_for_nothing_and_counted_ones_do() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = setup(tmp.path());
    for packing in [true, false] {
        let t = trainer_with_live_adapters(sft_config(tmp.path(), &base, &data, packing));
        let batch = train_batch(&t, 5);
        let (sum, _, grads) = loss_sum(&t, &batch);
        let mask: Vec<Vec<f32>> = batch.mask.as_ref().unwrap().to_vec2().unwrap();
        let y = vec2(&batch.y);
        type Cells = Vec<(usize, usize)>;
        let (masked, counted): (Cells, Cells) = (0..2)
            .flat_map(|r| (0..160).map(move |c| (r, c)))
            .partition(|&(r, c)| mask[r][c] == 0.0);
        assert!(!masked.is_empty() && !counted.is_empty());
        // Every masked target (prompt, system turn, padding, the row's gaps) changed.
        let changed: Vec<Vec<u32>> = (0..2)
            .map(|r| {
                (0..160)
                    .map(|c| match mask[r][c] == 0.0 {
                        true => (y[r][c] + 17) % 300,
                        false => y[r][c],
                    })
                    .collect()
            })
            .collect();
        let other = Batch {
            y: Tensor::new(changed, &Device::Cpu).unwrap(),
            ..batch.clone()
        };
        let (sum2, _, grads2) = loss_sum(&t, &other);
        assert_eq!(sum.to_bits(), sum2.to_bits(), "packing {packing}");
        assert_eq!(grads_rel(&t, &grads2, &grads), 0.0);
        // One counted target changed: the loss moves (the test above can fail).
        let (r, c) = counted[counted.len() / 2];
        let mut one = y.clone();
        one[r][c] = (one[r][c] + 17) % 300;
        let third = Batch {
            y: Tensor::new(one, &Device::Cpu).unwrap(),
            ..batch.clone()
        };
        assert_ne!(loss_sum(&t, &third).0.to_bits(), sum.to_bits());
        // Targets are the masked ids only where the mask says so.
        let targets = vec2(&batch.targets().unwrap());
        for &(r, c) in &masked {
            assert_eq!(targets[r][c], IGNORE);
        }
    }
}

#[test]
fn a_step_is_the_same_however_it_is_split() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = setup(tmp.path());
    // Padded rows: one example a row, drawn one after another, so 8 rows are the same 8
    // examples whether drawn as 1 x 8, 2 x 4 or 4 x 2 (and shared by 2 ranks).
    let step = |batch_size: usize, grad_accum: usize, dir: &str| {
        let cfg = TrainConfig {
            batch_size,
            grad_accum,
            ..sft_config(&tmp.path().join(dir), &base, &data, false)
        };
        cfg
    };
    let one = |cfg: TrainConfig| {
        let mut t = Trainer::new(cfg).unwrap();
        run_to_end(&mut t).remove(0)
    };
    let whole = one(step(8, 1, "a"));
    let mut runs = vec![
        ("2 x 4", one(step(4, 2, "b"))),
        ("4 x 2", one(step(2, 4, "c"))),
    ];
    let cfg = step(4, 1, "dp");
    let ranks = run_threads(2, Duration::from_secs(120), move |comm| {
        let mut t = Trainer::new(cfg.clone())
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap();
        run_to_end(&mut t).remove(0)
    });
    for r in ranks {
        runs.push((
            "2 ranks x 4",
            r.unwrap_or_else(|_| panic!("a rank panicked")),
        ));
    }
    for (what, s) in runs {
        for (name, x, y) in [
            ("loss", whole.loss, s.loss),
            ("grad norm", whole.grad_norm, s.grad_norm),
        ] {
            let rel = (x - y).abs() / x.abs();
            // Only the order of f32 sums differs.
            assert!(rel < 1e-5, "{what}: {name} {y} vs 1 x 8's {x}");
        }
    }
}
