//! `Trainer::builder()`: a run from a program's parts. The LoRA example (`examples/lora_llama.rs`,
//! its own batch iterator) equals the same run through the CLI bit for bit; a batch iterator
//! under accumulation equals the data source it replays; a run without a run directory writes
//! nothing; an iterator that ends is a clear error. And the small helpers: the HF label shift
//! gives transformers' loss, PEFT adapters load over a base given explicitly, and generation
//! runs the kernels it is given.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicBool;

use common::{assert_same_losses, max_abs, max_abs_diff, run_to_end, tiny_config};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use trainer::data::{self, Split};
use trainer::metrics::{self, Record};
use trainer::train::{Event, Trainer};

#[allow(dead_code)] // its `main` is the example's
#[path = "../examples/lora_llama.rs"]
mod example;

#[test]
fn lora_example_equals_the_cli_run_bit_for_bit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("../data/tinyshakespeare.txt")).unwrap();
    let text = &text[..20_000];
    let base = root.join("tests/fixtures/lora/base");
    let steps = 4;
    let ours = example::lora_losses(base.to_str().unwrap(), text, steps).unwrap();

    // The same run through the CLI: the char vocabulary of the same text, random windows of
    // its train split drawn by the run seed's generator, LoRA r 4 alpha 8 on every linear.
    let (tmp, corpus) = common::temp_join("corpus.txt");
    std::fs::write(&corpus, text).unwrap();
    let run = tmp.path().join("run");
    let out = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .arg("train")
        .args(["--init-from", base.to_str().unwrap()])
        .args(["--data", "char", "--data-path", corpus.to_str().unwrap()])
        .args(["--lora-r", "4", "--lora-alpha", "8"])
        .args(["--batch-size", "4", "--block-size", "32"])
        .args(["--max-iters", &steps.to_string(), "--eval-iters", "1"])
        .args(["--peak-flops", "1e12"])
        .args(["--cache-dir", tmp.path().join("cache").to_str().unwrap()])
        .args(["--out-dir", run.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli: Vec<f32> = metrics::read(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            Record::Step(s) => Some(s.loss),
            Record::Eval(_) => None,
        })
        .collect();
    assert_eq!(ours.len(), steps);
    let bits = |v: &[f32]| v.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&ours), bits(&cli), "example {ours:?} vs CLI {cli:?}");
}

#[test]
fn a_batch_iterator_under_accumulation_equals_the_source_it_replays() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = trainer::config::TrainConfig {
        grad_accum: 3,
        max_iters: 3,
        ..tiny_config(&tmp.path().join("run"))
    };
    let mut from_config = Trainer::builder().config(cfg.clone()).build().unwrap();
    let expected = run_to_end(&mut from_config);
    // The program's iterator: the addition task's batches (with their loss masks) drawn in
    // order by a generator seeded as the run's.
    let source = data::open(&cfg.data_spec()).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let (rows, block) = (cfg.batch_size, cfg.block_size);
    let device = candle_core::Device::Cpu;
    let batches = std::iter::repeat_with(move || {
        source
            .batch(Split::Train, rows, block, &mut rng, &device)
            .unwrap()
    });
    let vocab = data::open(&cfg.data_spec()).unwrap().vocab_size();
    let mut fed = Trainer::builder()
        .config(cfg)
        .batches(vocab, batches)
        .build()
        .unwrap();
    let steps = run_to_end(&mut fed);
    assert_same_losses(&expected, &steps, "batch iterator vs data source");
    assert!(fed.evaluate().is_err(), "no held-out data");
}

#[test]
fn a_run_without_a_run_directory_writes_nothing() {
    let (tmp, out) = common::temp_join("run");
    let mut t = Trainer::builder()
        .config(tiny_config(&out))
        .max_iters(4)
        .build()
        .unwrap();
    assert!(!t.writes());
    let mut seen = Vec::new();
    let mut observe = |e: Event<'_>| match e {
        Event::Step(s) => seen.push(format!("step {}", s.step)),
        Event::Eval(e) => seen.push(format!("eval {}", e.step)),
        _ => seen.push("other".into()),
    };
    let summary = t.run(&mut observe, &AtomicBool::new(false)).unwrap();
    assert_eq!(
        seen,
        ["eval 0", "step 1", "step 2", "step 3", "step 4", "eval 4"]
    );
    assert_eq!(summary.step, 4);
    assert!(summary.checkpoint.is_none() && summary.last_eval.is_some());
    assert!(!out.exists(), "nothing written in {}", out.display());
    let err = t.save_checkpoint().unwrap_err().to_string();
    assert!(err.contains("no run directory"), "{err}");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    // The same config with a run directory writes one.
    let mut t = Trainer::builder()
        .config(tiny_config(&out))
        .max_iters(4)
        .run_dir(&out)
        .build()
        .unwrap();
    t.run(&mut (), &AtomicBool::new(false)).unwrap();
    assert!(out.join("run.toml").is_file() && out.join("checkpoints").is_dir());
}

#[test]
fn a_batch_iterator_that_ends_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config(&tmp.path().join("run"));
    let n = cfg.batch_size * cfg.block_size;
    let two = (0..2).map(move |_| (vec![1u32; n], vec![2u32; n]));
    let mut t = Trainer::builder()
        .config(cfg)
        .batches(16, two)
        .max_iters(3)
        .build()
        .unwrap();
    let err = t
        .run(&mut (), &AtomicBool::new(false))
        .unwrap_err()
        .to_string();
    assert!(err.contains("ended after 2 batches"), "{err}");
    assert_eq!(t.step(), 2);
    let short = std::iter::once((vec![1u32; 3], vec![2u32; 3]));
    let mut t = Trainer::builder()
        .config(tiny_config(&tmp.path().join("run")))
        .batches(16, short)
        .build()
        .unwrap();
    let err = t.train_step().unwrap_err().to_string();
    assert!(err.contains("batch 0 of the batch iterator"), "{err}");
}

/// The Llama fixture's `labels` (with -100s), shifted by `Batch::from_hf_labels`, give
/// transformers' loss from transformers' logits. Tolerance 1e-5: the same f32 logits, the
/// log-softmax and the mean summed in another order than torch's.
#[test]
fn the_hf_label_shift_gives_transformers_loss() {
    let path = common::llama::fixture("llama").join("expected.safetensors");
    let t = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    let batch = data::Batch::from_hf_labels(&t["input_ids"], &t["labels"]).unwrap();
    let targets: Vec<u32> = batch
        .targets()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let logits = t["logits"].flatten_to(1).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, 1).unwrap();
    let logp: Vec<Vec<f32>> = logp.to_vec2().unwrap();
    let counted: Vec<f64> = (targets.iter().zip(&logp))
        .filter(|(&y, _)| y != trainer::model::IGNORE)
        .map(|(&y, row)| -f64::from(row[y as usize]))
        .collect();
    assert_eq!(batch.counted().unwrap(), counted.len() as f64);
    let loss = counted.iter().sum::<f64>() / counted.len() as f64;
    let hf = t["loss"].to_scalar::<f32>().unwrap();
    assert!(
        (loss as f32 - hf).abs() < 1e-5,
        "{loss} vs transformers {hf}"
    );
}

/// A PEFT adapter directory whose recorded base does not resolve (copied away from it) loads
/// over the base given explicitly, and gives PEFT's logits (relative 1e-5, as tests/lora_peft.rs).
#[test]
fn an_adapter_loads_over_an_explicit_base() {
    let lora = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora");
    let (_tmp, copy) = common::temp_join("adapter");
    std::fs::create_dir(&copy).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(lora.join("adapter_plain").join(f), copy.join(f)).unwrap();
    }
    assert!(
        trainer::load::ModelDir::at(copy.clone()).is_err(),
        "../base is not there"
    );
    let base = lora.join("base");
    let dir = trainer::load::ModelDir::adapter_over(&copy, base.to_str().unwrap()).unwrap();
    let model = dir.load_model(&candle_core::Device::Cpu).unwrap();
    let path = lora.join("adapter_plain/expected.safetensors");
    let e = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    let ids = e["input_ids"].to_dtype(candle_core::DType::U32).unwrap();
    let logits = model.forward(&ids, &trainer::model::Ctx::eval()).unwrap();
    let rel = max_abs_diff(&logits, &e["logits"]) / max_abs(&e["logits"]);
    assert!(
        rel < 1e-5,
        "logits differ from PEFT's by {rel:e} (relative)"
    );
    let err = trainer::load::ModelDir::adapter_over(&base, "x").unwrap_err();
    assert!(err.to_string().contains("adapter_config.json"), "{err}");
}

/// The cached forward of generation (GPT-2 and Llama) runs the kernels its cache is given:
/// each close to the full forward with the same kernels (1e-5 relative: another attention
/// path), and fused and reference not the same bits.
#[test]
fn generation_runs_the_kernels_it_is_given() {
    use candle_core::{Device, Tensor};
    use trainer::model::{Ctx, Kernels, KvCache};
    let gpt = trainer::model::gpt2::GptConfig {
        n_layer: 1,
        ..common::hf::tiny_gpt(8, 10)
    };
    let (gpt, _) = trainer::model::init(&gpt, 0, &Device::Cpu).unwrap();
    let llama = trainer::load::ModelDir::at(common::fixtures("lora/base")).unwrap();
    let llama = llama.load_model(&Device::Cpu).unwrap();
    let idx = Tensor::new(&[[1u32, 2, 3, 4, 5]], &Device::Cpu).unwrap();
    for model in [gpt, llama] {
        let cached = |k| {
            let mut cache = KvCache::new().with_kernels(k);
            model.forward_cached(&idx, &mut cache).unwrap()
        };
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        for k in [Kernels::Fused, Kernels::Reference] {
            let full = model.forward(&idx, &Ctx::eval().with_kernels(k)).unwrap();
            let d = max_abs_diff(&cached(k), &full);
            let m = max_abs(&full);
            assert!(d / m < 1e-5, "{k:?}");
        }
        let (fused, reference) = (cached(Kernels::Fused), cached(Kernels::Reference));
        assert_ne!(
            bits(&fused),
            bits(&reference),
            "the kernels reach the model"
        );
    }
}
