//! Per-op times of candle-fused's CPU kernels at the shapes of the trainer's two benchmark
//! models (and of SmolLM2-135M for the Llama-family ops, RoPE, SwiGLU and the LoRA linear),
//! forward alone and forward + backward, each next to the composite Candle expression it
//! replaces. The LoRA composite computes the frozen weight's gradient too (Candle's matmul
//! backward differentiates both operands), the fused op does not.
//!
//! ```sh
//! cargo bench -p candle-fused --bench ops                 # every op, both models
//! cargo bench -p candle-fused --bench ops -- attention    # ops whose name contains a filter
//! ```
//!
//! Each cell is the median of `--iters` timed calls (default 30) after 5 warm-up calls, in one
//! process, so the ratios in a row are measured in the same minutes. Nothing here is asserted:
//! the numbers go to `BENCHMARKS.md`.
//!
//! A step of a model keeps its buffers' pages mapped from one step to the next; a loop that
//! frees everything after each call does not, and with glibc's default thresholds the page
//! faults and TLB shootdowns of returning large blocks to the OS and mapping them again then
//! cost more than the kernels (3-6x on the backward columns here). So the bench first raises
//! glibc's mmap and trim thresholds, as a long-running trainer effectively has them.
//!
//! `linear_cross_entropy` has its own table at a real vocabulary (SmolLM2-135M's head, one
//! forward + backward is seconds here): forward + backward of the fused op and of the composite,
//! the median of at most 5 calls after one warm-up, the peak heap of those calls above what was
//! in use before them (this binary counts its heap with `test_support::alloc`), and the peak
//! heap of a forward on detached inputs (an evaluation: no gradient computed or kept).

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_fused::attention::{
    attention_merged, attention_merged_composite, attention_qkv, attention_qkv_composite,
    AttentionConfig,
};
use candle_fused::{
    cross_entropy, gelu, linear, linear_cross_entropy, linear_gelu, lora, norm, rope, swiglu,
};
use test_support::alloc::{self, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// A model's shapes: batch, sequence, width, heads, vocabulary.
struct Shapes {
    name: &'static str,
    b: usize,
    t: usize,
    c: usize,
    h: usize,
    v: usize,
}

const MODELS: [Shapes; 2] = [
    Shapes {
        name: "baby GPT 4/4/128, T 64, B 12",
        b: 12,
        t: 64,
        c: 128,
        h: 4,
        v: 65,
    },
    Shapes {
        name: "GPT 4/4/256, T 128, B 8",
        b: 8,
        t: 128,
        c: 256,
        h: 4,
        v: 256,
    },
];

/// Median wall time of `f` in milliseconds.
fn median_ms(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..5 {
        f()?;
    }
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        f()?;
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

/// Times `op` on `inputs` forward, then forward + backward of the sum of the output (gradients
/// of every input; the cotangent is all ones, which costs the kernels what any other does).
fn time_op(
    iters: usize,
    inputs: &[Var],
    op: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(f64, f64)> {
    let xs: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    let fwd = median_ms(iters, || op(&xs).map(|_| ()))?;
    let both = median_ms(iters, || {
        let y = op(&xs)?;
        let g = y.sum_all()?.backward()?;
        std::hint::black_box(g);
        Ok(())
    })?;
    Ok((fwd, both))
}

type OpFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;

/// One row of the table: a name, its inputs and the fused and composite versions.
struct Case {
    name: &'static str,
    inputs: Vec<Var>,
    fused: OpFn,
    composite: OpFn,
}

fn cases(s: &Shapes, dev: &Device) -> Result<Vec<Case>> {
    let (n, c) = (s.b * s.t, s.c);
    let randn = |shape: &[usize], std: f64| Var::randn(0f32, std as f32, shape, dev);
    // The MLP's up-projection `c -> 4c`: x, W and b.
    let up_proj = || -> Result<Vec<Var>> {
        Ok(vec![
            randn(&[n, c], 1.0)?,
            randn(&[c, 4 * c], 0.02)?,
            randn(&[4 * c], 0.02)?,
        ])
    };
    let h = s.h;
    let targets = Tensor::rand(0f32, s.v as f32, n, dev)?
        .floor()?
        .to_dtype(DType::U32)?;
    let t2 = targets.clone();
    Ok(vec![
        Case {
            name: "attention (causal, qkv)",
            inputs: vec![randn(&[s.b, s.t, 3 * c], 1.0)?],
            fused: Box::new(move |x| attention_qkv(&x[0], h, &AttentionConfig::causal())),
            composite: Box::new(move |x| {
                attention_qkv_composite(&x[0], h, &AttentionConfig::causal())
            }),
        },
        Case {
            name: "layer_norm",
            inputs: vec![randn(&[n, c], 1.0)?, randn(&[c], 1.0)?, randn(&[c], 1.0)?],
            fused: Box::new(|x| norm::layer_norm(&x[0], &x[1], Some(&x[2]), 1e-5)),
            composite: Box::new(|x| norm::layer_norm_composite(&x[0], &x[1], Some(&x[2]), 1e-5)),
        },
        Case {
            name: "bias_gelu",
            inputs: vec![randn(&[n, 4 * c], 1.0)?, randn(&[4 * c], 1.0)?],
            fused: Box::new(|x| gelu::bias_gelu(&x[0], Some(&x[1]))),
            composite: Box::new(|x| gelu::bias_gelu_composite(&x[0], Some(&x[1]))),
        },
        Case {
            name: "linear c -> 4c",
            inputs: up_proj()?,
            fused: Box::new(|x| linear::linear(&x[0], &x[1], Some(&x[2]))),
            composite: Box::new(|x| linear::linear_composite(&x[0], &x[1], Some(&x[2]))),
        },
        Case {
            name: "linear_gelu c -> 4c",
            inputs: up_proj()?,
            fused: Box::new(|x| linear_gelu::linear_gelu(&x[0], &x[1], Some(&x[2]))),
            composite: Box::new(|x| {
                gelu::bias_gelu_composite(
                    &linear::linear_composite(&x[0], &x[1], None)?,
                    Some(&x[2]),
                )
            }),
        },
        Case {
            name: "cross_entropy",
            inputs: vec![randn(&[n, s.v], 1.0)?],
            fused: Box::new(move |x| cross_entropy::cross_entropy(&x[0], &targets, None, None)),
            composite: Box::new(move |x| {
                cross_entropy::cross_entropy_composite(&x[0], &t2, None, None)
            }),
        },
    ])
}

/// SmolLM2-135M's shapes (batch 4, T 256, 9 heads of 64, MLP width 1536): RoPE on q (a view of
/// the `[B, T, 9 x 64]` projection) and SwiGLU on the two halves of one `[B T, 2 x 1536]`
/// projection.
fn llama_cases(dev: &Device) -> Result<(String, Vec<Case>)> {
    let (b, t, h, d, i) = (4, 256, 9, 64, 1536);
    let pos = Tensor::arange(0u32, t as u32, dev)?;
    let inv: Vec<f32> = (0..d / 2)
        .map(|k| 1.0 / 100_000f32.powf(2.0 * k as f32 / d as f32))
        .collect();
    let (cos, sin) = rope::rope_tables(&pos, &Tensor::new(inv, dev)?)?;
    let (c2, s2) = (cos.clone(), sin.clone());
    let q = move |x: &Tensor| x.reshape((b, t, h, d));
    let halves =
        move |x: &Tensor| Ok::<_, candle_core::Error>((x.narrow(1, 0, i)?, x.narrow(1, i, i)?));
    let cases = vec![
        Case {
            name: "rope (q, 9 x 64)",
            inputs: vec![Var::randn(0f32, 1.0, (b, t, h * d), dev)?],
            fused: Box::new(move |x| rope::rope(&q(&x[0])?, &cos, &sin)),
            composite: Box::new(move |x| rope::rope_composite(&q(&x[0])?, &c2, &s2)),
        },
        Case {
            name: "swiglu (packed 2 x 1536)",
            inputs: vec![Var::randn(0f32, 1.0, (b * t, 2 * i), dev)?],
            fused: Box::new(move |x| halves(&x[0]).and_then(|(g, u)| swiglu::swiglu(&g, &u))),
            composite: Box::new(move |x| {
                halves(&x[0]).and_then(|(g, u)| swiglu::swiglu_composite(&g, &u))
            }),
        },
    ];
    Ok((format!("SmolLM2-135M, T {t}, B {b}"), cases))
}

/// SmolLM2-135M's head: `x [B * T, C]` against the tied embedding `[V, C]`, f32.
const HEAD: (usize, usize, usize) = (4 * 256, 576, 49152);

/// The `linear_cross_entropy` table: forward + backward (gradients of x and w) of the fused op
/// at its default chunk and at 8 MiB chunks, and of the composite: median time and peak heap,
/// and the peak heap of a forward alone on detached inputs.
fn lm_head(iters: usize, dev: &Device) -> Result<()> {
    let (n, c, v) = HEAD;
    let x = Var::randn(0f32, 1.0, (n, c), dev)?;
    let w = Var::randn(0f32, 0.02, (v, c), dev)?;
    let t = Tensor::rand(0f32, v as f32, n, dev)?
        .floor()?
        .to_dtype(DType::U32)?;
    let iters = iters.min(5);
    println!(
        "\nSmolLM2-135M head: N = 4 x 256 = {n} rows, C = {c}, V = {v}, f32 (logits {:.0} MiB); \
         median of {iters} after 1 warm-up",
        (n * v * 4) as f64 / (1 << 20) as f64
    );
    println!(
        "| linear_cross_entropy | fwd+bwd (ms) | peak heap fwd+bwd (MiB) | peak heap fwd, detached (MiB) |"
    );
    println!("|---|---|---|---|");
    let default = linear_cross_entropy::default_chunk_rows(v, c);
    let small = linear_cross_entropy::CHUNK_BYTES / (4 * v);
    let rows: [(String, Option<usize>); 3] = [
        (
            format!("fused, default chunk ({default} rows)"),
            Some(default),
        ),
        (format!("fused, 8 MiB chunk ({small} rows)"), Some(small)),
        ("composite".into(), None),
    ];
    for (name, chunk) in rows {
        let loss = |xt: &Tensor, wt: &Tensor| match chunk {
            Some(k) => linear_cross_entropy::linear_cross_entropy_chunked(xt, wt, &t, None, k),
            None => linear_cross_entropy::linear_cross_entropy_composite(xt, wt, &t, None),
        };
        let step = || -> Result<()> {
            std::hint::black_box(loss(x.as_tensor(), w.as_tensor())?.backward()?);
            Ok(())
        };
        step()?;
        let base = alloc::reset_peak();
        std::hint::black_box(loss(&x.as_tensor().detach(), &w.as_tensor().detach())?);
        let fwd_peak = (alloc::peak_bytes() - base) as f64 / (1 << 20) as f64;
        let base = alloc::reset_peak();
        let mut ts = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t0 = Instant::now();
            step()?;
            ts.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let peak = (alloc::peak_bytes() - base) as f64 / (1 << 20) as f64;
        ts.sort_by(f64::total_cmp);
        println!(
            "| {name} | {:.0} | {peak:.0} | {fwd_peak:.0} |",
            ts[ts.len() / 2]
        );
    }
    Ok(())
}

/// Attention at a Llama-family shape: grouped-query heads (`kv` kv heads), causal, optional
/// sliding window.
struct LlamaAttention {
    name: &'static str,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
    window: Option<usize>,
}

/// SmolLM2-135M's attention (9 query heads over 3 kv heads, head dim 64) at T 256, and at
/// T 1024 causal and with a sliding window of 128: a block of 32 query rows then reads at most
/// 159 keys instead of up to 1024: 28% of the causal score tiles (the rest are skipped, not
/// masked).
const LLAMA_ATTENTION: [LlamaAttention; 3] = [
    LlamaAttention {
        name: "attention GQA (SmolLM2-135M: B 4, T 256, H 9, KV 3, D 64), causal",
        b: 4,
        t: 256,
        h: 9,
        kv: 3,
        d: 64,
        window: None,
    },
    LlamaAttention {
        name: "attention GQA (B 1, T 1024, H 9, KV 3, D 64), causal",
        b: 1,
        t: 1024,
        h: 9,
        kv: 3,
        d: 64,
        window: None,
    },
    LlamaAttention {
        name: "attention GQA (B 1, T 1024, H 9, KV 3, D 64), window 128",
        b: 1,
        t: 1024,
        h: 9,
        kv: 3,
        d: 64,
        window: Some(128),
    },
];

/// The attention cases at Llama-family shapes ([`LLAMA_ATTENTION`]): [`attention_merged`]
/// against [`attention_merged_composite`] (K / V repeated, masks added, softmax).
fn llama_attention_cases(dev: &Device) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for a in LLAMA_ATTENTION {
        let randn = |heads: usize| Var::randn(0f32, 1f32, (a.b, heads, a.t, a.d), dev);
        let mut cfg = AttentionConfig::causal();
        cfg.window = a.window;
        let c2 = cfg.clone();
        out.push(Case {
            name: a.name,
            inputs: vec![randn(a.h)?, randn(a.kv)?, randn(a.kv)?],
            fused: Box::new(move |x| attention_merged(&x[0], &x[1], &x[2], &cfg)),
            composite: Box::new(move |x| attention_merged_composite(&x[0], &x[1], &x[2], &c2)),
        });
    }
    Ok(out)
}

/// SmolLM2-135M's projections with a LoRA adapter: `x [4 x 256, 576]` through the frozen
/// `w.t()` of a `[out, in]` weight (576 -> 576, attention; 576 -> 1536, the MLP's up / gate),
/// rank 16, scale 2, f32 and bf16, and 576 -> 576 with dropout 0.1: [`lora::lora_linear`]
/// against [`lora::lora_linear_composite`] with the same frozen `w` (gradients of x, A and B).
fn lora_cases(dev: &Device) -> Result<Vec<Case>> {
    let (n, c, r) = (4 * 256, 576, 16);
    let rows: [(&'static str, usize, DType, f32); 5] = [
        ("lora_linear 576 -> 576, f32", c, DType::F32, 0.0),
        ("lora_linear 576 -> 1536, f32", 1536, DType::F32, 0.0),
        ("lora_linear 576 -> 576, bf16", c, DType::BF16, 0.0),
        ("lora_linear 576 -> 1536, bf16", 1536, DType::BF16, 0.0),
        (
            "lora_linear 576 -> 576, f32, dropout 0.1",
            c,
            DType::F32,
            0.1,
        ),
    ];
    let mut out = Vec::new();
    for (name, n_out, dt, p) in rows {
        let randn = |shape: &[usize], std: f32| -> Result<Tensor> {
            Tensor::randn(0f32, std, shape, dev)?.to_dtype(dt)
        };
        let w = randn(&[n_out, c], 0.02)?;
        let (w2, drop) = (
            w.clone(),
            (p > 0.0).then_some((p, candle_fused::RngKey::new(1, 0))),
        );
        out.push(Case {
            name,
            inputs: vec![
                Var::from_tensor(&randn(&[n, c], 1.0)?)?,
                Var::from_tensor(&randn(&[r, c], 0.02)?)?,
                Var::from_tensor(&randn(&[n_out, r], 0.02)?)?,
            ],
            fused: Box::new(move |x| {
                lora::lora_linear(&x[0], &w.t()?, None, &x[1], &x[2], 2.0, drop)
            }),
            composite: Box::new(move |x| {
                lora::lora_linear_composite(&x[0], &w2.t()?, None, &x[1], &x[2], 2.0, drop)
            }),
        });
    }
    Ok(out)
}

/// Keeps freed blocks of up to 64 MiB in the heap instead of returning them to the OS (glibc).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes allocator parameters; called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

fn main() -> Result<()> {
    keep_freed_memory();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut iters = 30;
    let mut filters = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bench" => {}
            "--iters" => {
                iters = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| candle_core::Error::Msg("--iters needs a number".into()))?;
            }
            f => filters.push(f.to_string()),
        }
    }
    let dev = Device::Cpu;
    println!(
        "candle-fused ops, CPU, work split {} ways on Candle's pool of {} threads, median of {iters} after 5 warm-up (ms)",
        rayon::current_num_threads(),
        candle_core::utils::barrier_pool().n_workers() + 1
    );
    let mut tables = Vec::new();
    for s in &MODELS {
        tables.push((s.name.to_string(), cases(s, &dev)?));
    }
    tables.push(llama_cases(&dev)?);
    tables.push((
        "LoRA linear at SmolLM2-135M's projections (N 1024, r 16, W frozen)".to_string(),
        lora_cases(&dev)?,
    ));
    tables.push((
        "attention at Llama-family shapes (attention_merged, f32)".to_string(),
        llama_attention_cases(&dev)?,
    ));
    let wanted =
        |c: &Case| filters.is_empty() || filters.iter().any(|f| c.name.contains(f.as_str()));
    for (name, cases) in tables {
        if !cases.iter().any(wanted) {
            continue;
        }
        println!("\n{name}");
        println!(
            "| op | fused fwd | fused fwd+bwd | composite fwd | composite fwd+bwd | speed-up fwd+bwd |"
        );
        println!("|---|---|---|---|---|---|");
        for case in cases.iter().filter(|c| wanted(c)) {
            let (ff, fb) = time_op(iters, &case.inputs, &case.fused)?;
            let (cf, cb) = time_op(iters, &case.inputs, &case.composite)?;
            println!(
                "| {} | {ff:.3} | {fb:.3} | {cf:.3} | {cb:.3} | {:.2}x |",
                case.name,
                cb / fb
            );
        }
    }
    if filters.is_empty()
        || filters
            .iter()
            .any(|f| "linear_cross_entropy".contains(f.as_str()))
    {
        lm_head(iters, &dev)?;
    }
    Ok(())
}
