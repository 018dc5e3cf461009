//! A LoRA training step against PEFT + transformers (SDPA attention, under `torch.autocast` to
//! bf16), and against our own full fine-tuning of the same model, side by side in one run.
//!
//! ```text
//! scripts/python/setup.sh                                   # once: .venv-py with torch, transformers, peft
//! cargo bench -p trainer --bench lora_step -- --steps 3 --warmup 2 --threads 2
//! cargo bench -p trainer --bench lora_step -- --no-peft     # ours only
//! ```
//!
//! The model: SmolLM2-135M's shape (30 layers, 576 wide, 9 heads / 3 KV heads, MLP 1536, vocab
//! 49152, tied; block 256, batch 4), random weights, bf16 compute. A LoRA run needs a base model
//! directory: the bench writes one once (`config.json` + a bf16 `model.safetensors`, through
//! `trainer::checkpoint::save_model`) under Cargo's target tmp dir, and both of our cases load
//! it with `init_from`.
//!
//! Cases (each in its own process, so that each peak RSS is its own):
//! - `lora`: `Trainer::train_step` of a LoRA run, r 16, alpha 32, all-linear (the 210 q/k/v/o/
//!   gate/up/down projections), dropout 0, the base frozen in bf16, AdamW over the adapters.
//! - `full`: the same step training every weight (f32 master weights and AdamW state, bf16
//!   compute): the memory reference (LoRA's peak should be at most half of it).
//! - `peft`: `bench/peft_lora_step.py`, the same LoRA step in PEFT + transformers (bf16 base,
//!   f32 adapters, SDPA attention, the forward under `torch.autocast` to bf16), same threads.
//!
//! The bench protocol (BENCHMARKS.md; `support::protocol`, `bench/bench_protocol.py`): the CPU
//! model and flags printed with the figures; each timed step re-run (up to 5 times) while other
//! processes or steal took over 2% of the machine; `lora` and `peft` in A B A B order
//! (`--rounds`; `full`, the memory reference, once), each side's steps pooled over the rounds.
//!
//! Optimiser as PEFT's anchor uses it: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight
//! decay 0.01 (ours decays 2-D weights only; every adapter weight is 2-D), no gradient clipping,
//! constant learning rate. Ours runs with the `trainer` binary's process settings
//! (`trainer::runtime::init`): `--warmup` steps, then `--steps` timed steps (median reported).
//!
//! Memory: the process's peak RSS (`VmHWM`) over its whole life (loading the base included), the
//! peak over the warm-up and timed steps alone (`VmHWM` reset through `/proc/self/clear_refs`
//! just before the first step, as the PEFT script does), and "step memory": the whole-life peak
//! minus the RSS before the model was built (PEFT's side: its RSS after importing torch,
//! transformers and peft).
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Parser;
use serde_json::{json, Value};
use support::protocol::{self, share_cell};
use support::{f, last_json, root, status_kib};
use trainer::config::{Precision, TrainConfig};
use trainer::data::DataKind;
use trainer::model::llama::{Family, LlamaConfig};
use trainer::model::Params;
use trainer::train::Trainer;

const BLOCK: usize = 256;
const BATCH: usize = 4;

#[derive(Parser, Debug)]
struct Args {
    /// Timed steps per case.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Warm-up steps per case (PEFT needs 2 to settle).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Threads for every side (0: the machine's cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Run only the cases whose name contains this (`lora`, `full`, `peft`).
    #[arg(long)]
    only: Option<String>,
    /// The Python with torch, transformers and peft (relative to the workspace root, or
    /// absolute).
    #[arg(long, default_value = ".venv-py/bin/python")]
    python: PathBuf,
    /// Skip the PEFT side.
    #[arg(long)]
    no_peft: bool,
    /// A B A B rounds of ours (LoRA) and PEFT.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Where the base model is written (default: Cargo's target tmp dir).
    #[arg(long)]
    base_dir: Option<PathBuf>,
    /// Internal: run one of our cases in this process.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// SmolLM2-135M's shape.
fn smol() -> LlamaConfig {
    LlamaConfig {
        tie_word_embeddings: true,
        rope_theta: 100000.0,
        ..LlamaConfig::new(Family::Llama, 49152, 30, 576, 9, 3, 1536)
    }
}

/// Resets `VmHWM` to the current RSS (Linux >= 4.0); false where the kernel refuses.
fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The base model directory: written once (random init, seed 0, stored in bf16), reused after.
fn base_dir(args: &Args) -> anyhow::Result<PathBuf> {
    let dir = match &args.base_dir {
        Some(d) => d.clone(),
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("lora_step_base_smollm2-135m"),
    };
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    eprintln!("writing the base model to {}", dir.display());
    std::fs::create_dir_all(&dir)?;
    let cfg = smol();
    let params = Params::init(&cfg, 0, &Device::Cpu)?.to_dtype(DType::BF16)?;
    trainer::checkpoint::save_model(&dir, &cfg, &params)?;
    Ok(dir)
}

fn run_ours(case: &str, base: &Path, args: &Args) -> anyhow::Result<Value> {
    let lora = match case {
        "lora" => true,
        "full" => false,
        _ => bail!("unknown case {case}"),
    };
    let tmp = tempfile::tempdir()?;
    let rss_base = status_kib("VmRSS:") / 1024.0;
    let config = TrainConfig {
        out_dir: tmp.path().join("run"),
        cache_dir: Some(tmp.path().join("cache")),
        init_from: Some(base.display().to_string()),
        // Byte-level tinyshakespeare: ids < 256, all inside the 49152-row embedding (as
        // llama_step feeds its 49152-vocab case).
        data: DataKind::Byte,
        data_path: Some(root().join("data/tinyshakespeare.txt")),
        block_size: BLOCK,
        batch_size: BATCH,
        max_iters: 1_000_000,
        eval_interval: 1_000_000,
        eval_problems: 0,
        // PEFT's anchor: torch AdamW(lr=1e-4), default betas / eps / weight decay, no clip.
        lr: 1e-4,
        min_lr: 1e-4,
        warmup_iters: 0,
        beta1: 0.9,
        beta2: 0.999,
        weight_decay: 0.01,
        grad_clip: 0.0,
        dtype: Precision::Bf16,
        lora_r: if lora { 16 } else { 0 },
        lora_alpha: 32.0,
        lora_dropout: 0.0,
        base_dtype: lora.then_some(Precision::Bf16),
        peak_flops: 1e12,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(config)?;
    let trainable = t.params.num_elements();
    let rss_before_steps = status_kib("VmRSS:") / 1024.0;
    let peak_before_steps = status_kib("VmHWM:") / 1024.0;
    let hwm_reset = reset_hwm();
    let mut losses = Vec::new();
    for _ in 0..args.warmup {
        losses.push(t.train_step()?.loss);
    }
    let timed = (0..args.steps)
        .map(|_| protocol::timed(|| t.train_step().map(|s| losses.push(s.loss))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let hwm_steps = status_kib("VmHWM:") / 1024.0;
    let peak = match hwm_reset {
        true => hwm_steps.max(peak_before_steps),
        false => hwm_steps,
    };
    let median = protocol::median(&timed.iter().map(|t| t.secs).collect::<Vec<_>>());
    let mut r = json!({
        "case": case, "step_median_s": median,
        "tokens_per_s": (BATCH * BLOCK) as f64 / median,
        "trainable_params": trainable,
        "peak_rss_mib": peak, "rss_base_mib": rss_base,
        "rss_before_steps_mib": rss_before_steps,
        "peak_rss_steps_mib": if hwm_reset { json!(hwm_steps) } else { Value::Null },
        "loss_first_last": [losses.first(), losses.last()],
    });
    if let (Some(r), Value::Object(p)) = (r.as_object_mut(), protocol::summary(&timed)) {
        r.extend(p);
    }
    Ok(r)
}

fn child(args: &Args, case: &str, base: &Path) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["--child", case])
        .arg("--base-dir")
        .arg(base)
        .args(["--steps", &args.steps.to_string()])
        .args(["--warmup", &args.warmup.to_string()]);
    if args.threads > 0 {
        cmd.env("RAYON_NUM_THREADS", args.threads.to_string());
    }
    last_json(cmd.output()?, "our step")
}

fn peft(args: &Args) -> anyhow::Result<Value> {
    let mut cmd = Command::new(root().join(&args.python));
    cmd.arg(root().join("bench/peft_lora_step.py"))
        .args(["--dtype", "bf16"])
        .args(["--steps", &args.steps.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--threads", &args.threads.to_string()]);
    last_json(cmd.output()?, "bench/peft_lora_step.py")
}

fn main() -> anyhow::Result<()> {
    // The trainer binary's process settings (Candle's pool spin limit, malloc thresholds).
    trainer::runtime::init();
    let args = Args::parse();
    if let Some(case) = &args.child {
        let base = args.base_dir.clone().context("--child needs --base-dir")?;
        let r = run_ours(case, &base, &args)?;
        println!("{r}");
        return Ok(());
    }
    let threads = match args.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let args = Args { threads, ..args };
    let base = base_dir(&args)?;
    let load_before = loadavg();
    let wanted = |name: &str| args.only.as_deref().is_none_or(|o| name.contains(o));
    // A B A B: ours (LoRA), PEFT, ours, PEFT...; then our full fine-tuning once.
    let (mut lora, mut peft_runs) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds.max(1) {
        if wanted("lora") {
            lora.push(child(&args, "lora", &base)?);
            eprintln!("lora  {}", lora[lora.len() - 1]);
        }
        if !args.no_peft && wanted("peft") {
            peft_runs.push(peft(&args)?);
            eprintln!("peft  {}", peft_runs[peft_runs.len() - 1]);
        }
    }
    let mut rows: Vec<(&str, Value)> = Vec::new();
    if !lora.is_empty() {
        rows.push(("ours: LoRA", protocol::pool(&lora)));
    }
    if wanted("full") {
        let r = child(&args, "full", &base)?;
        eprintln!("full  {r}");
        rows.push(("ours: full fine-tuning", r));
    }
    if !peft_runs.is_empty() {
        rows.push(("PEFT + transformers: LoRA", protocol::pool(&peft_runs)));
    }
    let load_after = loadavg();
    let find = |c: &str| {
        rows.iter()
            .find(|(_, v)| v["case"] == c || (c == "peft" && v["bench"] == "peft_lora_step"))
            .map(|(_, v)| v.clone())
    };
    let peft_row = find("peft");
    let full_row = find("full");
    println!(
        "\nCPU: {}\nSmolLM2-135M shape, bf16, batch {BATCH} x block {BLOCK}; {threads} threads, \
         {} timed steps after {} warm-up per round, {} A B A B rounds (ours: LoRA, PEFT); peak \
         RSS over the whole process (in the steps alone); step memory: peak minus the RSS before \
         the model was built\n",
        protocol::this_cpu(),
        args.steps,
        args.warmup,
        args.rounds.max(1),
    );
    println!("load average (1, 5, 15 min): {load_before} before, {load_after} after\n");
    println!("| case | trainable | step (median) | / PEFT | peak RSS (in the steps) | step memory | peak / PEFT | peak / our full FT | other CPU (max per step) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, v) in &rows {
        let (s, p, b) = (
            f(v, "step_median_s"),
            f(v, "peak_rss_mib"),
            f(v, "rss_base_mib"),
        );
        let ps = f(v, "peak_rss_steps_mib");
        let vs = |other: &Option<Value>, k: &str, x: f64| match other {
            Some(o) => format!("**{:.2}x**", x / f(o, k)),
            None => "-".into(),
        };
        println!(
            "| {name} | {:.2} M | {:.0} ms | {} | {p:.0} MiB ({ps:.0} MiB) | {:.0} MiB | {} | {} | {} |",
            f(v, "trainable_params") / 1e6,
            s * 1e3,
            vs(&peft_row, "step_median_s", s),
            p - b,
            vs(&peft_row, "peak_rss_mib", p),
            vs(&full_row, "peak_rss_mib", p),
            share_cell(v),
        );
    }
    if let (Some(lora), Some(full), Some(peft)) = (find("lora"), full_row, peft_row) {
        let peak = |v: &Value| f(v, "peak_rss_mib");
        let check = |ok: bool| if ok { "met" } else { "NOT met" };
        let (vs_full, vs_peft) = (peak(&lora) / peak(&full), peak(&lora) / peak(&peft));
        let time = f(&lora, "step_median_s") / f(&peft, "step_median_s");
        println!(
            "\nTargets: LoRA peak <= 0.5x our full FT's: {vs_full:.2}x, {}; LoRA peak <= PEFT's: \
             {vs_peft:.2}x, {}; LoRA step <= 1.0x PEFT's (goal 0.8x): {time:.2}x, {}",
            check(vs_full <= 0.5),
            check(vs_peft <= 1.0),
            check(time <= 1.0),
        );
    }
    Ok(())
}

/// `/proc/loadavg`'s three load averages.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}
