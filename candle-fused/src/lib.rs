#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! * [`attention`]: causal self-attention, flash-style (online softmax over key blocks, saves
//!   the output and the log-sum-exp, recomputes scores in backward), mask and dropout;
//! * [`norm`]: LayerNorm (optional bias) and RMSNorm, saving mean / rstd;
//! * [`gelu`]: bias add + tanh GELU (GPT-2's) in one op;
//! * [`linear`]: `x W + b` in one op (one GEMM forward, two and a column sum backward);
//! * [`linear_gelu`]: `gelu(x W + b)` in one op (the MLP's up-projection, no graph node for
//!   the pre-activation);
//! * [`gemm_bf16`]: the bf16 GEMM `linear` runs on CPUs with AVX512-BF16;
//! * [`cross_entropy`]: softmax cross-entropy over the vocabulary with mask / ignore index;
//! * [`dropout`]: dropout from the counter-based [`philox`] generator;
//! * [`adamw`]: fused in-place AdamW and the global gradient norm with one host sync;
//! * [`cpu`]: what the CPU kernels share; [`pool`]: where they run in parallel (Candle's own
//!   CPU threads); [`fallback`]: the composite path for other devices.
//!
//! Every op has a CPU kernel for f32, f64, bf16 and f16 (16-bit types accumulate in f32) and,
//! on devices without a kernel yet, computes the composite Candle expression inside the same
//! op, so it works everywhere with the same backward.
#![warn(missing_docs)]

pub mod adamw;
pub mod attention;
pub mod cpu;
pub mod cross_entropy;
pub mod dropout;
pub mod fallback;
pub mod gelu;
pub mod gemm_bf16;
pub mod linear;
pub mod linear_gelu;
pub mod norm;
pub mod philox;
pub mod pool;

pub use philox::RngKey;
