//! `qlora_linear` on the CPU holds what `lora_linear` holds over the same weight in bf16: after
//! the forward (what a model's graph keeps per layer until its backward) no more heap bytes
//! than the bf16 LoRA op (the output and the saved `h`), and at its peak over forward and
//! backward no more than the bf16 LoRA op's peak plus one tile's working set (the tile
//! dequantized in the dtype, its `[N, tile rows]` f32 product, and the f32 absmaxes). The weight
//! itself is allocated before the measurement on both sides. Counted by the test-support
//! allocator (process-wide, so this binary has one test).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::lora::lora_linear;
use candle_fused::nf4::Nf4Weight;
use candle_fused::qlora::{qlora_linear, TILE_ELEMS};
use test_support::alloc::{self, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// `(held after the forward, peak over forward and backward)` in bytes above the start.
fn measure(f: impl Fn() -> candle_core::Result<Tensor>) -> Result<(usize, usize)> {
    let start = alloc::reset_peak();
    let y = f()?;
    let held = alloc::current_bytes().saturating_sub(start);
    let grads = y.sum_all()?.backward()?;
    drop((grads, y));
    Ok((held, alloc::peak_bytes().saturating_sub(start)))
}

#[test]
fn qlora_holds_what_bf16_lora_holds() -> Result<()> {
    let dev = Device::Cpu;
    let (rows, n_in, n_out, r) = (64, 4096, 2048, 8);
    let w32 = Tensor::randn(0f32, 0.05, (n_out, n_in), &dev)?;
    let q = Nf4Weight::quantize(&w32, false)?;
    let wd = q.dequantize(DType::BF16)?;
    let bf = |t: Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::BF16)?)?) };
    let x = bf(Tensor::randn(0f32, 1.0, (2, rows / 2, n_in), &dev)?)?;
    let a = bf(Tensor::randn(0f32, 0.05, (r, n_in), &dev)?)?;
    let b = bf(Tensor::randn(0f32, 0.05, (n_out, r), &dev)?)?;
    let lora = || lora_linear(&x, &wd.t()?, None, &a, &b, 2.0, None);
    let qlora = || qlora_linear(&x, &q, None, &a, &b, 2.0, None);
    // warm-up: the thread pool and lazily built tables allocate once
    measure(lora)?;
    measure(qlora)?;
    let (held_l, peak_l) = measure(lora)?;
    let (held_q, peak_q) = measure(qlora)?;
    let tile_rows = TILE_ELEMS / n_in;
    assert!(tile_rows < n_out, "the weight spans several tiles");
    let working_set = TILE_ELEMS * 2 + rows * tile_rows * 4 + n_out * n_in / 64 * 4;
    // the 4-bit op holds the Nf4Weight's handles and nothing of the weight's size
    assert!(
        held_q <= held_l + 4096,
        "qlora holds {held_q} B after the forward, bf16 lora {held_l} B"
    );
    assert!(
        peak_q <= peak_l + working_set,
        "qlora peaks at {peak_q} B, bf16 lora at {peak_l} B (+ {working_set} B of one tile)"
    );
    Ok(())
}
