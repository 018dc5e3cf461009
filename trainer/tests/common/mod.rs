//! Shared helpers for the trainer's integration tests.
#![allow(dead_code)]

pub mod check;
pub mod dpo;
pub mod hf;
pub mod llama;
#[cfg(unix)]
pub mod process;
pub mod shards;
pub mod tiny;

#[allow(unused_imports)] // each test binary uses some
pub use check::{assert_mentions, copy_model, fixtures, read_json, temp_files, temp_join, words};

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use candle_core::{DType, Device, Tensor, WithDType};
use candle_peft::Adapter;
use tempfile::TempDir;
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::load::ModelDir;
use trainer::metrics::StepStats;
use trainer::model::{Ctx, Model, ModelConfig, Params};
use trainer::train::{Event, Observer, Trainer};

/// A config small enough for a test: 2 layers, 32 wide, 16 tokens, embedded addition data.
pub fn tiny_config(out_dir: &Path) -> TrainConfig {
    TrainConfig {
        out_dir: out_dir.to_path_buf(),
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        batch_size: 4,
        max_iters: 8,
        lr_decay_iters: Some(8),
        warmup_iters: 2,
        eval_interval: 4,
        eval_iters: 2,
        eval_problems: 16,
        digits: 2,
        // Tokenised corpora are cached next to the run, not in the user's cache directory.
        cache_dir: Some(out_dir.join("cache")),
        // A given peak skips the ~0.5 s matmul benchmark in every Trainer::new (MFU only).
        peak_flops: 1e12,
        ..TrainConfig::default()
    }
}

/// Records every step's statistics; optionally raises the stop flag after `stop_after` steps.
#[derive(Default)]
pub struct Recorder {
    pub steps: Vec<StepStats>,
    pub stop_after: Option<(usize, std::sync::Arc<std::sync::atomic::AtomicBool>)>,
}

impl Observer for Recorder {
    fn on_event(&mut self, event: Event<'_>) {
        if let Event::Step(s) = event {
            self.steps.push(s.clone());
            if let Some((n, flag)) = &self.stop_after {
                if s.step >= *n {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
    }
}

/// A run's step statistics and its final weights (see [`weights`]).
pub type Run = (Vec<StepStats>, Vec<(String, Vec<f32>)>);

/// Runs `t` to its `max_iters` (never asked to stop); returns the statistics of its steps.
pub fn run_to_end(t: &mut Trainer) -> Vec<StepStats> {
    let mut rec = Recorder::default();
    t.run(&mut rec, &AtomicBool::new(false)).unwrap();
    rec.steps
}

/// Runs `t` to its end; its steps and final weights.
pub fn finish(mut t: Trainer) -> Run {
    let steps = run_to_end(&mut t);
    (steps, weights(&t))
}

/// A new trainer for `cfg`, run to its end.
pub fn train(cfg: TrainConfig) -> Trainer {
    let mut t = Trainer::new(cfg).unwrap();
    run_to_end(&mut t);
    t
}

/// `half` run to its `max_iters`, then resumed from its checkpoint and run on to `max_iters`:
/// the steps of both parts in order, and the resumed trainer.
pub fn split_run(half: TrainConfig, max_iters: usize) -> (Vec<StepStats>, Trainer) {
    let (dir, at) = (half.out_dir.clone(), half.max_iters);
    let mut first = Trainer::new(half).unwrap();
    let mut steps = run_to_end(&mut first);
    drop(first);
    let mut second = Trainer::resume(&dir, |c| c.max_iters = max_iters).unwrap();
    assert_eq!(
        second.step(),
        at,
        "resumed at the step the first part ended"
    );
    steps.extend(run_to_end(&mut second));
    (steps, second)
}

/// A finished run of [`tiny_config`] changed by `set`, in `run/` of a fresh temporary
/// directory: the temporary directory (removed when dropped), the run directory, the trainer.
pub fn tiny_run(set: impl FnOnce(&mut TrainConfig)) -> (TempDir, PathBuf, Trainer) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut cfg = tiny_config(&dir);
    set(&mut cfg);
    let t = train(cfg);
    (tmp, dir, t)
}

/// Asserts that two runs' steps agree to the bit in what decides the training: step numbers,
/// losses, loss scales and skips (`what` names the comparison in a failure).
pub fn assert_same_losses(a: &[StepStats], b: &[StepStats], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: number of steps");
    for (x, y) in a.iter().zip(b) {
        let s = x.step;
        assert_eq!(s, y.step, "{what}: step numbers");
        assert_eq!(
            x.loss.to_bits(),
            y.loss.to_bits(),
            "{what}: loss at step {s}"
        );
        assert_eq!(x.loss_scale, y.loss_scale, "{what}: loss scale at step {s}");
        assert_eq!(x.skipped, y.skipped, "{what}: skipped at step {s}");
    }
}

/// [`assert_same_losses`], and the same gradient norms (to the bit) and learning rates.
pub fn assert_same_steps(a: &[StepStats], b: &[StepStats], what: &str) {
    assert_same_losses(a, b, what);
    for (x, y) in a.iter().zip(b) {
        let s = x.step;
        assert_eq!(
            x.grad_norm.to_bits(),
            y.grad_norm.to_bits(),
            "{what}: grad norm at step {s}"
        );
        assert_eq!(x.lr, y.lr, "{what}: lr at step {s}");
    }
}

/// The elements of `t`, converted to `T`, flattened.
pub fn values<T: WithDType>(t: &Tensor) -> Vec<T> {
    t.to_dtype(T::DTYPE)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<T>()
        .unwrap()
}

/// The largest |element| of `t`, an f32 tensor.
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The largest |a - b| over the elements of two f32 tensors of one shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

/// The largest |a - b| over the largest |b| (a relative error at `b`'s scale; the scale is
/// floored at 1e-30 so that `b = 0` gives a large error, not a NaN).
pub fn rel(a: &Tensor, b: &Tensor) -> f32 {
    max_abs_diff(a, b) / max_abs(b).max(1e-30)
}

/// The largest |logit| difference, on a fixed 8-token prompt, between `t`'s model and the model
/// its run directory `run` loads for inference (a LoRA run's adapters merged into its base).
pub fn loaded_model_gap(t: &Trainer, run: &Path) -> f32 {
    let x = Tensor::new(&[[1u32, 5, 9, 13, 17, 21, 25, 29]], &Device::Cpu).unwrap();
    let want = t.model.forward(&x, &Ctx::eval()).unwrap();
    let loaded = ModelDir::open(&run.display().to_string())
        .unwrap()
        .load_model(&Device::Cpu)
        .unwrap();
    let got = loaded.forward(&x, &Ctx::eval()).unwrap();
    max_abs_diff(&got, &want)
}

/// `adapter` merged into `base` as PEFT's `merge_and_unload` does on a 4-bit base (NF4 with
/// double quantization): dequantized, `s B A` added, quantized again. The dequantized base
/// and the merged weights dequantized.
pub fn merged_4bit(config: &dyn ModelConfig, base: &Params, adapter: &Adapter) -> (Params, Params) {
    let settings = trainer::lora::Nf4Settings {
        double: true,
        ..Default::default()
    };
    let deq = trainer::lora::dequantized_base(config, base, &settings).unwrap();
    let merged = trainer::lora::merge(config, &deq, adapter).unwrap();
    let merged = trainer::lora::dequantized_base(config, &merged, &settings).unwrap();
    (deq, merged)
}

/// `t`'s full checkpoint saved into run `dir` with the `extra` files (a writer that fails or
/// panics stands in for a full disk or a kill).
pub fn save_with(
    t: &Trainer,
    dir: &Path,
    extra: &[(&str, &trainer::checkpoint::WriteFile)],
) -> trainer::Result<PathBuf> {
    trainer::checkpoint::save(
        dir,
        trainer::checkpoint::ModelFiles::Full(t.model.config()),
        &t.params,
        &trainer::optim::OptimizerState::of(t.optimizer.as_ref()),
        &t.state(),
        extra,
    )
}

/// Trains `cfg` to its end; [`loaded_model_gap`] of its run directory.
pub fn trained_model_gap(cfg: TrainConfig) -> f32 {
    let run = cfg.out_dir.clone();
    loaded_model_gap(&train(cfg), &run)
}

/// The tiny Llama base of the LoRA fixtures (`tests/fixtures/lora/base`).
pub fn lora_base() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/base")
}

/// A LoRA run over `base` on a char corpus (65 ids; the base embeds 128).
pub fn lora_config(tmp: &Path, base: &Path) -> TrainConfig {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt"),
    )
    .unwrap();
    let corpus = tmp.join("corpus.txt");
    std::fs::write(&corpus, &text[..20_000]).unwrap();
    TrainConfig {
        init_from: Some(base.display().to_string()),
        data: DataKind::Char,
        data_path: Some(corpus),
        lora_r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.1,
        lr: 1e-2,
        weight_decay: 0.0,
        max_iters: 6,
        lr_decay_iters: Some(6),
        eval_interval: 3,
        ..tiny_config(&tmp.join("run"))
    }
}

/// The model configuration and parameters of the HF directory or checkpoint `dir`, on the CPU.
pub fn load_dir(dir: &Path) -> (Box<dyn ModelConfig>, Params) {
    ModelDir::at(dir.to_path_buf())
        .unwrap()
        .load(&Device::Cpu)
        .unwrap()
}

/// `config`'s model over `params` with the PEFT `adapter` applied (f32, seed 0), and its
/// trainable adapter tensors.
pub fn with_adapter(
    config: &dyn ModelConfig,
    params: &Params,
    adapter: &Adapter,
) -> (Box<dyn Model>, Params) {
    trainer::lora::adapt(
        config,
        params,
        &adapter.config,
        Some(adapter),
        DType::F32,
        0,
    )
    .unwrap()
}

/// All parameters as (name, flattened f32 values).
pub fn weights(t: &trainer::train::Trainer) -> Vec<(String, Vec<f32>)> {
    t.params
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect()
}

/// Every file below `dir` with its bytes, sorted by path.
pub fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// `trainer train` flags for a tiny run (1 layer, 16 wide, 16 tokens, a short evaluation every
/// 3 steps); `--max-iters` is the caller's.
pub const TINY_ARGS: &[&str] = &[
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--block-size",
    "16",
    "--batch-size",
    "4",
    "--digits",
    "2",
    "--eval-iters",
    "1",
    "--eval-problems",
    "8",
    "--eval-interval",
    "3",
    "--warmup-iters",
    "1",
];

/// `trainer train --out-dir run --max-iters 3` with [`TINY_ARGS`] in `cwd`; its output, which
/// must be a success.
pub fn tiny_cli_run(cwd: &Path) -> String {
    let mut args = vec!["train", "--out-dir", "run", "--max-iters", "3"];
    args.extend_from_slice(TINY_ARGS);
    let o = run_cli(&args, cwd);
    assert!(o.status.success(), "{}", output_text(&o));
    output_text(&o)
}

/// The output of a run that must have been refused (exit status 1).
pub fn refusal_text(o: &std::process::Output) -> String {
    let text = output_text(o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    text
}

/// Runs the `trainer` binary with `args` in `cwd`, its Hugging Face hub cache (`HF_HOME`) in
/// `cwd/home/hf` and its data cache in `cwd/home/cache`, so that it reads and writes no user
/// cache.
pub fn run_cli(args: &[&str], cwd: &Path) -> std::process::Output {
    let home = cwd.join("home");
    std::process::Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(cwd)
        .env("HF_HOME", home.join("hf"))
        .env("XDG_CACHE_HOME", home.join("cache"))
        .output()
        .expect("run the trainer binary")
}

/// stdout followed by stderr of a finished command.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Where a golden-file test writes: under `UPDATE_GOLDEN=1` the committed `golden` directory
/// itself (and `true`), else a fresh temporary directory (kept while the `TempDir` lives).
pub fn golden_target(golden: &Path) -> (TempDir, PathBuf, bool) {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let tmp = tempfile::tempdir().unwrap();
    let dir = match update {
        true => golden.to_path_buf(),
        false => tmp.path().to_path_buf(),
    };
    (tmp, dir, update)
}

/// Asserts that each safetensors file of `files` in `dir` holds the tensors of the same file in
/// `golden`: the same names, each within 1e-6 max abs (compared in f32).
pub fn assert_golden_tensors(dir: &Path, golden: &Path, files: &[&str]) {
    for file in files {
        let ours = candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap();
        let want = candle_core::safetensors::load(golden.join(file), &Device::Cpu).unwrap();
        let mut names: Vec<_> = want.keys().collect();
        names.sort();
        let mut got: Vec<_> = ours.keys().collect();
        got.sort();
        assert_eq!(names, got, "{file}");
        for (n, t) in &want {
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let d = max_abs_diff(&f32(&ours[n]), &f32(t));
            assert!(d <= 1e-6, "{file} {n}: {d} from the verified golden");
        }
    }
}
