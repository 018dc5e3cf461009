//! Memory/time benchmark of checkpointing policies on a 12-block GPT
//! (n_embd 256, n_head 8, block 256, batch 8, vocab 256, f32, CPU).
//!
//! Run: `cargo bench -p candle-remat --bench remat` (add `-- --quick` for 1 timed step).
//! Step time is the minimum over the timed steps (the machine is shared; the minimum is the
//! least noisy estimate); the mean is printed too.
//! Every case runs in its own child process (the same binary), because dhat's peak counter
//! cannot be reset: peak = dhat `max_bytes` during warm-up + timed steps minus the heap in use
//! before them (parameters, tokens). "act peak" subtracts the parameter-gradient bytes, which
//! every policy holds at the end of backward. Step = forward + loss + `Tape::backward`.

#[path = "../tests/common/mod.rs"]
mod common;

use candle_core::{DType, Device, Module};
use candle_remat::{measure_chain, BlockCost, ChainCosts, Policy, Tape};
use common::{tokens, Cfg, Gpt};
use std::process::Command;
use std::time::Instant;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const B: usize = 8;
const T: usize = 256;

fn cfg(fused_attention: bool, fused_ln: bool) -> Cfg {
    Cfg {
        vocab: 256,
        n_embd: 256,
        n_head: 8,
        n_layer: 12,
        block: T,
        dropout: 0.0,
        fused_attention,
        fused_ln,
    }
}

fn curr() -> u64 {
    dhat::HeapStats::get().curr_bytes as u64
}

fn costs_to_string(c: &ChainCosts) -> String {
    let blocks: Vec<String> = c
        .blocks
        .iter()
        .map(|b| format!("{}:{}:{}", b.act_bytes, b.out_bytes, b.fwd_ns))
        .collect();
    format!(
        "{};{};{}",
        c.input_bytes,
        c.overhead_bytes,
        blocks.join(",")
    )
}

fn costs_from_string(s: &str) -> ChainCosts {
    let mut it = s.trim().split(';');
    let input_bytes = it.next().unwrap().parse().unwrap();
    let overhead_bytes = it.next().unwrap().parse().unwrap();
    let blocks = it
        .next()
        .unwrap()
        .split(',')
        .map(|b| {
            let v: Vec<u64> = b.split(':').map(|x| x.parse().unwrap()).collect();
            BlockCost {
                act_bytes: v[0],
                out_bytes: v[1],
                fwd_ns: v[2],
            }
        })
        .collect();
    ChainCosts {
        input_bytes,
        overhead_bytes,
        blocks,
    }
}

fn parse_policy(s: &str) -> Policy {
    match s {
        "none" => Policy::None,
        "sqrt" => Policy::SqrtN,
        _ if s.starts_with('k') => Policy::EveryK(s[1..].parse().unwrap()),
        _ if s.starts_with('b') => Policy::Budget(s[1..].parse().unwrap()),
        _ => panic!("bad policy {s}"),
    }
}

/// dhat's heap profiler in testing mode (its statistics, no report file).
fn profiler() -> dhat::Profiler {
    dhat::Profiler::builder()
        .testing()
        .trim_backtraces(Some(1))
        .build()
}

/// Child: measure per-block costs (one block's graph alive at a time).
fn child_measure() -> anyhow::Result<()> {
    let _prof = profiler();
    let dev = Device::Cpu;
    let gpt = Gpt::new(0, cfg(false, false), DType::F32, &dev)?;
    let (idx, _) = tokens(1, B, T, 256, &dev)?;
    let tape = Tape::new(0);
    let x = gpt.embed(&tape, &idx)?.detach();
    let costs = measure_chain(&x, 12, &curr, |i, h| gpt.blocks[i].forward(h))?;
    println!("COSTS {}", costs_to_string(&costs));
    Ok(())
}

/// Child: run warm-up + timed steps of one case and print its figures.
fn child_case(
    policy: &str,
    fused_attention: bool,
    fused_ln: bool,
    costs: &ChainCosts,
    steps: usize,
) -> anyhow::Result<()> {
    let _prof = profiler();
    let dev = Device::Cpu;
    let gpt = Gpt::new(0, cfg(fused_attention, fused_ln), DType::F32, &dev)?;
    let (idx, tgt) = tokens(1, B, T, 256, &dev)?;
    let plan = parse_policy(policy).plan(costs)?;
    let param_bytes: u64 = gpt.vars().iter().map(|v| (v.elem_count() * 4) as u64).sum();
    let base = curr();
    let mut times = Vec::new();
    let mut loss_val = 0f32;
    for step in 0..=steps {
        let t0 = Instant::now();
        let tape = Tape::new(step as u64);
        let loss = gpt.loss(&tape, &plan, &idx, &tgt)?;
        let grads = tape.backward(&loss)?;
        loss_val = loss.to_scalar::<f32>()?;
        drop((grads, loss));
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let peak = dhat::HeapStats::get().max_bytes as u64 - base;
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let min = times.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "CASE {peak} {min} {param_bytes} {mean} {} {loss_val}",
        plan.predicted_peak_bytes
    );
    Ok(())
}

struct Row {
    name: String,
    policy: Policy,
    peak: u64,
    time: f64,
    mean: f64,
    grads: u64,
    loss: f32,
}

fn run_child(args: &[String]) -> anyhow::Result<String> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe).args(args).output()?;
    if !out.status.success() {
        anyhow::bail!(
            "child {:?} failed: {}",
            args,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn run_case(
    name: &str,
    policy: &str,
    la: bool,
    ll: bool,
    costs: &ChainCosts,
    steps: usize,
) -> anyhow::Result<Row> {
    let out = run_child(&[
        "--child-case".into(),
        policy.into(),
        la.to_string(),
        ll.to_string(),
        costs_to_string(costs),
        steps.to_string(),
    ])?;
    let line = out
        .lines()
        .find(|l| l.starts_with("CASE "))
        .ok_or_else(|| anyhow::anyhow!("no CASE line"))?;
    let v: Vec<&str> = line.split_whitespace().collect();
    let row = Row {
        name: name.to_string(),
        policy: parse_policy(policy),
        peak: v[1].parse()?,
        time: v[2].parse()?,
        grads: v[3].parse()?,
        mean: v[4].parse()?,
        loss: v[6].parse()?,
    };
    eprintln!(
        "  done: {name}: peak {:.1} MiB, {:.2} s/step",
        mib(row.peak),
        row.time
    );
    Ok(row)
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child-measure") {
        return child_measure();
    }
    if args.get(1).map(String::as_str) == Some("--child-case") {
        let costs = costs_from_string(&args[5]);
        return child_case(
            &args[2],
            args[3] == "true",
            args[4] == "true",
            &costs,
            args[6].parse()?,
        );
    }
    let steps = if args.iter().any(|a| a == "--quick") {
        1
    } else {
        3
    };
    println!("GPT: 12 blocks, n_embd 256, n_head 8, T {T}, B {B}, vocab 256, f32, CPU; min of {steps} timed step(s) after 1 warm-up");
    let out = run_child(&["--child-measure".into()])?;
    let line = out
        .lines()
        .find(|l| l.starts_with("COSTS "))
        .ok_or_else(|| anyhow::anyhow!("no COSTS"))?;
    let mut costs = costs_from_string(&line[6..]);
    let b0 = costs.blocks[0];
    println!(
        "measured per block (measure_chain): activations {:.1} MiB, output {:.2} MiB, forward {:.0} ms",
        mib(b0.act_bytes),
        mib(b0.out_bytes),
        b0.fwd_ns as f64 / 1e6
    );

    // (name, policy, fused attention, fused LayerNorm)
    let cases = [
        ("none", "none", false, false),
        ("fused attention op only", "none", true, false),
        ("ckpt every block (EveryK(1))", "k1", false, false),
        ("ckpt every 2 blocks (EveryK(2))", "k2", false, false),
        ("sqrt(N) (4 blocks/segment)", "sqrt", false, false),
        ("EveryK(1) + fused attention + fused LN", "k1", true, true),
    ];
    let mut rows = Vec::new();
    for (name, policy, la, ll) in cases {
        rows.push(run_case(name, policy, la, ll, &costs, steps)?);
    }
    // Calibrate the plan-independent overhead (parameter gradients, backward workspace, head)
    // on the EveryK(1) run, then plan for budgets of 30/40/50% of the unchecked peak.
    let k1_pred = Policy::EveryK(1).plan(&costs)?.predicted_peak_bytes;
    costs.overhead_bytes = rows[2].peak.saturating_sub(k1_pred);
    println!(
        "calibrated overhead: {:.1} MiB (EveryK(1) measured {:.1} MiB - predicted without overhead {:.1} MiB)",
        mib(costs.overhead_bytes),
        mib(rows[2].peak),
        mib(k1_pred)
    );
    let none_peak = rows[0].peak;
    let mut budgets = Vec::new();
    for pct in [30u64, 40, 50] {
        let budget = none_peak * pct / 100;
        let plan = Policy::Budget(budget).plan(&costs)?;
        println!("{plan}");
        rows.push(run_case(
            &format!("Budget({:.0} MiB = {pct}% of none)", mib(budget)),
            &format!("b{budget}"),
            false,
            false,
            &costs,
            steps,
        )?);
        budgets.push((rows.len() - 1, budget));
    }

    let none_act = (rows[0].peak - rows[0].grads) as f64;
    let none_t = rows[0].time;
    println!();
    println!("| case | peak step heap (MiB) | act peak = peak - grads (MiB) | act memory ratio (none/x) | step time min (s) | time ratio (x/none) | step time mean (s) | predicted peak (MiB) | loss |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let act = (r.peak - r.grads) as f64;
        let pred = r.policy.plan(&costs)?.predicted_peak_bytes;
        println!(
            "| {} | {:.1} | {:.1} | {:.2}x | {:.2} | {:.2}x | {:.2} | {:.1} | {:.6} |",
            r.name,
            mib(r.peak),
            act / 1048576.0,
            none_act / act,
            r.time,
            r.time / none_t,
            r.mean,
            mib(pred),
            r.loss
        );
    }
    println!();
    for (i, budget) in budgets {
        let r = &rows[i];
        let pred = r.policy.plan(&costs)?.predicted_peak_bytes;
        println!(
            "{}: measured {:.1} MiB = {:.1}% of budget, {:.1}% of the plan's prediction ({:.1} MiB)",
            r.name,
            mib(r.peak),
            100.0 * r.peak as f64 / budget as f64,
            100.0 * r.peak as f64 / pred as f64,
            mib(pred)
        );
    }
    println!(
        "peak-heap ratio none / EveryK(1) (incl. gradients) = {:.2}x",
        none_peak as f64 / rows[2].peak as f64
    );
    Ok(())
}
