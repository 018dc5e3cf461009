#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! [`model`]: the interface every model has ([`model::ModelConfig`], [`model::Model`], the
//! chain of [`model::Link`]s), the shared layers ([`model::layers`]) and the architectures
//! ([`model::gpt2`], [`model::llama`], [`model::gemma3`]), one line each in the registry
//! ([`model::Arch`]).
//!
//! [`load`]: one loading path for Hugging Face directories, trainer checkpoints and PEFT
//! adapters, with its checks; [`hub`]: the local hub cache; [`lora`]: LoRA and QLoRA over a
//! model; [`export`]: Hugging Face safetensors directories and GGUF files.

#![warn(missing_docs)]

pub mod export;
pub mod hub;
pub mod load;
pub mod lora;
pub mod model;

pub use candle_data::{Error, Result};
