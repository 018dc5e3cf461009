//! Training-step benchmark of the trainer's real step (`Trainer::train_step`: forward, loss,
//! backward, global-norm clipping, AdamW), fused kernels against the reference composite path,
//! side by side in one run.
//!
//! ```text
//! cargo bench -p trainer --bench step               # every config, 10 timed steps each
//! cargo bench -p trainer --bench step -- --quick    # 3 timed steps
//! cargo bench -p trainer --bench step -- --only gpt-4-4-256
//! ```
//!
//! Every case runs in child processes of this binary, one at a time: one that times the steps
//! (median after 3 warm-up steps, no heap profiler), one that counts the heap with `dhat`
//! (whose peak counter cannot be reset, hence a process per case). "peak heap" is the highest
//! live heap of the process during warm-up and timed steps (weights, data, optimiser state,
//! activations, gradients); "step peak" subtracts the heap live before the first step.
//! MFU counts model FLOPs as nanoGPT does (`trainer::mfu`) over one matmul ceiling measured
//! here once (f32, 1024³, Candle's GEMM with the same threads) and used for every case.
//!
//! The matching PyTorch script is `bench/torch_step.py`; run both in the same minutes.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Parser;
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::model::Kernels;
use trainer::train::Trainer;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[derive(Parser, Debug)]
struct Args {
    /// 3 timed steps instead of 10.
    #[arg(long)]
    quick: bool,
    /// Run only the configs whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Timed steps (after 3 warm-up steps).
    #[arg(long)]
    steps: Option<usize>,
    /// Internal: run one case in this process (`time` or `heap`).
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true)]
    case: Option<String>,
    #[arg(long, hide = true)]
    kernels: Option<Kernels>,
    #[arg(long, hide = true)]
    dtype: Option<String>,
    #[arg(long, hide = true)]
    peak_flops: Option<f64>,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A benchmark config: a name and the trainer config it runs.
struct Case {
    name: &'static str,
    about: &'static str,
    config: fn() -> TrainConfig,
    dtypes: &'static [&'static str],
}

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt")
}

fn base() -> TrainConfig {
    TrainConfig {
        out_dir: std::env::temp_dir().join("trainer-step-bench"),
        cache_dir: Some(std::env::temp_dir().join("trainer-step-bench-cache")),
        eval_problems: 0,
        dropout: 0.0,
        grad_clip: 1.0,
        ..TrainConfig::default()
    }
}

const CASES: &[Case] = &[
    Case {
        name: "gpt-4-4-256",
        about: "GPT 4/4/256, block 128, batch 8, vocab 256 (bytes of tinyshakespeare)",
        config: || TrainConfig {
            data: DataKind::Byte,
            data_path: Some(corpus()),
            n_layer: 4,
            n_head: 4,
            n_embd: 256,
            block_size: 128,
            batch_size: 8,
            ..base()
        },
        dtypes: &["f32", "bf16"],
    },
    Case {
        name: "baby-gpt",
        about: "nanoGPT's CPU baby GPT: 4/4/128, block 64, batch 12, char vocab 65",
        config: || TrainConfig {
            data: DataKind::Char,
            data_path: Some(corpus()),
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            batch_size: 12,
            ..base()
        },
        dtypes: &["f32"],
    },
    Case {
        name: "addition",
        about: "the default run: 2-digit addition, 3/4/128, block 9, batch 128",
        config: base,
        dtypes: &["f32"],
    },
];

fn mib(b: f64) -> f64 {
    b / (1024.0 * 1024.0)
}

fn build(case: &Case, kernels: Kernels, dtype: &str, peak: f64) -> anyhow::Result<Trainer> {
    let mut cfg = (case.config)();
    cfg.kernels = kernels;
    cfg.dtype = dtype.parse().map_err(anyhow::Error::msg)?;
    cfg.peak_flops = peak;
    Trainer::new(cfg).context("building the trainer")
}

/// One case in this process; prints one `RESULT` line for the parent.
fn child(args: &Args) -> anyhow::Result<()> {
    let name = args.case.as_deref().unwrap_or_default();
    let case = CASES
        .iter()
        .find(|c| c.name == name)
        .with_context(|| format!("no case {name}"))?;
    let kernels = args.kernels.unwrap_or_default();
    let dtype = args.dtype.as_deref().unwrap_or("f32");
    let peak = args.peak_flops.unwrap_or(1.0);
    let steps = args.steps.unwrap_or(10);
    match args.child.as_deref() {
        Some("time") => {
            let mut t = build(case, kernels, dtype, peak)?;
            let mut times = Vec::with_capacity(steps);
            let mut mfu = Vec::with_capacity(steps);
            for i in 0..steps + 3 {
                let start = Instant::now();
                let s = t.train_step()?;
                if i >= 3 {
                    times.push(start.elapsed().as_secs_f64());
                    mfu.push(s.mfu);
                }
            }
            let tokens = (t.config.batch_size * t.config.block_size) as f64;
            let mut sorted = times.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            let mean = times.iter().sum::<f64>() / times.len() as f64;
            let mut m = mfu.clone();
            m.sort_by(f64::total_cmp);
            println!(
                "RESULT {} {} {} {}",
                median * 1e3,
                mean * 1e3,
                tokens / median,
                m[m.len() / 2]
            );
        }
        Some("heap") => {
            let _profiler = dhat::Profiler::builder().testing().build();
            let mut t = build(case, kernels, dtype, peak)?;
            let base = dhat::HeapStats::get().curr_bytes as f64;
            for _ in 0..3 {
                t.train_step()?;
            }
            let stats = dhat::HeapStats::get();
            println!(
                "RESULT {} {}",
                stats.max_bytes as f64,
                stats.max_bytes as f64 - base
            );
        }
        other => bail!("unknown child mode {other:?}"),
    }
    Ok(())
}

fn run_child(mode: &str, extra: &[String]) -> anyhow::Result<Vec<f64>> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .arg("--child")
        .arg(mode)
        .args(extra)
        .output()
        .context("spawning a bench child")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "bench child failed: {}\n{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .context("bench child printed no RESULT")?;
    line.split_whitespace()
        .map(|v| v.parse::<f64>().context("parsing a RESULT"))
        .collect()
}

fn main() -> anyhow::Result<()> {
    trainer::runtime::init();
    let args = Args::parse();
    if args.child.is_some() {
        return child(&args);
    }
    let steps = args.steps.unwrap_or(if args.quick { 3 } else { 10 });
    let peak = trainer::mfu::measure_matmul_flops(&Device::Cpu, DType::F32)?;
    println!(
        "threads {} | matmul ceiling {:.1} GFLOP/s (f32 1024^3, MFU denominator) | {steps} timed steps after 3 warm-up",
        candle_core::utils::get_num_threads(),
        peak / 1e9
    );
    println!();
    println!("| config | dtype | kernels | step (median) | step (mean) | tokens/s | MFU | peak heap | step peak | fused speed-up |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for case in CASES {
        if args.only.as_deref().is_some_and(|o| !case.name.contains(o)) {
            continue;
        }
        for dtype in case.dtypes {
            let mut reference_ms = None;
            for kernels in [Kernels::Reference, Kernels::Fused] {
                let extra: Vec<String> = [
                    "--case",
                    case.name,
                    "--kernels",
                    &kernels.to_string(),
                    "--dtype",
                    dtype,
                    "--peak-flops",
                    &peak.to_string(),
                    "--steps",
                    &steps.to_string(),
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                let t = run_child("time", &extra)?;
                let h = run_child("heap", &extra)?;
                let speedup = match (kernels, reference_ms) {
                    (Kernels::Fused, Some(r)) => format!("{:.2}x", r / t[0]),
                    _ => "".to_string(),
                };
                if kernels == Kernels::Reference {
                    reference_ms = Some(t[0]);
                }
                println!(
                    "| {} | {dtype} | {kernels} | {:.1} ms | {:.1} ms | {:.0} | {:.1}% | {:.1} MiB | {:.1} MiB | {speedup} |",
                    case.name,
                    t[0],
                    t[1],
                    t[2],
                    100.0 * t[3],
                    mib(h[0]),
                    mib(h[1]),
                );
            }
        }
    }
    println!();
    for case in CASES {
        println!("{}: {}", case.name, case.about);
    }
    Ok(())
}
