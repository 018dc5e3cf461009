//! Mixed-precision bench: a small GPT trained in f32, f16 + amp, bf16 + amp and pure f16 on
//! the same data from the same seed. Each mode runs in a child process (this binary
//! re-executed) so that dhat's peak-heap figure is per mode.
//!
//! `cargo bench -p candle-amp --bench amp` (env: AMP_BENCH_STEPS, AMP_BENCH_DATA).

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

mod common;

use std::path::PathBuf;
use std::process::Command;

use candle_core::Device;
use common::{train, Data, GptConfig, Mode, TrainConfig};

const PROFILED_STEPS: u64 = 3;

fn config(data: &Data) -> TrainConfig {
    let steps = std::env::var("AMP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    TrainConfig {
        gpt: GptConfig {
            vocab: data.vocab,
            block: 64,
            n_embd: 64,
            n_head: 4,
            n_layer: 2,
        },
        batch: 8,
        steps,
        lr: 3e-3,
        clip: 1.0,
        seed: 42,
        eval_batches: 8,
        warmup: PROFILED_STEPS,
    }
}

fn data_path() -> PathBuf {
    std::env::var("AMP_BENCH_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt")
        })
}

/// Runs one mode and prints a `RESULT` line for the parent.
fn child(mode: Mode) -> anyhow::Result<()> {
    let mut profiler = Some(
        dhat::Profiler::builder()
            .testing()
            .trim_backtraces(Some(4))
            .build(),
    );
    let mut peak = 0usize;
    let data = Data::load(&data_path());
    let tc = config(&data);
    let dev = Device::Cpu;
    let r = train(mode, &tc, &data, &dev, |i, loss, outcome| {
        if i + 1 == PROFILED_STEPS {
            peak = dhat::HeapStats::get().max_bytes;
            profiler.take();
        }
        if i % 50 == 0 || outcome.is_some_and(|o| o.is_skipped()) {
            eprintln!(
                "  [{}] step {i:4} loss {loss:.4} {:?}",
                mode.name(),
                outcome.map(|o| o.next_scale())
            );
        }
    })?;
    if profiler.is_some() {
        peak = dhat::HeapStats::get().max_bytes;
        profiler.take();
    }
    let n = r.losses.len();
    let tail = &r.losses[n.saturating_sub(10)..];
    let train_tail = tail.iter().sum::<f32>() / tail.len() as f32;
    println!(
        "RESULT|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}",
        mode.name(),
        r.eval_loss,
        train_tail,
        r.step_time.as_secs_f64() * 1e3,
        r.check_time.as_secs_f64() * 1e3,
        peak,
        r.skipped,
        r.final_scale,
        r.first_nonfinite.map_or("-".into(), |s| s.to_string()),
        n,
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if let Ok(m) = std::env::var("AMP_BENCH_CHILD") {
        let mode = Mode::parse(&m).ok_or_else(|| anyhow::anyhow!("unknown mode {m}"))?;
        return child(mode);
    }
    let data = Data::load(&data_path());
    let tc = config(&data);
    println!(
        "data: {}; GPT {:?}; batch {}, steps {}, AdamW lr {}, seed {}",
        data.source, tc.gpt, tc.batch, tc.steps, tc.lr, tc.seed
    );
    println!("threads: {}", candle_core::utils::get_num_threads());
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for mode in Mode::ALL {
        let out = Command::new(&exe)
            .env("AMP_BENCH_CHILD", mode.name())
            .output()?;
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find(|l| l.starts_with("RESULT|"))
            .ok_or_else(|| anyhow::anyhow!("{}: no result (status {})", mode.name(), out.status))?;
        let f: Vec<String> = line.split('|').skip(1).map(String::from).collect();
        rows.push(f);
    }
    let f32_eval: f64 = rows[0][1].parse()?;
    println!();
    println!("| mode | eval loss (f32 eval) | ratio to f32 | train loss (last 10) | step time | check time / step | check overhead | peak heap | skipped steps | final scale | first non-finite loss | steps run |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for f in &rows {
        let eval: f64 = f[1].parse()?;
        let step_ms: f64 = f[3].parse()?;
        let check_ms: f64 = f[4].parse()?;
        let peak: f64 = f[5].parse()?;
        let overhead = if check_ms > 0.0 {
            format!("{:.2}%", 100.0 * check_ms / step_ms)
        } else {
            "-".into()
        };
        let check = if check_ms > 0.0 {
            format!("{check_ms:.3} ms")
        } else {
            "-".into()
        };
        println!(
            "| {} | {:.4} | {:.4} | {:.4} | {:.1} ms | {} | {} | {:.1} MiB | {} | {} | {} | {} |",
            f[0],
            eval,
            eval / f32_eval,
            f[2].parse::<f64>()?,
            step_ms,
            check,
            overhead,
            peak / (1024.0 * 1024.0),
            f[6],
            f[7],
            f[8],
            f[9],
        );
    }
    println!();
    for f in rows.iter().filter(|f| f[0].contains("amp")) {
        let eval: f64 = f[1].parse()?;
        let r = eval / f32_eval;
        let step_ms: f64 = f[3].parse()?;
        let check_ms: f64 = f[4].parse()?;
        println!(
            "{}: within 2% of f32: {} (ratio {r:.4}); check overhead < 3%: {} ({:.2}%)",
            f[0],
            (r - 1.0).abs() < 0.02,
            check_ms / step_ms < 0.03,
            100.0 * check_ms / step_ms
        );
    }
    let pure = rows
        .iter()
        .find(|f| f[0] == Mode::PureF16.name())
        .ok_or_else(|| anyhow::anyhow!("no pure f16 row"))?;
    println!(
        "pure f16 diverged: {} (first non-finite loss at step {}, eval loss {})",
        pure[1] == "NaN" || pure[8] != "-",
        pure[8],
        pure[1]
    );
    Ok(())
}
