#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! * [`attention`]: causal self-attention, flash-style (online softmax over key blocks, saves
//!   the output and the log-sum-exp, recomputes scores in backward), mask and dropout,
//!   grouped-query heads, sliding windows and per-token document ids;
//! * [`norm`]: LayerNorm (optional bias) and RMSNorm, saving mean / rstd;
//! * [`gelu`]: bias add + tanh GELU (GPT-2's) in one op;
//! * [`geglu`]: `gelu_tanh(gate) * up` (Gemma's MLP activation) in one op;
//! * [`linear`]: `x W + b` in one op (one GEMM forward, two and a column sum backward; bf16
//!   GEMMs on AVX512-BF16 where the CPU has it);
//! * [`linear_gelu`]: `gelu(x W + b)` in one op (the MLP's up-projection, no graph node for
//!   the pre-activation);
//! * [`lora`]: the LoRA linear `x W + b + scale · (dropout(x) Aᵀ) Bᵀ` in one op, the base
//!   weight frozen (gradients of `x`, `A` and `B` only; saves `dropout(x) Aᵀ`, `[N, r]`);
//! * [`nf4`]: 4-bit NormalFloat weights as bitsandbytes quantizes, dequantizes and
//!   transformers saves them (double quantization included), bit for bit;
//! * [`qlora`]: the LoRA linear over a frozen NF4 base, dequantized a tile at a time
//!   (gradients of `x`, `A` and `B` only);
//! * [`rope`]: rotary position embeddings (transformers' split halves) fused with the
//!   `[B, T, H, D] -> [B, H, T, D]` transpose, and their f32 tables;
//! * [`swiglu`]: `silu(gate) * up` (Llama's MLP activation) in one op;
//! * [`cross_entropy`]: softmax cross-entropy over the vocabulary with mask / ignore index;
//! * [`linear_cross_entropy`]: the language-model head and its cross-entropy in one op, a chunk
//!   of rows at a time (no `[N, vocab]` logits);
//! * [`embedding`]: token embedding, its backward summed in f32 in a fixed order (the ids'
//!   order computed on the host);
//! * [`host`]: class targets with the caller's host copy, and the count of this crate's reads
//!   back to the host;
//! * [`dropout`]: dropout from the counter-based [`philox`] generator;
//! * [`adamw`]: fused in-place AdamW and the global gradient norm with one host sync;
//! * [`cast`]: f32 to and from bf16/f16 on the CPU threads, without a graph (mixed precision's
//!   master-weight and gradient casts);
//! * [`cuda_kernels`]: the switch of the ahead-of-time compiled Triton kernels
//!   (`kernels/*.cubin`, launched with the `cuda` feature after a launch check), on by default
//!   on compute capability 8.x and 9.0 (off with [`cuda_kernels::set_triton`]`(false)` /
//!   `CANDLE_FUSED_TRITON=0`), and the list of those not yet proven on a GPU.
//!
//! # Each op and its reference
//!
//! Every module exposes its op, `op(..)` (the fused kernel, differentiable), next to
//! `op_composite(..)`: the same function written with plain differentiable Candle ops, the
//! reference the op is tested against (and what a caller that wants the unfused computation,
//! e.g. for comparison or debugging, calls): [`linear::linear_composite`],
//! [`linear_gelu::linear_gelu_composite`], [`lora::lora_linear_composite`],
//! [`qlora::qlora_linear_composite`] (the whole 4-bit weight dequantized), [`norm::layer_norm_composite`],
//! [`norm::rms_norm_composite`], [`gelu::bias_gelu_composite`], [`gelu::gelu_composite`],
//! [`attention::attention_composite`], [`attention::attention_qkv_composite`],
//! [`rope::rope_composite`], [`swiglu::swiglu_composite`], [`geglu::geglu_composite`],
//! [`cross_entropy::cross_entropy_composite`],
//! [`linear_cross_entropy::linear_cross_entropy_composite`], [`embedding::embedding_composite`] (Candle's `index_select`),
//! [`dropout::dropout_composite`] (the
//! same Philox mask, drawn by the Triton kernel on CUDA when it is on, else on the host),
//! [`adamw::adamw_composite`] (returns the new tensors instead of updating in place),
//! [`adamw::sum_of_squares_composite`] and [`adamw::global_norm_composite`].
//!
//! Every op has a CPU kernel for f32, f64, bf16 and f16 (16-bit types accumulate in f32) and,
//! on devices without a kernel (Metal; CUDA unless the Triton kernels are switched on, see
//! [`cuda_kernels`]), computes the composite Candle expression inside the same op, so it works
//! everywhere with the same backward ([`with_composite_fallback`] takes that
//! path on the CPU too).
#![warn(missing_docs)]

pub mod adamw;
pub mod attention;
pub mod cast;
mod cpu;
pub mod cross_entropy;
pub mod cuda_kernels;
pub mod dropout;
pub mod embedding;
mod gated;
pub mod geglu;
pub mod gelu;
mod gemm_bf16;
pub mod host;
pub mod linear;
pub mod linear_add;
pub mod linear_cross_entropy;
pub mod linear_gelu;
pub mod lora;
pub mod nf4;
pub mod norm;
pub mod onednn;
mod op;
pub mod philox;
mod pool;
pub mod qlora;
pub mod rope;
pub mod swiglu;

pub use philox::RngKey;

/// Runs `f` with every op of this crate, on the calling thread, taking the path devices
/// without a kernel take (CUDA and Metal today) also on the CPU: the output computed by the
/// op's composite expression inside the op, the backward by composite ops. For testing a model
/// on that path without such a device (on CUDA it also keeps the Triton kernels off, see
/// [`cuda_kernels::set_triton`]). The previous setting comes back when `f` returns or
/// panics; other threads are not affected.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::{gelu::gelu, with_composite_fallback};
/// let x = Tensor::new(&[0.5f64, -1.0], &Device::Cpu)?;
/// let kernel = gelu(&x)?.to_vec1::<f64>()?;
/// let composite = with_composite_fallback(|| gelu(&x))?.to_vec1::<f64>()?;
/// assert!(kernel.iter().zip(&composite).all(|(a, b)| (a - b).abs() < 1e-15));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn with_composite_fallback<R>(f: impl FnOnce() -> R) -> R {
    cpu::with_fallback(f)
}
