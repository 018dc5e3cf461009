//! `trainer`: train GPT-style transformers on Candle.
//!
//! The library behind the `trainer` CLI: a GPT-2 model with Hugging Face parameter names
//! ([`model`]), data sources ([`data`]), AdamW with owned state ([`optim`]), checkpoints that
//! resume bit-exactly ([`checkpoint`]) and the training loop ([`train`]).

#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod hub;
pub mod metrics;
pub mod mfu;
pub mod model;
pub mod optim;
pub mod plot;
pub mod pretrained;
pub mod run_dir;
pub mod runtime;
pub mod sample;
pub mod schedule;
pub mod train;

pub use error::{Error, Result};

// The README's code blocks compile as doctests (`cargo test --doc -p trainer`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}
