//! Pipeline bench on CPU: an 8-block GPT-like stack, 1 stage vs 2 stages (one thread each).
//!
//! Run: `flock /work/targets/bench.lock cargo bench -p candle-pipeline --bench pipeline`
//! Environment: `BENCH_STEPS` (timed steps per configuration, default 3). The bench sets
//! `CANDLE_NUM_THREADS=1` (unless set) so Candle's process-wide element-wise pool does not add
//! threads beyond the per-worker rayon pools.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_nn::loss::mse;
use candle_pipeline::{
    simulate, Costs, Layer, LossReduction, Microbatches, Pipeline, Schedule, Sequential, Stage,
};
use test_support::alloc::{self, CountingAlloc};
use test_support::random::{rng, uniform, var, ChaCha8Rng};

/// Counts live heap bytes and their peak (reset between measurements).
#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const D_MODEL: usize = 128;
const HEADS: usize = 4;
const SEQ: usize = 64;
const BATCH: usize = 16;
const BLOCKS: usize = 8;

fn param(rng: &mut ChaCha8Rng, shape: &[usize], scale: f32, dev: &Device) -> Var {
    var(&uniform(rng, shape, -scale, scale, dev))
}

/// Layer norm from differentiable ops (the fused candle-nn one has no backward).
fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mu = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mu)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(g)?
        .broadcast_add(b)
}

/// One pre-norm transformer block: causal self-attention and a GELU MLP.
fn block(rng: &mut ChaCha8Rng, mask: &Tensor, dev: &Device) -> Result<Layer> {
    let d = D_MODEL;
    let s = 1.0 / (d as f32).sqrt();
    let g1 = Var::from_tensor(&Tensor::ones(d, DType::F32, dev)?)?;
    let b1 = Var::from_tensor(&Tensor::zeros(d, DType::F32, dev)?)?;
    let g2 = Var::from_tensor(&Tensor::ones(d, DType::F32, dev)?)?;
    let b2 = Var::from_tensor(&Tensor::zeros(d, DType::F32, dev)?)?;
    let wqkv = param(rng, &[d, 3 * d], s, dev);
    let wo = param(rng, &[d, d], s, dev);
    let w1 = param(rng, &[d, 4 * d], s, dev);
    let w2 = param(rng, &[4 * d, d], s / 2.0, dev);
    let vars = vec![
        g1.clone(),
        b1.clone(),
        g2.clone(),
        b2.clone(),
        wqkv.clone(),
        wo.clone(),
        w1.clone(),
        w2.clone(),
    ];
    let mask = mask.clone();
    Ok(Layer::new(vars, move |x| {
        let (b, t, d) = x.dims3()?;
        let hd = d / HEADS;
        let h = layer_norm(x, &g1, &b1)?;
        let qkv = h.broadcast_matmul(&wqkv)?.reshape((b, t, 3, HEADS, hd))?;
        let head = |i: usize| {
            qkv.narrow(2, i, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        let att = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?.broadcast_add(&mask)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        let x = (x + y.broadcast_matmul(&wo)?)?;
        let h = layer_norm(&x, &g2, &b2)?;
        let h = h.broadcast_matmul(&w1)?.gelu()?.broadcast_matmul(&w2)?;
        x + h
    }))
}

fn model(dev: &Device) -> Result<Vec<Layer>> {
    let mut rng = rng(42);
    let mask: Vec<f32> = (0..SEQ * SEQ)
        .map(|i| if i % SEQ > i / SEQ { -1e9 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(mask, (SEQ, SEQ), dev)?;
    (0..BLOCKS).map(|_| block(&mut rng, &mask, dev)).collect()
}

fn cpu_seconds() -> f64 {
    // utime + stime of this process, in clock ticks (100 Hz on Linux).
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

struct Run {
    secs: f64,
    cpu_util: f64,
    bubble: f64,
    predicted: f64,
    peak_in_flight: Vec<usize>,
    peak_heap: usize,
    ascii: String,
    svg: String,
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    /// Per worker, over the timed steps: (time on a CPU, time runnable but waiting for a CPU),
    /// both as fractions of the worker's busy wall time. On an idle machine (1.0, 0.0); the
    /// rest of 1.0 is time blocked (locks, I/O) inside a busy span.
    cpu_over_busy: Vec<(f64, f64)>,
    /// Per worker, seconds on a CPU per step (mean over the timed steps).
    cpu_per_step: Vec<f64>,
}

/// Per worker, (seconds on a CPU, seconds runnable but waiting for a CPU) of the pool threads
/// named `pipeline-w{w}-*`, from Linux `/proc/self/task/*/schedstat`.
fn worker_sched(workers: usize) -> Vec<(f64, f64)> {
    let mut v = vec![(0.0, 0.0); workers];
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return v;
    };
    for e in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let (Some(a), Some(b)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let Some(w) = stat[a + 1..b]
            .strip_prefix("pipeline-w")
            .and_then(|r| r.split('-').next())
            .and_then(|w| w.parse::<usize>().ok())
            .filter(|w| *w < workers)
        else {
            continue;
        };
        let sched = std::fs::read_to_string(e.path().join("schedstat")).unwrap_or_default();
        let f: Vec<f64> = sched
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if f.len() >= 2 {
            v[w].0 += f[0] / 1e9;
            v[w].1 += f[1] / 1e9;
        }
    }
    v
}

fn run(
    pipe: &Pipeline,
    sched: &Schedule,
    batch: &Microbatches,
    steps: usize,
) -> anyhow::Result<Run> {
    pipe.step(sched, batch)?; // warm-up
    let base = alloc::current_bytes();
    let mut best: Option<Run> = None;
    let mut total = 0.0;
    let c0 = cpu_seconds();
    let w0 = worker_sched(sched.workers);
    let mut busy = vec![0.0; sched.workers];
    for _ in 0..steps {
        alloc::reset_peak();
        let t = Instant::now();
        let out = pipe.step(sched, batch)?;
        let secs = t.elapsed().as_secs_f64();
        total += secs;
        let peak_heap = alloc::peak_bytes().saturating_sub(base);
        for (b, x) in busy.iter_mut().zip(out.timeline.busy()) {
            *b += x;
        }
        let r = Run {
            secs,
            cpu_util: 0.0,
            bubble: out.timeline.bubble(),
            predicted: out.predicted(sched)?.bubble(),
            peak_in_flight: out.peak_in_flight.clone(),
            peak_heap,
            ascii: out.timeline.ascii(72),
            svg: out.timeline.svg(&format!(
                "{} S={} m={}",
                sched.name, sched.workers, sched.microbatches
            )),
            fwd: out.forward_time.clone(),
            bwd: out.backward_time.clone(),
            cpu_over_busy: vec![],
            cpu_per_step: vec![],
        };
        if best.as_ref().is_none_or(|b| r.secs < b.secs) {
            best = Some(r);
        }
    }
    let mut r = best.ok_or_else(|| anyhow::anyhow!("no steps"))?;
    r.cpu_util = (cpu_seconds() - c0) / total;
    let w1 = worker_sched(sched.workers);
    r.cpu_per_step = w1
        .iter()
        .zip(&w0)
        .map(|(a, b)| (a.0 - b.0) / steps as f64)
        .collect();
    r.cpu_over_busy = w1
        .into_iter()
        .zip(w0)
        .zip(busy)
        .map(|((a, b), busy)| ((a.0 - b.0) / busy, (a.1 - b.1) / busy))
        .collect();
    Ok(r)
}

/// Heap bytes one microbatch keeps alive on each stage between its forward and backward.
fn activation_bytes(stages: &[Sequential], x: &Tensor) -> anyhow::Result<Vec<f64>> {
    let mut out = vec![];
    let mut h = x.clone();
    for s in stages {
        let input = Var::from_tensor(&h)?;
        let before = alloc::current_bytes();
        let y = s.forward(input.as_tensor())?;
        let after = alloc::current_bytes();
        out.push(after.saturating_sub(before) as f64);
        h = y.detach();
        drop(y);
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let steps: usize = std::env::var("BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let probe = std::env::args().any(|a| a == "--probe");
    let dev = Device::Cpu;
    let layers = model(&dev)?;
    let mut rng = rng(7);
    let x = uniform(&mut rng, &[BATCH, SEQ, D_MODEL], -1.0, 1.0, &dev);
    let t = uniform(&mut rng, &[BATCH, SEQ, D_MODEL], -1.0, 1.0, &dev);
    let one: Vec<Box<dyn Stage>> = vec![Box::new(Sequential::new(layers.clone()))];
    let one = Pipeline::new(one, vec![dev.clone()], mse)?.with_cpu_threads(1)?;
    let halves = candle_pipeline::split_layers(
        layers.clone(),
        &candle_pipeline::balance_by_params(&layers, 2)?,
    )?;
    let two: Vec<Box<dyn Stage>> = halves
        .iter()
        .cloned()
        .map(|s| Box::new(s) as Box<dyn Stage>)
        .collect();
    let two = Pipeline::new(two, vec![dev.clone(); 2], mse)?.with_cpu_threads(1)?;
    if probe {
        // Child process: 1 stage on a 1-thread rayon pool with the environment it was given.
        let batch = Microbatches::split(&x, &t, 1, LossReduction::Mean)?;
        let r = run(&one, &Schedule::gpipe(1, 1)?, &batch, steps)?;
        println!("probe {:.3} {:.2}", r.secs, r.cpu_util);
        return Ok(());
    }
    // Does a 1-thread rayon pool bound a worker? Compare CPU time / wall time of the 1-stage
    // step with Candle's element-wise pool at 1 thread (this process) and at 2 threads (child).
    let child = std::process::Command::new(std::env::current_exe()?)
        .arg("--probe")
        .env("CANDLE_NUM_THREADS", "2")
        .output()?;
    let child = String::from_utf8_lossy(&child.stdout).to_string();
    println!(
        "# {BLOCKS} blocks, d_model {D_MODEL}, heads {HEADS}, seq {SEQ}, batch {BATCH}; {steps} timed steps (best shown); load avg: {}",
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
    );
    println!("| m | 1 stage s/step | cpu/wall | on-cpu + runqueue-wait | 2-stage schedule | s/step | cpu/wall | per worker: on-cpu + runqueue-wait, fraction of busy | speedup vs 1 stage same m | vs 1 stage m=1 | bubble measured | predicted (measured costs) | (S-1)/(m+S-1) | projected speedup, 1 free core per worker | peak in flight | peak heap MB | est. activations per stage MB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut base_m1 = None;
    let mut probe_line = None;
    let mut svgs = vec![];
    for m in [1usize, 2, 4, 8] {
        let batch = Microbatches::split(&x, &t, m, LossReduction::Mean)?;
        let r1 = run(&one, &Schedule::gpipe(1, m)?, &batch, steps)?;
        let b1 = *base_m1.get_or_insert(r1.secs);
        if m == 1 {
            probe_line = Some(format!(
                "1 stage, 1-thread rayon pool, m=1: CANDLE_NUM_THREADS=1: {:.3} s/step, cpu/wall {:.2}; CANDLE_NUM_THREADS=2 (child process, s/step cpu/wall): {}",
                r1.secs, r1.cpu_util, child.trim().trim_start_matches("probe ")
            ));
        }
        let act = activation_bytes(&halves, &x.narrow(0, 0, BATCH / m)?)?;
        for sched in [Schedule::gpipe(2, m)?, Schedule::one_f_one_b(2, m)?] {
            let r2 = run(&two, &sched, &batch, steps)?;
            let mut costs = Costs::uniform(2, 0.0, 0.0);
            costs.forward = r2.fwd.clone();
            costs.backward = r2.bwd.clone();
            costs.activation_bytes = act.clone();
            let pred = simulate(&sched, &costs)?;
            // If each worker had a core of its own: the step would take the busiest worker's
            // CPU time stretched by the predicted bubble (an estimate, not a measurement).
            let worst_cpu = r2.cpu_per_step.iter().cloned().fold(0.0, f64::max);
            let projected = r1.cpu_per_step[0] / (worst_cpu / (1.0 - pred.bubble()));
            let est: Vec<String> = pred
                .peak_activation_bytes
                .iter()
                .map(|b| format!("{:.1}", b / 1e6))
                .collect();
            println!(
                "| {m} | {:.3} | {:.2} | {:.2}+{:.2} | {} | {:.3} | {:.2} | {} | {:.2}x | {:.2}x | {:.1}% | {:.1}% | {:.1}% | {:.2}x | {:?} | {:.1} | {} |",
                r1.secs, r1.cpu_util, r1.cpu_over_busy[0].0, r1.cpu_over_busy[0].1, sched.name, r2.secs, r2.cpu_util,
                r2.cpu_over_busy
                    .iter()
                    .map(|(c, w)| format!("{c:.2}+{w:.2}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
                r1.secs / r2.secs, b1 / r2.secs,
                100.0 * r2.bubble, 100.0 * r2.predicted, 100.0 / (m as f64 + 1.0), projected,
                r2.peak_in_flight, r2.peak_heap as f64 / 1e6, est.join(" / ")
            );
            if m == 8 {
                svgs.push((sched.name.clone(), r2.ascii.clone(), r2.svg.clone()));
            }
        }
    }
    if let Some(p) = probe_line {
        println!("\n{p}");
    }
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    for (name, ascii, svg) in svgs {
        println!("\nmeasured timeline, {name}, S=2, m=8:\n{ascii}");
        let path = format!("{dir}/pipeline-bench-{name}-m8.svg");
        if std::fs::write(&path, svg).is_ok() {
            println!("SVG: {path}");
        }
    }
    Ok(())
}
