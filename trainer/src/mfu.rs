//! Model FLOPs utilisation: the FLOPs a step must do, counted as nanoGPT and llm.c count them,
//! over the FLOP/s the device can reach.
//!
//! Per token, a forward and backward pass of a transformer costs `6 N + 12 L H Q T` FLOPs
//! (PaLM appendix B; nanoGPT's `estimate_mfu`): `N` parameters excluding the position
//! embeddings (each weight does a multiply-add in the forward and two in the backward), plus
//! the attention's `Q Kᵀ` and `P V` products over a context of `T`, with `L` layers, `H` heads
//! of size `Q`; each architecture counts its own ([`ModelConfig::flops_per_token`]).
//! Recomputation (activation checkpointing) is not counted: MFU measures useful work.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::model::ModelConfig;

/// FLOPs of one forward + backward pass over one token, at context length `seq_len`
/// (each architecture counts its own: [`ModelConfig::flops_per_token`]).
///
/// ```
/// use trainer::model::gpt2::GptConfig;
/// // GPT-2 small at T = 1024: the 124M model, ~0.855 GFLOPs per token (nanoGPT's figure).
/// let cfg = GptConfig { n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024, vocab_size: 50257, ..GptConfig::default() };
/// let f = trainer::mfu::flops_per_token(&cfg, 1024);
/// assert!((f / 1e9 - 0.8552).abs() < 1e-3, "{f}");
/// ```
pub fn flops_per_token(cfg: &dyn ModelConfig, seq_len: usize) -> f64 {
    cfg.flops_per_token(seq_len)
}

/// The FLOP/s a large matmul reaches on `device` in `dtype`: the ceiling MFU is measured
/// against when no peak is given (on a CPU this is the honest peak: what Candle's GEMM reaches
/// with the threads it has). Best of ten 1024³ products after a warm-up.
pub fn measure_matmul_flops(device: &Device, dtype: DType) -> candle_core::Result<f64> {
    let n = 1024;
    let a = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let mut best = f64::INFINITY;
    for i in 0..11 {
        let start = Instant::now();
        let c = a.matmul(&b)?;
        // Reading one element waits for the device.
        c.narrow(0, 0, 1)?
            .narrow(1, 0, 1)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if i > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (n * n * n) as f64 / best)
}

/// Model FLOPs utilisation of a step that processed `tokens` tokens of context `seq_len` in
/// `secs`, against `peak` FLOP/s.
pub fn mfu(cfg: &dyn ModelConfig, seq_len: usize, tokens: u64, secs: f64, peak: f64) -> f64 {
    flops_per_token(cfg, seq_len) * tokens as f64 / secs.max(1e-12) / peak.max(1.0)
}
