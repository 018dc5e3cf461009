//! A Llama training step against transformers' `LlamaForCausalLM` in PyTorch (its default SDPA
//! attention; bf16 through `torch.autocast`), side by side in one run: same shapes, threads,
//! dtype and step (forward with the shifted cross-entropy, backward, clip the global norm to
//! 1.0, AdamW with betas (0.9, 0.95) and weight decay 0.1).
//!
//! ```text
//! scripts/python/setup.sh                                   # once: .venv-py with torch + transformers
//! cargo bench -p trainer --bench llama_step                 # every case, f32 and bf16
//! cargo bench -p trainer --bench llama_step -- --only llama-small --dtype f32 --steps 3
//! cargo bench -p trainer --bench llama_step -- --no-torch   # ours only
//! cargo bench -p trainer --bench llama_step -- --eager      # and transformers' eager attention
//! ```
//!
//! The bench protocol (BENCHMARKS.md; `support::protocol`, `bench/bench_protocol.py`): the CPU
//! model and flags printed with the figures; each timed step re-run (up to 5 times) while other
//! processes or steal took over 2% of the machine; ours and PyTorch's in A B A B order
//! (`--rounds`), each side's steps pooled over the rounds.
//!
//! Cases: `smollm2-135m` (SmolLM2-135M's shape: 30 layers, 576 wide, 9 heads / 3 KV heads,
//! MLP 1536, vocab 49152, tied; block 256, batch 4) and `llama-small` (8 layers, 256 wide,
//! 8 heads / 2 KV heads, MLP 704, vocab 8192, untied; block 256, batch 8) and `gemma3-270m`
//! (issue #37: Gemma 3 270M's shape, `Gemma3ForCausalLM` with 18 layers, 640 wide, 4 heads /
//! 1 KV head of 256, MLP 2048, vocab 262144, tied, 5 sliding layers to 1 full; block 256, batch
//! 4; the `config.json` of `scripts/python/make_gemma3_fixtures.py`'s `shape_270m`, which both
//! sides read; figures only), as in `bench/torch_llama_step.py`, which runs the PyTorch side
//! (each case in its own process).
//!
//! ```text
//! cargo bench -p trainer --bench llama_step -- --only gemma3-270m --dtype bf16 --steps 2 --threads 2
//! ```
//!
//! Each of our cases runs in a child process of this binary (so its peak RSS is its own), with
//! the `trainer` binary's process settings (`trainer::runtime::init`):
//! `--warmup` steps, then `--steps` timed steps of `Trainer::train_step` (median reported).
//! Memory: the process's peak RSS (`VmHWM`) over those steps, and that peak minus the RSS before
//! the model was built ("step memory": weights, gradients, AdamW state, activations; PyTorch's
//! side subtracts its RSS after `import torch` the same way), and the peak of the anonymous RSS
//! (`RssAnon` sampled every 2 ms by a thread, from before the model is built). f32 cases also run with the whole
//! `[B, T, vocab]` logits (`chunked_loss = false`) to show what the chunked loss saves.
//!
//! Matmul share: PyTorch's column is its profiler's self CPU time of `mm`/`addmm`/`bmm`/
//! `matmul` over one step (eager attention's two batched products included). Ours comes from
//! `perf` over a child (the GEMM kernels' samples over all samples; see BENCHMARKS.md for the
//! command), since Candle has no op profiler.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod support;

use anyhow::Context;
use clap::Parser;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use support::bases::Shape;
use support::memory::AnonPeak;
use support::protocol::{self, share_cell};
use support::{f, last_json, root, status_kib};
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::model::llama::{Family, LlamaConfig};
use trainer::model::ModelConfig;
use trainer::train::Trainer;

#[derive(Parser, Debug)]
struct Args {
    /// Run only the cases whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// `f32`, `bf16` or `all`.
    #[arg(long, default_value = "all")]
    dtype: String,
    /// Timed steps per case.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Warm-up steps per case.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Threads for both sides (0: the machine's cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The Python with torch and transformers.
    #[arg(long, default_value = ".venv-py/bin/python")]
    python: PathBuf,
    /// Skip the PyTorch side.
    #[arg(long)]
    no_torch: bool,
    /// A B A B rounds (ours, PyTorch, ours, PyTorch...).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Also run PyTorch with transformers' eager attention (a second PyTorch row).
    #[arg(long)]
    eager: bool,
    /// Internal: run one of our cases in this process.
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true)]
    whole_logits: bool,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A case: `(name, config, block, batch)`.
type Case = (&'static str, Box<dyn ModelConfig>, usize, usize);

fn cases() -> anyhow::Result<Vec<Case>> {
    let smol = LlamaConfig {
        tie_word_embeddings: true,
        rope_theta: 100000.0,
        ..LlamaConfig::new(Family::Llama, 49152, 30, 576, 9, 3, 1536)
    };
    let small = LlamaConfig::new(Family::Llama, 8192, 8, 256, 8, 2, 704);
    Ok(vec![
        ("smollm2-135m", Box::new(smol), 256, 4),
        ("llama-small", Box::new(small), 256, 8),
        ("gemma3-270m", Shape::Gemma3_270m.config()?, 256, 4),
    ])
}

fn run_ours(name: &str, dtype: &str, args: &Args) -> anyhow::Result<Value> {
    let (_, cfg, block, batch) = cases()?
        .into_iter()
        .find(|c| c.0 == name)
        .context("unknown case")?;
    let tmp = tempfile::tempdir()?;
    let json_path = tmp.path().join("config.json");
    let mut hf = cfg.to_hf_json();
    hf["max_position_embeddings"] = json!(2048);
    std::fs::write(&json_path, hf.to_string())?;
    let anon = AnonPeak::start();
    let rss_base = status_kib("VmRSS:") / 1024.0;
    let config = TrainConfig {
        out_dir: tmp.path().join("run"),
        cache_dir: Some(tmp.path().join("cache")),
        model_json: Some(json_path),
        data: DataKind::Byte,
        data_path: Some(root().join("data/tinyshakespeare.txt")),
        block_size: block,
        batch_size: batch,
        max_iters: 1_000_000,
        eval_interval: 1_000_000,
        eval_problems: 0,
        lr: 1e-3,
        beta2: 0.95,
        weight_decay: 0.1,
        grad_clip: 1.0,
        dtype: dtype.parse().map_err(anyhow::Error::msg)?,
        chunked_loss: !args.whole_logits,
        peak_flops: 1e12,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(config)?;
    for _ in 0..args.warmup {
        t.train_step()?;
    }
    let timed = (0..args.steps)
        .map(|_| protocol::timed(|| t.train_step()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let peak = status_kib("VmHWM:") / 1024.0;
    let median = protocol::median(&timed.iter().map(|t| t.secs).collect::<Vec<_>>());
    let mut r = json!({
        "case": name, "dtype": dtype, "whole_logits": args.whole_logits,
        "step_median_s": median, "tokens_per_s": (batch * block) as f64 / median,
        "peak_rss_steps_mib": peak, "rss_base_mib": rss_base, "anon_peak_mib": anon.peak_mib(),
    });
    merge(&mut r, protocol::summary(&timed));
    Ok(r)
}

fn child(args: &Args, case: &str, dtype: &str, whole: bool) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["--child", case, "--dtype", dtype]).args([
        "--steps",
        &args.steps.to_string(),
        "--warmup",
        &args.warmup.to_string(),
    ]);
    if whole {
        cmd.arg("--whole-logits");
    }
    if args.threads > 0 {
        cmd.env("RAYON_NUM_THREADS", args.threads.to_string());
    }
    last_json(cmd.output()?, "our step")
}

/// `extra`'s fields into `v`.
fn merge(v: &mut Value, extra: Value) {
    if let (Some(v), Value::Object(e)) = (v.as_object_mut(), extra) {
        v.extend(e);
    }
}

fn torch(args: &Args, case: &str, dtype: &str, attn: &str) -> anyhow::Result<Value> {
    let mut cmd = Command::new(root().join(&args.python));
    cmd.arg(root().join("bench/torch_llama_step.py"))
        .args(["--child", case, "--dtype", dtype, "--no-peak-tensors"])
        .args(["--attn", attn])
        .args([
            "--steps",
            &args.steps.to_string(),
            "--warmup",
            &args.warmup.to_string(),
        ])
        .args(["--threads", &args.threads.to_string()]);
    last_json(cmd.output()?, "bench/torch_llama_step.py")
}

fn main() -> anyhow::Result<()> {
    // The trainer binary's process settings (Candle's pool spin limit, malloc thresholds).
    trainer::runtime::init();
    let args = Args::parse();
    if let Some(case) = &args.child {
        let r = run_ours(case, &args.dtype, &args)?;
        println!("{r}");
        return Ok(());
    }
    let dtypes: Vec<String> = match args.dtype.as_str() {
        "all" => vec!["f32".into(), "bf16".into()],
        d => vec![d.to_string()],
    };
    let threads = match args.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let args = Args { threads, ..args };
    let mut rows = Vec::new();
    for (name, ..) in cases()? {
        if args.only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        for dtype in dtypes.iter().map(String::as_str) {
            // A B A B: ours, PyTorch (SDPA), [PyTorch eager,] ours, PyTorch...
            let (mut ours, mut sdpa, mut eager) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..args.rounds.max(1) {
                ours.push(child(&args, name, dtype, false)?);
                eprintln!("ours  {}", ours[ours.len() - 1]);
                if !args.no_torch {
                    sdpa.push(torch(&args, name, dtype, "sdpa")?);
                    eprintln!("torch {}", sdpa[sdpa.len() - 1]);
                    if args.eager {
                        eager.push(torch(&args, name, dtype, "eager")?);
                        eprintln!("eager {}", eager[eager.len() - 1]);
                    }
                }
            }
            // Memory only: the whole logits, once.
            let whole = match dtype {
                "f32" => Some(child(&args, name, dtype, true)?),
                _ => None,
            };
            let (ours, sdpa) = (protocol::pool(&ours), protocol::pool(&sdpa));
            let eager = (!eager.is_empty()).then(|| protocol::pool(&eager));
            let sdpa = (!sdpa.is_null()).then_some(sdpa);
            rows.push((name, dtype.to_string(), ours, whole, sdpa, eager));
        }
    }
    println!(
        "\nCPU: {}\n{threads} threads, {} timed steps after {} warm-up per round, {} A B A B \
         rounds (ours, then transformers with SDPA attention; bf16 under torch.autocast); \
         memory: peak RSS over the steps (step memory: minus the RSS before the model was built); \
         anonymous RSS peak sampled every {} ms\n",
        protocol::this_cpu(),
        args.steps,
        args.warmup,
        args.rounds.max(1),
        support::memory::PERIOD.as_millis(),
    );
    println!("| case | dtype | ours: step | torch: step | ours / torch | ours: peak RSS (step memory) | torch: peak RSS (step memory) | ours / torch (step memory) | torch: matmul share | ours with whole logits: peak RSS (step memory) | torch eager: step | anon RSS peak: ours, torch | other CPU, ours (max per step) | other CPU, torch |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, dtype, o, w, t, e) in rows {
        let mem = |v: &Value| {
            let (p, b) = (f(v, "peak_rss_steps_mib"), f(v, "rss_base_mib"));
            (p, p - b)
        };
        let (op, om) = mem(&o);
        let (tp, tm, ts, tshare) = match &t {
            Some(t) => {
                let (p, m) = mem(t);
                (p, m, f(t, "step_median_s"), f(t, "matmul_share"))
            }
            None => (f64::NAN, f64::NAN, f64::NAN, f64::NAN),
        };
        let whole = match &w {
            Some(w) => {
                let (p, m) = mem(w);
                format!("{p:.0} MiB ({m:.0} MiB)")
            }
            None => "-".into(),
        };
        let os = f(&o, "step_median_s");
        let eager = match &e {
            Some(e) => format!("{:.2} s", f(e, "step_median_s")),
            None => "-".into(),
        };
        let tcell = t.as_ref().map_or("-".into(), share_cell);
        let ta = t.as_ref().map_or(f64::NAN, |t| f(t, "anon_peak_mib"));
        let anon = format!("{:.0} MiB, {ta:.0} MiB", f(&o, "anon_peak_mib"));
        println!(
            "| {name} | {dtype} | {os:.2} s | {ts:.2} s | **{:.2}x** | {op:.0} MiB ({om:.0} MiB) | {tp:.0} MiB ({tm:.0} MiB) | **{:.2}x** ({:.2}x) | {:.0}% | {whole} | {eager} | {anon} | {} | {tcell} |",
            os / ts,
            op / tp,
            om / tm,
            100.0 * tshare,
            share_cell(&o),
        );
    }
    Ok(())
}
