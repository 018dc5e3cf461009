//! `trainer`: train GPT-style transformers on Candle.
//!
//! The library behind the `trainer` CLI: a GPT-2 model with Hugging Face parameter names
//! ([`model`]), data sources ([`data`]), AdamW with owned state ([`optim`]), checkpoints that
//! resume bit-exactly ([`checkpoint`]) and the training loop ([`train`]).

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod model;
pub mod optim;
pub mod schedule;

pub use error::{Error, Result};
