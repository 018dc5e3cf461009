//! `trainer`: train transformers on Candle.
//!
//! The library behind the `trainer` CLI: models behind one interface, with Hugging Face
//! parameter names ([`model`]; GPT-2 is [`model::gpt2`]), data sources ([`data`]), optimisers
//! with owned, named state ([`optim`]: AdamW the default), checkpoints that resume bit-exactly ([`checkpoint`]) and the
//! training loop ([`train`]).
//!
//! From `main` to the optimiser update: `main` -> `cli::run` builds a [`train::Trainer`]
//! (`train/mod.rs`: data, model, executor, scaler) and calls `Trainer::run` (`train/run.rs`:
//! the loop, evaluation, checkpoints), which calls `Trainer::train_step` (`train/step.rs`:
//! micro-batches through [`train::Executor`], the data-parallel reduction, candle-amp's step
//! applying the [`optim::Optimizer`], [`optim::AdamW`] by default).
//!
//! A program builds its own run with [`train::Trainer::builder`] (its data or batch iterator,
//! model, LoRA, optimiser; a run directory only if it wants one). The `cli` feature (on by
//! default) is the `trainer` binary's: clap, indicatif, ctrlc and tracing-subscriber; a
//! library-only dependency turns it off with `default-features = false`.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
mod error;
pub mod metrics;
pub mod mfu;
pub mod objective;
pub mod optim;
pub mod plot;
pub mod pretrained;
pub mod run_dir;
pub mod runtime;
pub mod sample;
pub(crate) mod schedule;
pub mod tensorboard;
pub mod train;

pub use error::{Error, Result};

// The data crate, where the data sources, the shared file writers and the host-device transfer
// points live (`trainer::data`, `trainer::io`, `trainer::transfer`, as before the split).
pub use candle_data as data;
pub use candle_data::{io, transfer};

// The models crate: the trainable models with Hugging Face names (`trainer::model`, as before
// the split).
pub use candle_models::{export, hub, load, lora, model};

// The README's code blocks compile as doctests (`cargo test --doc -p trainer`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}
