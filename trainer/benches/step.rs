//! Training-step benchmark: step time, tokens/s and peak heap for a GPT config.
//!
//! ```text
//! cargo bench -p trainer --bench step -- --n-layer 4 --n-head 4 --n-embd 128 \
//!     --block-size 64 --batch-size 12 --vocab-size 65
//! ```
//!
//! Heap is counted by `dhat`'s global allocator (every allocation, including Candle's CPU
//! tensor buffers); "peak" is the highest live heap seen, "peak - base" subtracts what was live
//! before the first step (data, weights), leaving activations, gradients and optimiser state.

use std::time::Instant;

use candle_core::{Device, Tensor};
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trainer::model::{cross_entropy, Ctx, Gpt, GptConfig};
use trainer::optim::{clip_grad_norm, AdamW, AdamWConfig};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    #[arg(long, default_value_t = 12)]
    batch_size: usize,
    #[arg(long, default_value_t = 65)]
    vocab_size: usize,
    #[arg(long, default_value_t = 0.0)]
    dropout: f32,
    /// Timed steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let profiler = dhat::Profiler::builder().testing().build();
    let dev = Device::Cpu;
    let cfg = GptConfig {
        n_layer: args.n_layer,
        n_head: args.n_head,
        n_embd: args.n_embd,
        block_size: args.block_size,
        vocab_size: args.vocab_size,
        dropout: args.dropout,
        bias: true,
    };
    let (model, params) = Gpt::new(&cfg, 1, &dev)?;
    let vars = params.vars();
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let (b, t) = (args.batch_size, args.block_size);
    let mut batch = || -> candle_core::Result<(Tensor, Tensor)> {
        let ids: Vec<u32> = (0..b * (t + 1))
            .map(|_| rng.random_range(0..cfg.vocab_size as u32))
            .collect();
        let all = Tensor::from_vec(ids, (b, t + 1), &dev)?;
        Ok((all.narrow(1, 0, t)?, all.narrow(1, 1, t)?))
    };
    let base = dhat::HeapStats::get().curr_bytes;
    let mut times = Vec::new();
    for step in 0..args.steps + 2 {
        let (x, y) = batch()?;
        let start = Instant::now();
        let logits = model.forward(&x, &Ctx::train(step as u64))?;
        let loss = cross_entropy(&logits, &y, None)?;
        let mut grads = loss.backward()?;
        clip_grad_norm(&mut grads, &vars, 1.0)?;
        opt.apply(&grads)?;
        let _ = loss.to_scalar::<f32>()?;
        if step >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let stats = dhat::HeapStats::get();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let tokens = (b * t) as f64;
    println!(
        "config: n_layer {} n_head {} n_embd {} block {} batch {} vocab {} | {:.2}M params | threads {}",
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        b,
        cfg.vocab_size,
        params.num_elements() as f64 / 1e6,
        candle_core::utils::get_num_threads()
    );
    println!("| step (median) | step (mean) | tokens/s | peak heap | peak - base |");
    println!("|---|---|---|---|---|");
    println!(
        "| {:.1} ms | {:.1} ms | {:.0} | {:.1} MiB | {:.1} MiB |",
        median * 1e3,
        mean * 1e3,
        tokens / median,
        mib(stats.max_bytes),
        mib(stats.max_bytes.saturating_sub(base)),
    );
    std::mem::forget(profiler);
    Ok(())
}
