//! The GEMMs of a SmolLM2-135M-shaped training step (batch 4 x block 256: 1024 rows), ours
//! against `torch.matmul` on the same machine in the same minutes.
//!
//! ```text
//! scripts/python/setup.sh                                   # once: .venv-py with torch
//! cargo bench -p trainer --bench gemm                       # every product, f32 and bf16
//! cargo bench -p trainer --bench gemm -- --dtype bf16 --only mlp
//! cargo bench -p trainer --bench gemm -- --no-torch         # ours only
//! ```
//!
//! Ours is `candle_fused::linear::matmul`: the GEMM dispatch `linear`, its backward and the
//! chunked LM-head loss run (operands read in place through their strides; bf16 on the
//! AVX512-BF16 kernel where the CPU has it). PyTorch's is `torch.matmul` on the same layouts
//! (`bench/torch_gemm.py`): an operand marked transposed is a `.t()` view of a contiguous
//! tensor on both sides, as the step reads it (weights are stored `[out, in]`).
//!
//! Products, per layer kind: the forward `x Wᵀ`, the backward `dx = dy W` and `dW = dyᵀ x`
//! (the trainer computes it as `xᵀ dy` of the `[in, out]` view: the same product, transposed);
//! the LM head as the chunked loss runs it (288-row chunks, 4096-class blocks of the tied
//! 49152 x 576 embedding); LoRA r 16's four products for a 576 -> 1536 projection.
//!
//! The bench protocol (BENCHMARKS.md; `support::protocol`, `bench/bench_protocol.py`): the CPU
//! model and flags printed with the figures; a timed step is `reps` products (`reps` chosen so
//! that a step lasts at least `--min-step-ms`), re-run (up to 5 times) while other processes
//! or steal took over 2% of the machine; ours and PyTorch's in A B A B order (`--rounds`), each
//! side's steps pooled over the rounds; GFLOP/s counts 2 m k n per product.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use serde_json::{json, Value};
use support::protocol::{self, share_cell};
use support::{f, last_json, root};

#[derive(Parser, Debug)]
struct Args {
    /// `f32`, `bf16` or `all`.
    #[arg(long, default_value = "all")]
    dtype: String,
    /// Run only the products whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Timed steps per product and round.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// The shortest timed step, in milliseconds (a step repeats the product).
    #[arg(long, default_value_t = 200.0)]
    min_step_ms: f64,
    /// A B A B rounds (ours, PyTorch, ours, PyTorch...).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// The Python with torch (relative to the workspace root, or absolute).
    #[arg(long, default_value = ".venv-py/bin/python")]
    python: PathBuf,
    /// Skip the PyTorch side.
    #[arg(long)]
    no_torch: bool,
    /// Ours only: repeat each product for about this many GFLOP, three times over, and print
    /// the user-mode CPU time per product (a measure that holds on a loaded machine; see
    /// `cpu_time`).
    #[arg(long)]
    cpu_gflop: Option<f64>,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// One product `a [m, k] · b [k, n]`; `a_t` / `b_t`: the operand is a transposed view.
struct Product {
    name: String,
    m: usize,
    k: usize,
    n: usize,
    a_t: bool,
    b_t: bool,
}

impl Product {
    fn json(&self) -> Value {
        json!({"name": self.name, "m": self.m, "k": self.k, "n": self.n,
            "a_t": self.a_t, "b_t": self.b_t})
    }

    fn layout(&self) -> String {
        let t = |x: bool| if x { "ᵀ" } else { "" };
        format!("A{} B{}", t(self.a_t), t(self.b_t))
    }
}

/// The products of one SmolLM2-135M-shaped step at batch 4, block 256.
fn products() -> Vec<Product> {
    const ROWS: usize = 1024;
    let p = |name: &str, m, k, n, a_t, b_t| Product {
        name: name.into(),
        m,
        k,
        n,
        a_t,
        b_t,
    };
    let mut v = Vec::new();
    // A linear layer in -> out, weight stored [out, in]: forward x Wᵀ, dx = dy W, dW = dyᵀ x.
    for (what, i, o) in [
        ("q/o proj", 576, 576),
        ("k/v proj", 576, 192),
        ("mlp gate/up", 576, 1536),
        ("mlp down", 1536, 576),
    ] {
        v.push(p(&format!("{what} fwd"), ROWS, i, o, false, true));
        v.push(p(&format!("{what} dx"), ROWS, o, i, false, false));
        v.push(p(&format!("{what} dW"), o, ROWS, i, true, false));
    }
    // The chunked loss's LM head: 288-row chunks, 4096-class blocks of the [49152, 576] table.
    let (r, vb, c) = (288, 4096, 576);
    v.push(p("lm-head block fwd", r, c, vb, false, true));
    v.push(p("lm-head block dx", r, vb, c, false, false));
    v.push(p("lm-head block dW", vb, r, c, true, false));
    // LoRA r 16 on a 576 -> 1536 projection: h = x Aᵀ, y = h Bᵀ; dh = dy B, dA = dhᵀ x,
    // dB = dyᵀ h (and dx = dh A, the shape of h's product transposed).
    let (i, o, rank) = (576, 1536, 16);
    v.push(p("lora x·Aᵀ", ROWS, i, rank, false, true));
    v.push(p("lora h·Bᵀ", ROWS, rank, o, false, true));
    v.push(p("lora dh = dy·B", ROWS, o, rank, false, false));
    v.push(p("lora dA = dhᵀ·x", rank, ROWS, i, true, false));
    v.push(p("lora dB = dyᵀ·h", o, ROWS, rank, true, false));
    v.push(p("lora dx = dh·A", ROWS, rank, i, false, false));
    v
}

/// `a [m, k]` and `b [k, n]`, each a transposed view of a contiguous tensor where marked.
fn operands(p: &Product, dtype: DType) -> anyhow::Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let make = |r: usize, c: usize, t: bool| -> anyhow::Result<Tensor> {
        let x = Tensor::randn(0f32, 1.0, if t { (c, r) } else { (r, c) }, &dev)?.to_dtype(dtype)?;
        Ok(if t { x.t()? } else { x })
    };
    Ok((make(p.m, p.k, p.a_t)?, make(p.k, p.n, p.b_t)?))
}

/// Our side of one product: `steps` timed steps of `reps` products.
fn ours(p: &Product, dtype: DType, args: &Args) -> anyhow::Result<Value> {
    let (a, b) = operands(p, dtype)?;
    candle_fused::linear::matmul(&a, &b)?;
    let s = Instant::now();
    candle_fused::linear::matmul(&a, &b)?;
    let one = s.elapsed().as_secs_f64().max(1e-7);
    let reps = ((args.min_step_ms / 1e3 / one).ceil() as usize).max(1);
    let timed = (0..args.steps)
        .map(|_| {
            protocol::timed(|| -> anyhow::Result<()> {
                for _ in 0..reps {
                    candle_fused::linear::matmul(&a, &b)?;
                }
                Ok(())
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let med = protocol::median(&timed.iter().map(|t| t.secs).collect::<Vec<_>>());
    let mut r = json!({"name": p.name, "reps": reps, "step_median_s": med});
    if let (Some(r), Value::Object(s)) = (r.as_object_mut(), protocol::summary(&timed)) {
        r.extend(s);
    }
    Ok(r)
}

/// PyTorch's side of every product in one `bench/torch_gemm.py` process.
fn torch(ps: &[&Product], dtype: &str, args: &Args) -> anyhow::Result<Vec<Value>> {
    let shapes = Value::Array(ps.iter().map(|p| p.json()).collect());
    let mut cmd = Command::new(root().join(&args.python));
    cmd.arg(root().join("bench/torch_gemm.py"))
        .args(["--dtype", dtype, "--shapes", &shapes.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--min-step-ms", &args.min_step_ms.to_string()])
        .args([
            "--threads",
            &candle_core::utils::get_num_threads().to_string(),
        ]);
    let v = last_json(cmd.output()?, "bench/torch_gemm.py")?;
    v["shapes"]
        .as_array()
        .cloned()
        .context("bench/torch_gemm.py printed no shapes")
}

fn main() -> anyhow::Result<()> {
    // The trainer binary's process settings (Candle's pool spin limit, malloc thresholds).
    trainer::runtime::init();
    let args = Args::parse();
    let dtypes: Vec<&str> = match args.dtype.as_str() {
        "all" => vec!["f32", "bf16"],
        d => vec![d],
    };
    let all = products();
    let ps: Vec<&Product> = all
        .iter()
        .filter(|p| args.only.as_deref().is_none_or(|o| p.name.contains(o)))
        .collect();
    anyhow::ensure!(!ps.is_empty(), "no product matches --only");
    if let Some(gflop) = args.cpu_gflop {
        return cpu_time(&ps, &dtypes, gflop);
    }
    println!("CPU: {}", protocol::this_cpu());
    println!(
        "{} threads | {} timed steps of at least {} ms per product and round, {} A B A B rounds \
         (ours: candle_fused::linear::matmul; PyTorch: torch.matmul)\n",
        candle_core::utils::get_num_threads(),
        args.steps,
        args.min_step_ms,
        args.rounds.max(1),
    );
    println!("| product | m x k x n | layout | dtype | ours GFLOP/s | torch GFLOP/s | ours / torch | other CPU, ours (max per step) | other CPU, torch |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for dtype in dtypes {
        let dt: DType = match dtype {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            d => anyhow::bail!("--dtype {d}: expected f32, bf16 or all"),
        };
        // A B A B: all our products, then all of PyTorch's, per round.
        let mut mine: Vec<Vec<Value>> = vec![Vec::new(); ps.len()];
        let mut theirs: Vec<Vec<Value>> = vec![Vec::new(); ps.len()];
        for _ in 0..args.rounds.max(1) {
            for (i, p) in ps.iter().enumerate() {
                mine[i].push(ours(p, dt, &args)?);
            }
            if !args.no_torch {
                for (i, r) in torch(&ps, dtype, &args)?.into_iter().enumerate() {
                    theirs[i].push(r);
                }
            }
        }
        for (i, p) in ps.iter().enumerate() {
            // Steps of different rounds may repeat the product a different number of times:
            // pool GFLOP/s through each round's own reps.
            let o = pooled_gflops(p, &mine[i]);
            let t = pooled_gflops(p, &theirs[i]);
            let (oc, tc) = (
                share_cell(&protocol::pool(&mine[i])),
                match theirs[i].is_empty() {
                    true => "-".into(),
                    false => share_cell(&protocol::pool(&theirs[i])),
                },
            );
            println!(
                "| {} | {} x {} x {} | {} | {dtype} | {o:.1} | {t:.1} | **{:.2}x** | {oc} | {tc} |",
                p.name,
                p.m,
                p.k,
                p.n,
                p.layout(),
                o / t,
            );
        }
    }
    Ok(())
}

/// For loaded machines (and ones without `perf`'s cycle counters): each of `ps` in each dtype
/// repeated for about `gflop` GFLOP, three times, printing the user-mode CPU time per product
/// of each repeat in microseconds (a `|`-separated row). Other processes take wall-clock
/// time, not this process's CPU time, so runs made under load compare (single-threaded, with
/// `RAYON_NUM_THREADS=1`: a spinning pool thread counts too).
fn cpu_time(ps: &[&Product], dtypes: &[&str], gflop: f64) -> anyhow::Result<()> {
    for dtype in dtypes {
        let dt = match *dtype {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            d => anyhow::bail!("--dtype {d}: expected f32, bf16 or all"),
        };
        for p in ps {
            let (a, b) = operands(p, dt)?;
            let count = ((gflop * 1e9 / (2 * p.m * p.k * p.n) as f64).ceil() as usize).max(2);
            candle_fused::linear::matmul(&a, &b)?;
            let mut row = format!("{}|{dtype}|{} x {} x {}", p.name, p.m, p.k, p.n);
            for _ in 0..3 {
                let t0 = user_cpu_us();
                for _ in 0..count {
                    candle_fused::linear::matmul(&a, &b)?;
                }
                row += &format!("|{:.1}", (user_cpu_us() - t0) / count as f64);
            }
            println!("{row}");
        }
    }
    Ok(())
}

/// This process's user-mode CPU time so far, in microseconds.
fn user_cpu_us() -> f64 {
    // SAFETY: `getrusage` only writes the zeroed struct it is given.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    ru.ru_utime.tv_sec as f64 * 1e6 + ru.ru_utime.tv_usec as f64
}

/// The median GFLOP/s over every timed step of every round of one side (NaN when none).
fn pooled_gflops(p: &Product, rounds: &[Value]) -> f64 {
    let per_step: Vec<f64> = rounds
        .iter()
        .flat_map(|r| {
            let reps = f(r, "reps");
            r["step_times_s"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|t| t.as_f64())
                .map(move |t| 2.0 * (p.m * p.k * p.n) as f64 * reps / t / 1e9)
        })
        .collect();
    protocol::median(&per_step)
}
