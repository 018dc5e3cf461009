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
//!
//! Gemma 3 (`--shape gemma3-270m`; issue #37): the same three cases at Gemma 3 270M's shape
//! (`Gemma3ForCausalLM`: 18 layers, 640 wide, 4 heads / 1 KV head of 256, MLP 2048, vocab
//! 262144, tied; the `config.json` of `scripts/python/make_gemma3_fixtures.py`'s `shape_270m`),
//! PEFT's side building the same shape (`bench/peft_lora_step.py --case gemma3-270m`); LoRA
//! targets its 126 projections. Figures only: no targets are printed for it. Our loss over the
//! 262144-row head is the chunked cross-entropy; transformers' takes the whole `[B, T, vocab]`
//! logits (1 GiB in f32 at B 4 x T 256).
//!
//! ```text
//! cargo bench -p trainer --bench lora_step -- --shape gemma3-270m --steps 2 --warmup 1 --threads 2
//! ```
//!
//! QLoRA (`--qlora`; issue #39): our `--base-quant nf4` step (the projections in bitsandbytes'
//! NF4, lm_head and embeddings in bf16, bf16 compute, the same adapters) against our bf16 LoRA
//! step at the same shape and against PEFT over transformers + bitsandbytes 0.50.2
//! (`bench/peft_qlora_step.py`, `--bnb-python`), the three sides in A B C A B C rounds, at
//! SmolLM2-135M's shape or Llama-3.2-1B's (`--shape llama-1b`: 16 x 2048, 32 / 8 heads, MLP
//! 8192, vocab 128256, tied). Besides the figures above, each side reports its load time (base
//! read and quantized), its base weight bytes (ours: the 4-bit projections' storage, packed
//! codes and scales, and the rest in bf16, measured on the quantized weights by a child of
//! its own) and the peak of its anonymous RSS (`RssAnon`, sampled every 2 ms by a thread:
//! `VmHWM` also counts the mapped safetensors file's pages, which the kernel can drop).
//!
//! ```text
//! cargo bench -p trainer --bench lora_step -- --qlora --steps 3 --warmup 2 --threads 2
//! cargo bench -p trainer --bench lora_step -- --qlora --shape llama-1b --steps 2 --warmup 1 --threads 2
//! ```
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::{json, Value};
use support::bases::{base_bytes, base_path, has_base, write_base, Shape};
use support::protocol::{self, share_cell};
use support::run::{lora_config, run_steps, StepArgs};
use support::{f, last_json, loadavg, root};
use trainer::config::{BaseQuant, Precision, TrainConfig};
use trainer::data::DataKind;

const BLOCK: usize = 256;
const BATCH: usize = 4;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: StepArgs,
    /// Run only the cases whose name contains this (`lora`, `full`, `peft`); with --qlora only
    /// the case of this name (`qlora`, `peft` or `lora`).
    #[arg(long)]
    only: Option<String>,
    /// The Python with torch, transformers and peft (relative to the workspace root, or
    /// absolute).
    #[arg(long, default_value = ".venv-py/bin/python")]
    python: PathBuf,
    /// The Python with bitsandbytes 0.50.2 besides them (`scripts/python/setup_bnb.sh`), for
    /// --qlora's PEFT side.
    #[arg(long, default_value = ".venv-bnb/bin/python")]
    bnb_python: PathBuf,
    /// Skip the PEFT side.
    #[arg(long)]
    no_peft: bool,
    /// The model's shape.
    #[arg(long, value_enum, default_value = "smollm2-135m")]
    shape: Shape,
    /// Compare QLoRA steps (ours `--base-quant nf4` against our bf16 LoRA and PEFT +
    /// bitsandbytes) instead of LoRA against full fine-tuning.
    #[arg(long)]
    qlora: bool,
    /// With --qlora: double quantization on both sides (`bnb_4bit_use_double_quant`).
    #[arg(long)]
    double_quant: bool,
    /// Where the base model is written (default: Cargo's target tmp dir, one per shape).
    #[arg(long)]
    base_dir: Option<PathBuf>,
    /// Internal: run one of our cases in this process.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

fn run_ours(case: &str, base: &Path, args: &Args) -> anyhow::Result<Value> {
    let (lora, quant) = match case {
        "lora" => (true, BaseQuant::None),
        "qlora" => (true, BaseQuant::Nf4),
        "full" => (false, BaseQuant::None),
        "bytes" => return base_bytes(args.shape, base, args.double_quant),
        "base" => return write_base(args.shape, base).map(|()| json!({ "case": "base" })),
        _ => bail!("unknown case {case}"),
    };
    let tmp = tempfile::tempdir()?;
    let config = TrainConfig {
        // Byte-level tinyshakespeare: ids < 256, inside every shape's embedding (as
        // llama_step feeds its 49152-vocab case).
        data: DataKind::Byte,
        data_path: Some(root().join("data/tinyshakespeare.txt")),
        block_size: BLOCK,
        batch_size: BATCH,
        lora_r: if lora { 16 } else { 0 },
        base_dtype: lora.then_some(Precision::Bf16),
        base_quant: quant,
        base_quant_double: args.double_quant,
        ..lora_config(tmp.path(), base)
    };
    let mut r = run_steps(config, &args.run)?;
    r["case"] = json!(case);
    r["tokens_per_s"] = json!((BATCH * BLOCK) as f64 / f(&r, "step_median_s"));
    Ok(r)
}

fn child(args: &Args, case: &str, base: &Path) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["--child", case])
        .arg("--base-dir")
        .arg(base)
        .args(["--shape", args.shape.name()]);
    args.run.pass_to(&mut cmd, false);
    if args.double_quant {
        cmd.arg("--double-quant");
    }
    let r = last_json(cmd.output()?, "our step")?;
    eprintln!("{case}  {r}");
    Ok(r)
}

fn peft(args: &Args, base: &Path) -> anyhow::Result<Value> {
    let (python, script) = match args.qlora {
        true => (&args.bnb_python, "bench/peft_qlora_step.py"),
        false => (&args.python, "bench/peft_lora_step.py"),
    };
    let mut cmd = Command::new(root().join(python));
    cmd.arg(root().join(script));
    args.run.pass_to(&mut cmd, true);
    match args.qlora {
        true => cmd.arg("--base").arg(base),
        false => cmd
            .args(["--dtype", "bf16"])
            .args(["--case", args.shape.name()]),
    };
    if args.double_quant {
        cmd.arg("--double-quant");
    }
    let r = last_json(cmd.output()?, script)?;
    eprintln!("peft  {r}");
    Ok(r)
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
    let args = Args {
        run: args.run.resolved(),
        ..args
    };
    match (args.qlora, args.shape) {
        (false, Shape::Llama1b) => {
            bail!("--shape llama-1b is for --qlora (our full fine-tuning would not fit)")
        }
        (true, Shape::Gemma3_270m) => {
            bail!("--shape gemma3-270m is for the LoRA step (PEFT's QLoRA side loads Llama)")
        }
        _ => {}
    }
    // Written by a child of its own, so that this process never holds the model.
    let base = base_path(args.shape, args.base_dir.as_deref());
    if !has_base(&base) {
        child(&args, "base", &base)?;
    }
    match args.qlora {
        true => qlora(&args, &base),
        false => lora(&args, &base),
    }
}

/// LoRA against PEFT and against our full fine-tuning.
fn lora(args: &Args, base: &Path) -> anyhow::Result<()> {
    let load_before = loadavg();
    let wanted = |name: &str| args.only.as_deref().is_none_or(|o| name.contains(o));
    // A B A B: ours (LoRA), PEFT, ours, PEFT...; then our full fine-tuning once.
    let (mut lora, mut peft_runs) = (Vec::new(), Vec::new());
    for _ in 0..args.run.rounds {
        if wanted("lora") {
            lora.push(child(args, "lora", base)?);
        }
        if !args.no_peft && wanted("peft") {
            peft_runs.push(peft(args, base)?);
        }
    }
    let mut rows: Vec<(&str, Value)> = Vec::new();
    if !lora.is_empty() {
        rows.push(("ours: LoRA", protocol::pool(&lora)));
    }
    if wanted("full") {
        rows.push(("ours: full fine-tuning", child(args, "full", base)?));
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
        "\nCPU: {}\n{} shape, bf16, batch {BATCH} x block {BLOCK}; {}; peak RSS over \
         the whole process (in the steps alone); step memory: peak minus the RSS before the model \
         was built; anonymous RSS peak sampled every {} ms (whole process, in the steps alone)\n",
        protocol::this_cpu(),
        args.shape.name(),
        args.run.describe("ours: LoRA, PEFT"),
        support::memory::PERIOD.as_millis(),
    );
    println!("load average (1, 5, 15 min): {load_before} before, {load_after} after\n");
    println!("| case | trainable | step (median) | / PEFT | peak RSS (in the steps) | step memory | peak / PEFT | peak / our full FT | anon RSS peak (in the steps) | anon / PEFT | other CPU (max per step) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, v) in &rows {
        let (s, p, b) = (
            f(v, "step_median_s"),
            f(v, "peak_rss_mib"),
            f(v, "rss_base_mib"),
        );
        let (ps, a) = (f(v, "peak_rss_steps_mib"), f(v, "anon_peak_mib"));
        println!(
            "| {name} | {:.2} M | {:.0} ms | {} | {p:.0} MiB ({ps:.0} MiB) | {:.0} MiB | {} | {} | {a:.0} MiB ({:.0} MiB) | {} | {} |",
            f(v, "trainable_params") / 1e6,
            s * 1e3,
            ratio(&peft_row, "step_median_s", s),
            p - b,
            ratio(&peft_row, "peak_rss_mib", p),
            ratio(&full_row, "peak_rss_mib", p),
            f(v, "anon_peak_steps_mib"),
            ratio(&peft_row, "anon_peak_mib", a),
            share_cell(v),
        );
    }
    // The targets are set at SmolLM2-135M's shape; other shapes give figures only.
    if !matches!(args.shape, Shape::Smollm2) {
        return Ok(());
    }
    if let (Some(lora), Some(full), Some(peft)) = (find("lora"), full_row, peft_row) {
        let peak = |v: &Value| f(v, "peak_rss_mib");
        let (vs_full, vs_peft) = (peak(&lora) / peak(&full), peak(&lora) / peak(&peft));
        let time = f(&lora, "step_median_s") / f(&peft, "step_median_s");
        println!(
            "\nTargets: LoRA peak <= 0.5x our full FT's: {vs_full:.2}x, {}; LoRA peak <= PEFT's: \
             {vs_peft:.2}x, {}; LoRA step <= 1.0x PEFT's (goal 0.8x): {time:.2}x, {}",
            met(vs_full <= 0.5),
            met(vs_peft <= 1.0),
            met(time <= 1.0),
        );
    }
    Ok(())
}

/// `x` over `other`'s field `k`, as a table cell (`-` without `other`).
fn ratio(other: &Option<Value>, k: &str, x: f64) -> String {
    match other {
        Some(o) => format!("**{:.2}x**", x / f(o, k)),
        None => "-".into(),
    }
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

/// QLoRA: ours over a 4-bit base against our bf16 LoRA and PEFT + bitsandbytes.
fn qlora(args: &Args, base: &Path) -> anyhow::Result<()> {
    let load_before = loadavg();
    // Whole names: `lora` is in `qlora`.
    let wanted = |name: &str| args.only.as_deref().is_none_or(|o| o == name);
    let bytes = child(args, "bytes", base)?;
    // A B C A B C: ours (QLoRA), PEFT + bitsandbytes, ours (bf16 LoRA).
    let (mut q, mut p, mut l) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.run.rounds {
        if wanted("qlora") {
            q.push(child(args, "qlora", base)?);
        }
        if !args.no_peft && wanted("peft") {
            p.push(peft(args, base)?);
        }
        if wanted("lora") {
            l.push(child(args, "lora", base)?);
        }
    }
    let load_after = loadavg();
    let rows: Vec<(&str, Value)> = [
        ("ours: QLoRA (nf4)", q),
        ("PEFT + bitsandbytes: QLoRA (nf4)", p),
        ("ours: LoRA, bf16 base", l),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(n, v)| (n, protocol::pool(&v)))
    .collect();
    let find = |prefix: &str| {
        rows.iter()
            .find(|(n, _)| n.starts_with(prefix))
            .map(|(_, v)| v.clone())
    };
    let (ours_q, peft_q, ours_l) = (find("ours: QLoRA"), find("PEFT"), find("ours: LoRA"));
    println!(
        "\nCPU: {}\n{} shape, bf16 compute, LoRA r 16 all-linear, batch {BATCH} x block {BLOCK}; \
         {}; double quantization {}; anonymous RSS peak sampled every {} ms (whole process, and \
         in the steps alone); VmHWM counts the mapped base file too\n",
        protocol::this_cpu(),
        args.shape.name(),
        args.run
            .describe("ours QLoRA, PEFT + bitsandbytes, our bf16 LoRA"),
        args.double_quant,
        support::memory::PERIOD.as_millis(),
    );
    println!("load average (1, 5, 15 min): {load_before} before, {load_after} after\n");
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let (pb, pq) = (f(&bytes, "proj_bf16_bytes"), f(&bytes, "proj_nf4_bytes"));
    let (wb, wq) = (
        f(&bytes, "whole_bf16_bytes"),
        f(&bytes, "whole_qlora_bytes"),
    );
    println!(
        "Base weight bytes ({} projections quantized): projections {:.3} GiB in NF4 against \
         {:.3} GiB in bf16 (**{:.3}x**); whole base {:.3} GiB against {:.3} GiB ({:.3}x)\n",
        bytes["quantized_layers"],
        gib(pq),
        gib(pb),
        pq / pb,
        gib(wq),
        gib(wb),
        wq / wb,
    );
    println!("| case | trainable | load | step (median) | / our LoRA | / PEFT | anon RSS peak (in the steps) | / our LoRA | / PEFT | VmHWM | other CPU (max per step) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, v) in &rows {
        let (s, a) = (f(v, "step_median_s"), f(v, "anon_peak_mib"));
        println!(
            "| {name} | {:.2} M | {:.1} s | {:.0} ms | {} | {} | {a:.0} MiB ({:.0} MiB) | {} | {} | {:.0} MiB | {} |",
            f(v, "trainable_params") / 1e6,
            f(v, "load_s"),
            s * 1e3,
            ratio(&ours_l, "step_median_s", s),
            ratio(&peft_q, "step_median_s", s),
            f(v, "anon_peak_steps_mib"),
            ratio(&ours_l, "anon_peak_mib", a),
            ratio(&peft_q, "anon_peak_mib", a),
            f(v, "peak_rss_mib"),
            share_cell(v),
        );
    }
    if let (Some(q), Some(l)) = (ours_q, ours_l) {
        let anon = |k: &str| f(&q, k) / f(&l, k);
        let (rss, steps) = (anon("anon_peak_mib"), anon("anon_peak_steps_mib"));
        let time = f(&q, "step_median_s") / f(&l, "step_median_s");
        println!(
            "\nTargets: projections' bytes <= 0.3x bf16's: {:.3}x, {}; QLoRA anon RSS peak <= \
             0.6x our bf16 LoRA's: {rss:.2}x over the whole process (load included), {}; \
             {steps:.2}x in the steps alone, {}; QLoRA step <= 1.3x our bf16 LoRA's: \
             {time:.2}x, {}",
            pq / pb,
            met(pq / pb <= 0.3),
            met(rss <= 0.6),
            met(steps <= 0.6),
            met(time <= 1.3),
        );
    }
    Ok(())
}
