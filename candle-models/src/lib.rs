#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! [`model`]: the interface every model has ([`model::ModelConfig`], [`model::Model`], the
//! chain of [`model::Link`]s), the shared layers ([`model::layers`]) and the architectures
//! ([`model::gpt2`], [`model::llama`], [`model::gemma3`]), one line each in the registry
//! ([`model::Arch`]).

#![warn(missing_docs)]

pub mod model;

pub use candle_data::{Error, Result};
