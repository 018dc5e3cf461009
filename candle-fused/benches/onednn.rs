//! CPU time of one GEMM (`candle_fused::linear::matmul`) per shape, single-threaded, on the
//! path this process chose for the dtype: the native kernels, or oneDNN with the `onednn`
//! feature (bf16 where the CPU has AVX512-BF16; f32 too with `CANDLE_FUSED_ONEDNN=1`; none with
//! `CANDLE_FUSED_ONEDNN=0`: see `src/onednn.rs`). The time is the calling thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`), the minimum of `--reps` calls after one warm-up: a figure that
//! holds up on a loaded machine better than wall-clock time (it excludes time off the CPU, not
//! cache contention).
//!
//! ```sh
//! RAYON_NUM_THREADS=1 CANDLE_FUSED_ONEDNN=0 cargo bench -p candle-fused --features onednn --bench onednn
//! RAYON_NUM_THREADS=1 CANDLE_FUSED_ONEDNN=1 cargo bench -p candle-fused --features onednn --bench onednn
//! cargo bench -p candle-fused --bench onednn -- 1024x576x1536nt bf16   # shapes and dtypes
//! ```
//!
//! A shape is `MxKxN` with `t` / `n` per operand (`t`: a transposed view of a contiguous
//! tensor, as the trainer reads weights stored `[out, in]`); the defaults are SmolLM2-135M
//! step products of the GEMM table in BENCHMARKS.md (1024 rows).
#![allow(clippy::disallowed_macros)] // prints its table

use candle_core::{DType, Device, Result, Tensor};

const DEFAULT: [&str; 7] = [
    "1024x576x576nt",  // q/o proj fwd
    "1024x576x1536nt", // mlp gate/up fwd
    "1024x1536x576nn", // mlp gate/up dx
    "1536x1024x576tn", // mlp gate/up dW
    "288x576x4096nt",  // lm-head block fwd
    "1024x576x16nt",   // lora x·Aᵀ
    "1536x1024x16tn",  // lora dB = dyᵀ·h
];

/// The calling thread's CPU time in seconds.
fn cpu_s() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// `(m, k, n, a_t, b_t)` of `MxKxN` followed by two of `n` / `t`.
fn parse(s: &str) -> Option<(usize, usize, usize, bool, bool)> {
    let (dims, tr) = s.split_at(s.len().checked_sub(2)?);
    let d: Vec<usize> = dims
        .split('x')
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    let t = |c: u8| {
        matches!(c, b't')
            .then_some(true)
            .or(matches!(c, b'n').then_some(false))
    };
    let (a_t, b_t) = (t(tr.as_bytes()[0])?, t(tr.as_bytes()[1])?);
    (d.len() == 3).then(|| (d[0], d[1], d[2], a_t, b_t))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let reps = 5;
    let mut shapes: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| a.contains('x'))
        .collect();
    if shapes.is_empty() {
        shapes = DEFAULT.to_vec();
    }
    let dtypes: Vec<DType> = match args.iter().find(|a| !a.contains('x')).map(String::as_str) {
        Some("f32") => vec![DType::F32],
        Some("bf16") => vec![DType::BF16],
        _ => vec![DType::F32, DType::BF16],
    };
    println!(
        "{} thread(s), min of {reps} calls",
        rayon::current_num_threads()
    );
    println!("| product | dtype | path | CPU ms | GFLOP/s of CPU time |");
    for s in shapes {
        let Some((m, k, n, a_t, b_t)) = parse(s) else {
            candle_core::bail!(
                "bad shape {s:?}: want MxKxN followed by n/t twice, e.g. 1024x576x576nt"
            )
        };
        for &dt in &dtypes {
            let make = |r: usize, c: usize, t: bool| -> Result<Tensor> {
                let x = Tensor::randn(0f32, 1.0, if t { (c, r) } else { (r, c) }, &Device::Cpu)?;
                let x = x.to_dtype(dt)?;
                if t {
                    x.t()
                } else {
                    Ok(x)
                }
            };
            let (a, b) = (make(m, k, a_t)?, make(k, n, b_t)?);
            candle_fused::linear::matmul(&a, &b)?;
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t0 = cpu_s();
                let y = candle_fused::linear::matmul(&a, &b)?;
                best = best.min(cpu_s() - t0);
                drop(y);
            }
            let gf = 2.0 * (m * k * n) as f64 / best / 1e9;
            let path = match candle_fused::onednn::active(dt) {
                true => "oneDNN",
                false => "native",
            };
            println!("| {s} | {dt:?} | {path} | {:.2} | {gf:.1} |", best * 1e3);
        }
    }
    Ok(())
}
