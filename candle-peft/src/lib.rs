#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! * [`config`]: [`LoraConfig`] (PEFT's `LoraConfig`, the options this crate implements;
//!   the others refused by name) and [`TargetModules`] (PEFT's `target_modules` matching);
//! * [`lora`]: [`Lora`], one adapter on a linear layer: PEFT's initialisation, the fused
//!   forward and backward (from `candle-fused`), merge and unmerge;
//! * [`inject`]: [`Inject`], what a model offers its linear layers and parameters to while it
//!   is built, and [`LoraInjector`], PEFT's injection behind it (which layers, fresh or loaded
//!   adapters, trainable copies of the modules to save, PEFT's names);
//! * [`format`](mod@format): PEFT's files, `adapter_config.json` + `adapter_model.safetensors`, with
//!   PEFT's tensor names, read ([`Adapter::load`]) and written ([`format::save`]).
//!
//! The crate knows no model: a model offers each of its linear layers by module path
//! (`model.layers.0.self_attn.q_proj`) to an [`Inject`], which answers with the [`Lora`] that
//! runs it (or none); the model runs [`Lora::forward`] in place of its plain linear. It depends on
//! `candle-fused` for the fused op (one GEMM stack for every op), the one documented
//! exception to the workspace's "the libraries do not depend on each other".
#![warn(missing_docs)]

pub mod config;
mod error;
pub mod format;
pub mod inject;
pub mod lora;

pub use config::{LoraConfig, TargetModules};
pub use error::{PeftError, Result};
pub use format::Adapter;
pub use inject::{Inject, Injected, LinearLayer, LoraInjector};
pub use lora::Lora;
