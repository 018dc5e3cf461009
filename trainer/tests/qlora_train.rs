//! `--base-quant nf4` runs of the trainer (QLoRA) over the tiny Llama base of
//! `tests/fixtures/lora/base`: the base's projections quantized on load (the step then differs
//! from the full-precision LoRA run's, by the quantization error only), only the adapters train,
//! resume is bit-exact (re-quantization is deterministic), the settings are fixed by the run, a
//! checkpoint loads (`sample`, `eval`, `export --merge`) merged into the dequantized base it was
//! trained over, and a 4-bit base without LoRA is refused.

mod common;

use std::path::Path;

use candle_core::Device;
use common::{
    assert_same_steps, finish, loaded_model_gap, lora_base, lora_config, max_abs_diff, run_to_end,
    weights,
};
use trainer::config::{BaseQuant, TrainConfig};
use trainer::load::ModelDir;
use trainer::train::Trainer;

/// A QLoRA run over the tiny base on a char corpus (`lora_train.rs`'s LoRA run, the base in 4 bits).
fn qlora_config(tmp: &Path, quant: BaseQuant) -> TrainConfig {
    TrainConfig {
        base_quant: quant,
        base_quant_double: true,
        ..lora_config(tmp, &lora_base())
    }
}

#[test]
fn a_4bit_base_trains_its_adapters_and_resumes_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::new(qlora_config(tmp.path(), BaseQuant::Nf4)).unwrap();
    assert_eq!(t.params.len(), 28, "the adapters only");
    let (steps, end) = finish(t);
    assert!(
        steps.last().unwrap().loss < steps[0].loss,
        "the adapters learn"
    );
    // The same run over the full-precision base: the first loss moves by the quantization
    // error (the adapters start as the base: B = 0), so the base was quantized, but not far.
    let full = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        max_iters: 1,
        ..qlora_config(full.path(), BaseQuant::None)
    };
    let mut f = Trainer::new(cfg).unwrap();
    let first = run_to_end(&mut f)[0].loss;
    let d = (first - steps[0].loss).abs();
    assert!(d > 1e-4 && d < 0.5, "4-bit vs full base, first loss: {d}");
    // Half the run, then resume from its checkpoint at step 3: the same steps and adapters.
    let tmp2 = tempfile::tempdir().unwrap();
    let half = TrainConfig {
        max_iters: 3,
        ..qlora_config(tmp2.path(), BaseQuant::Nf4)
    };
    let (resumed, t) = common::split_run(half, 6);
    assert_same_steps(&steps, &resumed, "QLoRA resume");
    assert_eq!(end, weights(&t), "the same adapters after resuming");
    // The 4-bit settings are the run's.
    let e = Trainer::resume(&tmp2.path().join("run"), |c| c.base_quant_double = false)
        .err()
        .expect("a changed base quantization is refused")
        .to_string();
    assert!(e.contains("base_quant_double"), "{e}");
}

#[test]
fn a_qlora_checkpoint_loads_merged_into_the_dequantized_base() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        max_iters: 3,
        ..qlora_config(tmp.path(), BaseQuant::Nf4)
    };
    let d = common::trained_model_gap(cfg);
    // (W_deq + s B A) x vs W_deq x + s B (A x): f32 rounding only (merged into the f32 base
    // instead, the logits move by the quantization error: by 3.1 here).
    assert!(d < 1e-5, "{d}");
}

#[test]
fn export_merge_writes_pefts_merge_and_unload() {
    // `export --merge` of a QLoRA run: the adapters merged into the dequantized base, each
    // projection quantized again and dequantized, as PEFT's merge_and_unload leaves a 4-bit
    // base (checked against PEFT itself in qlora_peft.rs); the other tensors as they are.
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        max_iters: 2,
        eval_interval: 2,
        ..qlora_config(tmp.path(), BaseQuant::Nf4)
    };
    common::train(cfg);
    let run = ModelDir::open(&tmp.path().join("run").display().to_string()).unwrap();
    let out = tmp.path().join("merged");
    let options = trainer::export::ExportOptions {
        merge: true,
        ..Default::default()
    };
    trainer::export::export(&run, &out, &options).unwrap();
    let written =
        candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let (config, base) = ModelDir::at(lora_base())
        .unwrap()
        .load(&Device::Cpu)
        .unwrap();
    let adapter = trainer::lora::read_adapter(
        &tmp.path().join("run/checkpoints/step-0000002"),
        &Device::Cpu,
    )
    .unwrap();
    let (_, want) = common::merged_4bit(config.as_ref(), &base, &adapter);
    assert_eq!(written.len(), want.len());
    for (name, v) in want.iter() {
        let (a, b) = (&written[name], v.as_tensor());
        assert_eq!(max_abs_diff(a, b), 0.0, "{name}");
    }
}

#[test]
fn executors_run_over_a_4bit_base() {
    // 3 steps of the same QLoRA run (dropout 0.1 on the adapters' input) under each executor.
    let run = |f: &dyn Fn(TrainConfig) -> TrainConfig| {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = TrainConfig {
            max_iters: 3,
            ..qlora_config(tmp.path(), BaseQuant::Nf4)
        };
        let mut t = Trainer::new(f(cfg)).unwrap();
        run_to_end(&mut t)
    };
    let plain = run(&|c| c);
    // Remat recomputes the same ops on the same values (the 4-bit tiles included): exact.
    let remat = run(&|c| TrainConfig {
        remat: "every:1".parse().unwrap(),
        ..c
    });
    assert_same_steps(&plain, &remat, "remat over a 4-bit base");
    // 2 pipeline stages over 2 microbatches: the f32 sums over microbatches in another order
    // (1e-5 relative, combinations.rs' bound). bf16: 2e-2 (8 significant bits, 3.9e-3 a
    // rounding; the dequantized tiles, activations and adapter path all rounded: measured
    // 5.2e-3 on a gradient norm).
    let pipe = run(&|c| TrainConfig {
        pipeline_stages: 2,
        microbatches: 2,
        pipeline_threads: 1,
        ..c
    });
    let bf16 = run(&|c| TrainConfig {
        dtype: "bf16".parse().unwrap(),
        ..c
    });
    for (steps, tol, what) in [(&pipe, 1e-5, "pipeline"), (&bf16, 2e-2, "bf16")] {
        for (a, b) in steps.iter().zip(&plain) {
            let rel = |x: f32, y: f32| ((x - y) / y).abs();
            assert!(
                rel(a.loss, b.loss) < tol,
                "{what} step {}: loss {} vs {}",
                a.step,
                a.loss,
                b.loss
            );
            let g = rel(a.grad_norm, b.grad_norm);
            assert!(g < tol, "{what} step {}: grad norm {g:e} off", a.step);
        }
    }
}

#[test]
fn skipped_modules_stay_in_full_precision() {
    // The first loss (B = 0: the base's) of the default (lm_head kept), of every linear layer
    // in 4 bits, and of the MLP's down projections kept too: three different bases.
    let first = |skip: &str| {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = TrainConfig {
            max_iters: 1,
            base_quant_skip: skip.parse().unwrap(),
            ..qlora_config(tmp.path(), BaseQuant::Nf4)
        };
        let mut t = Trainer::new(cfg).unwrap();
        run_to_end(&mut t)[0].loss
    };
    let (kept, none, down) = (first("lm_head"), first(""), first("lm_head,mlp.down_proj"));
    assert_eq!(
        kept,
        first(&TrainConfig::default().base_quant_skip.to_string())
    );
    assert!(
        kept != none && kept != down && none != down,
        "{kept} {none} {down}"
    );
}

#[test]
fn a_4bit_base_needs_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        lora_r: 0,
        ..qlora_config(tmp.path(), BaseQuant::Nf4)
    };
    let e = Trainer::new(cfg).err().expect("refused").to_string();
    common::assert_mentions(&e, &["--base-quant nf4", "--lora-r"]);
}

/// The tiny Llama of `qlora_config` as transformers + bitsandbytes saved it in 4 bits, with
/// double quantization (`tests/fixtures/qlora/base_dq`, made by `make_qlora_fixtures.py`).
fn saved_4bit() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qlora/base_dq")
}

#[test]
fn a_saved_4bit_model_trains_as_the_same_base_quantized_on_load() {
    // bitsandbytes quantized `lora/base` into `base_dq` as we quantize it on load (bit for bit,
    // qlora_peft.rs): a run over the saved model is the on-load run, step for step.
    let tmp = tempfile::tempdir().unwrap();
    let saved = TrainConfig {
        init_from: Some(saved_4bit().display().to_string()),
        ..lora_config(tmp.path(), &lora_base())
    };
    let t = Trainer::new(saved.clone()).unwrap();
    assert_eq!(t.params.len(), 28, "the adapters only");
    let base = t.tuning().base().unwrap().clone();
    assert_eq!(
        base.quantization.as_deref(),
        Some("bitsandbytes nf4, blocksize 64, double quantization, compute f32")
    );
    let (steps, end) = finish(t);
    let tmp2 = tempfile::tempdir().unwrap();
    let on_load = Trainer::new(qlora_config(tmp2.path(), BaseQuant::Nf4)).unwrap();
    let (want, _) = finish(on_load);
    assert_same_steps(&want, &steps, "saved 4-bit vs quantized on load");
    // Resume is bit-exact: half the run, then its checkpoint at step 3.
    let tmp3 = tempfile::tempdir().unwrap();
    let half = TrainConfig {
        max_iters: 3,
        out_dir: tmp3.path().join("run"),
        ..saved.clone()
    };
    let (resumed, t) = common::split_run(half, 6);
    assert_same_steps(&steps, &resumed, "saved 4-bit resume");
    assert_eq!(end, weights(&t), "the same adapters after resuming");
    // `sample` and `eval` load the adapters merged into the dequantized saved weights.
    let d = loaded_model_gap(&t, &tmp3.path().join("run"));
    assert!(d < 1e-5, "{d}");
    // Full fine-tuning over 4-bit codes, or quantizing them again, is refused by name.
    for (change, what) in [
        (
            &(|c: &mut TrainConfig| c.lora_r = 0) as &dyn Fn(&mut TrainConfig),
            "--lora-r",
        ),
        (
            &|c: &mut TrainConfig| c.base_quant = BaseQuant::Nf4,
            "--base-quant",
        ),
    ] {
        let mut cfg = TrainConfig {
            out_dir: tmp.path().join("refused"),
            ..saved.clone()
        };
        change(&mut cfg);
        let e = Trainer::new(cfg).err().expect("refused").to_string();
        assert!(e.contains(what) && e.contains("base_dq"), "{e}");
    }
}

#[test]
fn a_resume_over_a_changed_4bit_base_is_refused_naming_the_quantization() {
    // The run recorded the saved base's identity, its quantization included: the same
    // weights saved without double quantization are another base.
    let (tmp, base) = common::temp_join("base");
    common::copy_model(&saved_4bit(), &base);
    let cfg = TrainConfig {
        init_from: Some(base.display().to_string()),
        max_iters: 2,
        ..lora_config(tmp.path(), &lora_base())
    };
    common::train(cfg);
    let plain = saved_4bit().with_file_name("base_plain");
    common::copy_model(&plain, &base);
    let e = Trainer::resume(&tmp.path().join("run"), |c| c.max_iters = 4)
        .err()
        .expect("another base is refused")
        .to_string();
    let what = "differ in tensor values and quantization";
    assert!(e.contains(what) && e.contains("double"), "{e}");
}

#[test]
fn the_cli_trains_samples_evaluates_and_exports_over_a_saved_4bit_model() {
    let base = saved_4bit().display().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt"),
    )
    .unwrap();
    std::fs::write(cwd.join("corpus.txt"), &text[..20_000]).unwrap();
    let train = |lora: &[&str]| {
        let flags = format!(
            "train --init-from {base} --data char --data-path corpus.txt --block-size 16 \
             --batch-size 4 --max-iters 2 --eval-interval 2 --eval-iters 1 --out-dir run"
        );
        let mut args: Vec<&str> = flags.split_whitespace().collect();
        args.extend(lora);
        common::run_cli(&args, cwd)
    };
    let run = |args: &[&str]| {
        let o = common::run_cli(args, cwd);
        assert!(o.status.success(), "{args:?}: {}", common::output_text(&o));
        common::output_text(&o)
    };
    let full = train(&[]);
    assert_eq!(full.status.code(), Some(1));
    let e = common::output_text(&full);
    assert!(e.contains("4-bit") && e.contains("--lora-r"), "{e}");
    let o = train(&["--lora-r", "4", "--lora-alpha", "8"]);
    let out = common::output_text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("bitsandbytes nf4"), "{out}");
    run(&[
        "sample",
        "run",
        "--prompt",
        "ROMEO",
        "--max-new-tokens",
        "4",
    ]);
    let eval = run(&["eval", "run"]);
    assert!(eval.contains("loss"), "{eval}");
    run(&["export", "run", "adapter"]);
    assert!(cwd.join("adapter/adapter_model.safetensors").is_file());
    run(&["export", "run", "merged", "--merge", "--dtype", "bf16"]);
    // The merged export: the adapters merged into the dequantized base, each projection
    // quantized again (double) and dequantized, as PEFT's merge_and_unload leaves it.
    let written =
        candle_core::safetensors::load(cwd.join("merged/model.safetensors"), &Device::Cpu).unwrap();
    let q = trainer::lora::read_bnb_4bit(&saved_4bit(), &Device::Cpu).unwrap();
    let adapter =
        trainer::lora::read_adapter(&cwd.join("run/checkpoints/step-0000002"), &Device::Cpu)
            .unwrap();
    let deq = q.layers.dequantized_into(&q.params).unwrap();
    let merged = trainer::lora::merge(q.config.as_ref(), &deq, &adapter).unwrap();
    let want = q.layers.requantized(&merged).unwrap();
    let mut requantized = 0;
    let bf16 = |t: &candle_core::Tensor| {
        use candle_core::DType::{BF16, F32};
        t.to_dtype(BF16).unwrap().to_dtype(F32).unwrap()
    };
    for (name, v) in want.iter() {
        let got = bf16(&written[name]);
        assert_eq!(max_abs_diff(&got, &bf16(v.as_tensor())), 0.0, "{name}");
        let before = bf16(&deq.tensor(name).unwrap());
        requantized += usize::from(max_abs_diff(&got, &before) > 0.0);
    }
    assert_eq!(requantized, 14, "every projection merged");
}

#[test]
fn the_compute_dtype_is_the_saved_models_unless_given_and_fixed_by_the_run() {
    // base_dq records bnb_4bit_compute_dtype float32: the default is f32, bf16 products
    // differ, and a resume cannot change it.
    let steps = |compute: Option<&str>| {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = TrainConfig {
            init_from: Some(saved_4bit().display().to_string()),
            max_iters: 2,
            base_compute_dtype: compute.map(|c| c.parse().unwrap()),
            ..lora_config(tmp.path(), &lora_base())
        };
        let mut t = Trainer::new(cfg).unwrap();
        (run_to_end(&mut t), tmp)
    };
    let (default, tmp) = steps(None);
    let (f32, _) = steps(Some("f32"));
    let (bf16, _) = steps(Some("bf16"));
    assert_same_steps(&default, &f32, "the saved compute dtype");
    let d = (bf16[0].loss - f32[0].loss).abs();
    assert!(d > 0.0 && d < 1e-2, "bf16 vs f32 products: {d}");
    let e = Trainer::resume(&tmp.path().join("run"), |c| {
        c.base_compute_dtype = Some("bf16".parse().unwrap())
    })
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("base_compute_dtype"), "{e}");
}
