//! Model FLOPs utilisation: the FLOPs a step must do, counted as nanoGPT and llm.c count them,
//! over the FLOP/s the device can reach.
//!
//! Per token, a forward and backward pass of a transformer costs `6 N + 12 L H Q T` FLOPs
//! (PaLM appendix B; nanoGPT's `estimate_mfu`): `N` parameters excluding the position
//! embeddings (each weight does a multiply-add in the forward and two in the backward), plus
//! the attention's `Q Kᵀ` and `P V` products over a context of `T`, with `L` layers, `H` heads
//! of size `Q`; each architecture counts its own ([`ModelConfig::flops_per_token`]).
//! Recomputation (activation checkpointing) is not counted: MFU measures useful work.
//!
//! LoRA trains adapters over a frozen base: the base's weights get no gradient, so each costs
//! `4` FLOPs a token (forward, and the gradient of its input), not `6`; the adapters (and
//! `modules_to_save` copies) cost `6` ([`training_flops_per_token`]).
//!
//! The ceiling is the best the device has shown: a matmul measured at start-up (under whatever
//! load the machine had then), raised to any step's achieved rate ([`Ceiling`]), so MFU never
//! exceeds 100%; a `--peak-flops` the run exceeds is raised the same way, with a warning.

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

/// FLOPs of one training step's forward + backward over one token at context `seq_len`, for
/// the parameters that train: all of them (`lora: None`: [`flops_per_token`]), or LoRA's
/// `adapters` parameters (`lora_A` / `lora_B`) and `saved` parameters of `modules_to_save`
/// copies over a frozen base (`Some((adapters, saved))`): the frozen weights count `4`
/// FLOPs a token (no weight gradient), the trained ones `6`, attention as before.
///
/// ```
/// use trainer::model::gpt2::GptConfig;
/// let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 16, vocab_size: 10, ..GptConfig::default() };
/// let full = trainer::mfu::training_flops_per_token(&cfg, 16, None);
/// let attention = full - trainer::mfu::flops_per_token(&cfg, 0);
/// let lora = trainer::mfu::training_flops_per_token(&cfg, 16, Some((100, 0)));
/// assert!((lora - ((full - attention) * 4.0 / 6.0 + attention + 600.0)).abs() < 1e-6);
/// ```
pub fn training_flops_per_token(
    cfg: &dyn ModelConfig,
    seq_len: usize,
    lora: Option<(usize, usize)>,
) -> f64 {
    let all = cfg.flops_per_token(seq_len);
    let Some((adapters, saved)) = lora else {
        return all;
    };
    // 6 N of the weights, the rest is attention (independent of N).
    let weights = cfg.flops_per_token(0);
    let attention = all - weights;
    // A saved module's trained copy replaces the frozen one in the forward pass.
    let frozen = (weights / 6.0 - saved as f64).max(0.0);
    4.0 * frozen + 6.0 * (adapters + saved) as f64 + attention
}

/// The FLOP/s MFU is measured against: the start-up measurement (or `--peak-flops`), raised to
/// any rate a step achieved, since the device has shown it can (a start-up measurement under
/// load reads low). MFU against it never exceeds 100%.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ceiling {
    /// The current ceiling, FLOP/s.
    pub flops: f64,
    /// Whether the start-up value was given (`--peak-flops`) rather than measured.
    pub given: bool,
    /// Whether a step's rate raised it.
    pub raised: bool,
}

impl Ceiling {
    /// A ceiling starting at `flops` FLOP/s.
    pub fn new(flops: f64, given: bool) -> Self {
        Ceiling {
            flops: flops.max(1.0),
            given,
            raised: false,
        }
    }

    /// The utilisation of `achieved` FLOP/s, raising the ceiling to it first if higher (once
    /// a warning, when the ceiling was given).
    pub fn utilisation(&mut self, achieved: f64) -> f64 {
        if achieved > self.flops && achieved.is_finite() {
            if self.given && !self.raised {
                tracing::warn!(
                    "a step reached {:.1} GFLOP/s, above --peak-flops {:.1} GFLOP/s: MFU is \
                     reported against the achieved rate",
                    achieved / 1e9,
                    self.flops / 1e9
                );
            }
            self.flops = achieved;
            self.raised = true;
        }
        achieved / self.flops
    }
}

/// The FLOP/s a large matmul reaches on `device` in `dtype`: the ceiling MFU is measured
/// against when no peak is given (on a CPU this is the honest peak: what Candle's GEMM reaches
/// with the threads it has). Best of ten 1024³ products after a warm-up; a machine under load
/// reads low, which [`Ceiling`] corrects as steps run.
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
