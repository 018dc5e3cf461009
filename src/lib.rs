//! `candle-train`: training transformers on [Candle](https://github.com/huggingface/candle).
//!
//! This root crate only re-exports the workspace members so that the top-level
//! `examples/` and `tests/` can use them together:
//!
//! - [`remat`]: activation checkpointing (`candle-remat`);
//! - [`amp`]: mixed precision with loss scaling (`candle-amp`);
//! - [`pipeline`]: pipeline parallelism (`candle-pipeline`);
//! - [`fused`]: fused differentiable transformer ops (`candle-fused`);
//! - [`trainer`]: models, data, optimiser, checkpoints and the `trainer` CLI.

pub use candle_amp as amp;
pub use candle_fused as fused;
pub use candle_pipeline as pipeline;
pub use candle_remat as remat;
pub use trainer;

// The workspace README's code blocks compile as doctests (`cargo test --doc -p candle-train`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}
