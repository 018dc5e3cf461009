//! Training-step benchmark of the trainer's real step (`Trainer::train_step`: forward, loss,
//! backward, global-norm clipping, AdamW), fused kernels against the reference composite path,
//! side by side in one run.
//!
//! ```text
//! cargo bench -p trainer --bench step               # every config, 10 timed steps each
//! cargo bench -p trainer --bench step -- --quick    # 3 timed steps
//! cargo bench -p trainer --bench step -- --only gpt-4-4-256
//! cargo bench -p trainer --bench step -- --torch    # and bench/torch_step.py's PyTorch rows
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
//! The bench protocol (BENCHMARKS.md; `support::protocol`, `bench/bench_protocol.py`): the CPU
//! model and flags printed with the figures; each timed step re-run (up to 5 times) while other
//! processes or steal took over 2% of the machine; the sides in A B A B order (`--rounds`:
//! reference, fused[, PyTorch], reference, fused...), each side's steps pooled over the rounds.
//! With `--torch`, the PyTorch side is `bench/torch_step.py` (nanoGPT's model: SDPA attention,
//! bf16 through `torch.autocast`) run as a child with the same threads.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod support;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Parser;
use serde_json::{json, Value};
use support::protocol::{self, share_cell};
use support::{f, last_json, root, stdout_of};
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
    /// A B A B rounds of the sides.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Also run PyTorch (`bench/torch_step.py`) as a side.
    #[arg(long)]
    torch: bool,
    /// The Python with torch (relative to the workspace root, or absolute).
    #[arg(long, default_value = ".venv-py/bin/python")]
    python: PathBuf,
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

/// One case in this process; prints one JSON line (`time`) or one `RESULT` line (`heap`) for
/// the parent.
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
            for _ in 0..3 {
                t.train_step()?;
            }
            let mut mfu = Vec::with_capacity(steps);
            let timed = (0..steps)
                .map(|_| protocol::timed(|| t.train_step().map(|s| mfu.push(s.mfu))))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let times: Vec<f64> = timed.iter().map(|t| t.secs).collect();
            let tokens = (t.config.batch_size * t.config.block_size) as f64;
            let median = protocol::median(&times);
            let mut r = json!({
                "step_median_s": median,
                "step_mean_s": times.iter().sum::<f64>() / times.len() as f64,
                "tokens_per_s": tokens / median,
                "mfu": protocol::median(&mfu),
            });
            if let (Some(r), Value::Object(p)) = (r.as_object_mut(), protocol::summary(&timed)) {
                r.extend(p);
            }
            println!("{r}");
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

/// `bench/torch_step.py`'s JSON line for one case.
fn torch(args: &Args, case: &str, dtype: &str, steps: usize) -> anyhow::Result<Value> {
    let mut cmd = Command::new(root().join(&args.python));
    cmd.arg(root().join("bench/torch_step.py"))
        .args(["--json", "--only", case, "--dtype", dtype])
        .args(["--steps", &steps.to_string()])
        .args([
            "--threads",
            &candle_core::utils::get_num_threads().to_string(),
        ]);
    last_json(cmd.output()?, "bench/torch_step.py")
}

/// The `time` child's JSON line.
fn time_child(extra: &[String]) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .args(["--child", "time"])
        .args(extra)
        .output()
        .context("spawning a bench child")?;
    last_json(out, "bench child")
}

fn run_child(mode: &str, extra: &[String]) -> anyhow::Result<Vec<f64>> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .arg("--child")
        .arg(mode)
        .args(extra)
        .output()
        .context("spawning a bench child")?;
    let stdout = stdout_of(&out, "bench child")?;
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
    println!("CPU: {}", protocol::this_cpu());
    println!(
        "threads {} | matmul ceiling {:.1} GFLOP/s (f32 1024^3, MFU denominator) | {steps} timed steps after 3 warm-up per round, {} A B A B rounds",
        candle_core::utils::get_num_threads(),
        peak / 1e9,
        args.rounds.max(1),
    );
    println!();
    println!("| config | dtype | kernels | step (median) | step (mean) | tokens/s | MFU | peak heap | step peak | fused speed-up | other CPU (max per step) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for case in CASES {
        if args.only.as_deref().is_some_and(|o| !case.name.contains(o)) {
            continue;
        }
        for dtype in case.dtypes {
            let extra = |kernels: Kernels| -> Vec<String> {
                [
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
                .collect()
            };
            // A B A B: reference, fused[, PyTorch], reference, fused...
            let (mut reference, mut fused, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..args.rounds.max(1) {
                reference.push(time_child(&extra(Kernels::Reference))?);
                fused.push(time_child(&extra(Kernels::Fused))?);
                if args.torch {
                    theirs.push(torch(&args, case.name, dtype, steps)?);
                }
            }
            let reference_s = f(&protocol::pool(&reference), "step_median_s");
            let fused_s = f(&protocol::pool(&fused), "step_median_s");
            for (kernels, runs) in [(Kernels::Reference, reference), (Kernels::Fused, fused)] {
                let t = protocol::pool(&runs);
                let h = run_child("heap", &extra(kernels))?;
                let s = f(&t, "step_median_s");
                let speedup = match kernels {
                    Kernels::Fused => format!("{:.2}x", reference_s / s),
                    _ => "".to_string(),
                };
                println!(
                    "| {} | {dtype} | {kernels} | {:.1} ms | {:.1} ms | {:.0} | {:.1}% | {:.1} MiB | {:.1} MiB | {speedup} | {} |",
                    case.name,
                    s * 1e3,
                    f(&t, "step_mean_s") * 1e3,
                    f(&t, "tokens_per_s"),
                    100.0 * f(&t, "mfu"),
                    mib(h[0]),
                    mib(h[1]),
                    share_cell(&t),
                );
            }
            if !theirs.is_empty() {
                let t = protocol::pool(&theirs);
                let s = f(&t, "step_median_s");
                let (b, blk) = ((case.config)().batch_size, (case.config)().block_size);
                println!(
                    "| {} | {dtype} | PyTorch | {:.1} ms | {:.1} ms | {:.0} | {:.1}% | - | - | fused / PyTorch {:.2}x | {} |",
                    case.name,
                    s * 1e3,
                    f(&t, "step_mean_s") * 1e3,
                    (b * blk) as f64 / s,
                    100.0 * f(&t, "mfu"),
                    fused_s / s,
                    share_cell(&t),
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
