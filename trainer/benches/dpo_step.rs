//! A DPO LoRA training step against TRL 1.16's `DPOTrainer` (issue #37), side by side.
//!
//! ```text
//! cargo bench -p trainer --bench dpo_step -- --steps 3 --warmup 2 --threads 2
//! cargo bench -p trainer --bench dpo_step -- --no-trl       # ours only
//! ```
//!
//! The model: SmolLM2-135M's shape, random weights in bf16 (the base `lora_step` writes, shared
//! with it). The data: `--pairs-file` preference records (JSONL `prompt` / `chosen` /
//! `rejected`), written once from tinyshakespeare (each prompt whole lines, about 300 characters,
//! each completion the next 900, the rejected one from elsewhere in the text), tokenised on both sides by the `llama3`
//! chat-fixture tokenizer (`tests/fixtures/chat/llama3`, 325 ids, all inside the embedding);
//! every pair is longer than 256 tokens, so both sides cut it to 256 (the prompt kept) and a
//! step computes the same sequences: 4 pairs (8 rows of 256 tokens) through the policy, forward
//! and backward, and through the reference (the base, adapters off) forward.
//!
//! Cases (each in its own process):
//! - `ours`: `Trainer::train_step` of an `objective = dpo` run (sigmoid loss, beta 0.1), LoRA r
//!   16, alpha 32, all-linear, dropout 0, the base frozen in bf16, bf16 compute, AdamW lr 1e-4,
//!   weight decay 0.01, no clipping;
//! - `trl`: `bench/trl_dpo_step.py`, the same step in TRL (bf16 base, f32 adapters, SDPA, the
//!   loss under `torch.autocast` to bf16).
//!
//! The bench protocol (BENCHMARKS.md): the CPU model printed, a step re-run while other
//! processes took over 2% of the machine, A B A B rounds pooled. Figures only: no targets yet.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use clap::Parser;
use serde_json::{json, Value};
use support::bases::{base_dir, Shape};
use support::protocol::{self, share_cell};
use support::run::{lora_config, run_steps, StepArgs};
use support::{f, last_json, loadavg, root};
use trainer::config::TrainConfig;
use trainer::data::DataKind;

const BLOCK: usize = 256;
const PAIRS: usize = 4;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: StepArgs,
    /// The Python with torch, transformers, peft and trl.
    #[arg(long, default_value = ".venv-py/bin/python")]
    python: PathBuf,
    /// Skip the TRL side.
    #[arg(long)]
    no_trl: bool,
    /// Where the base model is (written there once; default: Cargo's target tmp dir).
    #[arg(long)]
    base_dir: Option<PathBuf>,
    /// The preference records (written there once; default: Cargo's target tmp dir).
    #[arg(long)]
    pairs_file: Option<PathBuf>,
    /// Internal: run our case in this process.
    #[arg(long, hide = true)]
    child: bool,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

fn tokenizer_dir() -> PathBuf {
    root().join("trainer/tests/fixtures/chat/llama3")
}

/// The preference records: written once, 64 pairs from tinyshakespeare.
fn pairs_file(args: &Args) -> anyhow::Result<PathBuf> {
    let path = match &args.pairs_file {
        Some(p) => p.clone(),
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dpo_step_pairs.jsonl"),
    };
    if path.exists() {
        return Ok(path);
    }
    let text = std::fs::read_to_string(root().join("data/tinyshakespeare.txt"))?;
    let chars: Vec<char> = text.chars().collect();
    // The first position at or after `at` that starts a line.
    let line_start = |at: usize| at + chars[at..].iter().position(|&c| c == '\n').unwrap_or(0) + 1;
    let slice = |at: usize, n: usize| chars[at..at + n].iter().collect::<String>();
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
    for i in 0..64 {
        let at = line_start(i * 2100);
        let end = line_start(at + 300);
        let far = line_start((at + 400_000) % (chars.len() - 4000));
        let record = json!({
            "prompt": slice(at, end - at),
            "chosen": slice(end, 900),
            "rejected": slice(far, 900),
        });
        writeln!(out, "{record}")?;
    }
    out.flush()?;
    Ok(path)
}

fn run_ours(args: &Args, base: &Path, pairs: &Path) -> anyhow::Result<Value> {
    let tmp = tempfile::tempdir()?;
    let config = TrainConfig {
        data: DataKind::Preference,
        data_path: Some(pairs.to_path_buf()),
        tokenizer_path: Some(tokenizer_dir().join("tokenizer.json")),
        objective: "dpo".into(),
        dpo_beta: 0.1,
        block_size: BLOCK,
        batch_size: 2 * PAIRS,
        ..lora_config(tmp.path(), base)
    };
    let mut r = run_steps(config, &args.run)?;
    r["case"] = json!("ours");
    r["tokens_per_s"] = json!((2 * PAIRS * BLOCK) as f64 / f(&r, "step_median_s"));
    Ok(r)
}

fn side(args: &Args, base: &Path, pairs: &Path, trl: bool) -> anyhow::Result<Value> {
    let mut cmd = match trl {
        true => {
            let mut c = Command::new(root().join(&args.python));
            c.arg(root().join("bench/trl_dpo_step.py"))
                .arg("--tokenizer")
                .arg(tokenizer_dir());
            c
        }
        false => {
            let mut c = Command::new(std::env::current_exe()?);
            c.arg("--child");
            c
        }
    };
    cmd.arg("--base-dir")
        .arg(base)
        .arg("--pairs-file")
        .arg(pairs);
    args.run.pass_to(&mut cmd, trl);
    let what = if trl {
        "bench/trl_dpo_step.py"
    } else {
        "our step"
    };
    let r = last_json(cmd.output()?, what)?;
    eprintln!("{}  {r}", if trl { "trl" } else { "ours" });
    Ok(r)
}

fn main() -> anyhow::Result<()> {
    trainer::runtime::init();
    let args = Args::parse();
    if args.child {
        let base = args.base_dir.clone().context("--child needs --base-dir")?;
        let pairs = args
            .pairs_file
            .clone()
            .context("--child needs --pairs-file")?;
        println!("{}", run_ours(&args, &base, &pairs)?);
        return Ok(());
    }
    let args = Args {
        run: args.run.resolved(),
        ..args
    };
    let base = base_dir(Shape::Smollm2, args.base_dir.as_deref())?;
    let pairs = pairs_file(&args)?;
    let load_before = loadavg();
    let (mut ours, mut trl) = (Vec::new(), Vec::new());
    for _ in 0..args.run.rounds {
        ours.push(side(&args, &base, &pairs, false)?);
        if !args.no_trl {
            trl.push(side(&args, &base, &pairs, true)?);
        }
    }
    let load_after = loadavg();
    println!(
        "\nCPU: {}\nSmolLM2-135M shape, DPO (sigmoid, beta 0.1), LoRA r 16 all-linear, bf16; \
         {PAIRS} pairs x {BLOCK} tokens; {}\n",
        protocol::this_cpu(),
        args.run.describe("ours, TRL"),
    );
    println!("load average (1, 5, 15 min): {load_before} before, {load_after} after\n");
    let trl_row = (!trl.is_empty()).then(|| protocol::pool(&trl));
    println!("| case | trainable | load | step (median) | / TRL | peak RSS (in the steps) | other CPU (max per step) |");
    println!("|---|---|---|---|---|---|---|");
    let rows = [
        ("ours", Some(protocol::pool(&ours))),
        ("TRL DPOTrainer", trl_row.clone()),
    ];
    for (name, v) in rows.iter().filter_map(|(n, v)| v.as_ref().map(|v| (n, v))) {
        let s = f(v, "step_median_s");
        let vs = trl_row.as_ref().map_or("-".into(), |t| {
            format!("**{:.2}x**", s / f(t, "step_median_s"))
        });
        println!(
            "| {name} | {:.2} M | {:.1} s | {:.0} ms | {vs} | {:.0} MiB ({:.0} MiB) | {} |",
            f(v, "trainable_params") / 1e6,
            f(v, "load_s"),
            s * 1e3,
            f(v, "peak_rss_mib"),
            f(v, "peak_rss_steps_mib"),
            share_cell(v),
        );
    }
    Ok(())
}
