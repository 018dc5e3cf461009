//! Measuring per-block costs for the planner.
//!
//! Memory is measured through a caller-supplied probe returning the bytes currently allocated
//! (for example `dhat::HeapStats::get().curr_bytes` on CPU, or a CUDA memory query), so this
//! stays device-generic and allocator-agnostic.

use crate::error::Result;
use crate::policy::{BlockCost, ChainCosts};
use candle_core::{Tensor, Var};
use std::time::Instant;

/// Runs each block of the chain `x -> f(0, x) -> f(1, ..)` once (plus one untimed warm-up run)
/// and records its activation bytes (growth of `live_bytes()` while its output and graph are
/// alive), its output bytes and its forward time. The block input is made a `Var` so the graph
/// is recorded as in training. `overhead_bytes` is left at 0.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let w = Var::randn(0f32, 0.3, (16, 16), &dev)?;
/// let x = Tensor::randn(0f32, 1.0, (8, 16), &dev)?;
/// // A probe that always returns 0 gives act_bytes = 0; plug in a real allocator counter.
/// let costs = candle_remat::measure_chain(&x, 3, &|| 0, |_, h| h.matmul(w.as_tensor())?.tanh())?;
/// assert_eq!(costs.blocks.len(), 3);
/// assert_eq!(costs.blocks[0].out_bytes, 8 * 16 * 4);
/// # Ok::<(), candle_remat::RematError>(())
/// ```
pub fn measure_chain<F>(
    x: &Tensor,
    n: usize,
    live_bytes: &dyn Fn() -> u64,
    f: F,
) -> Result<ChainCosts>
where
    F: Fn(usize, &Tensor) -> candle_core::Result<Tensor>,
{
    let input_bytes = (x.elem_count() * x.dtype().size_in_bytes()) as u64;
    let mut blocks = Vec::with_capacity(n);
    let mut h = x.detach();
    for i in 0..n {
        let leaf = Var::from_tensor(&h)?.into_inner();
        drop(f(i, &leaf)?);
        let before = live_bytes();
        let t0 = Instant::now();
        let y = f(i, &leaf)?;
        let fwd_ns = t0.elapsed().as_nanos() as u64;
        let after = live_bytes();
        let out_bytes = (y.elem_count() * y.dtype().size_in_bytes()) as u64;
        blocks.push(BlockCost {
            act_bytes: after.saturating_sub(before).max(out_bytes),
            out_bytes,
            fwd_ns,
        });
        h = y.detach();
    }
    Ok(ChainCosts {
        input_bytes,
        overhead_bytes: 0,
        blocks,
    })
}
