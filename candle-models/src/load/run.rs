//! What loading reads of a trainer checkpoint's `trainer_state.json`: the step its manifest
//! must record, the data and base it was trained on, the shape of its model, where it was
//! started from and how its base was quantized. The trainer's full state (optimiser position,
//! every setting) is the trainer's to read.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::CONFIG_FILE;
use crate::lora::{Nf4Settings, RecordedBase};
use crate::model::ModelConfig;
use crate::{Error, Result};
use candle_data::{DataKind, DataSource, Fingerprint};

/// The part of a trainer checkpoint's `trainer_state.json` that loading checks the model
/// against (the fields of the trainer's own state of the same names).
#[derive(Clone, Debug, Deserialize)]
pub struct RunState {
    /// Optimiser steps completed (what the checkpoint's manifest must record).
    pub step: usize,
    /// The run's settings that loading reads.
    pub config: RunConfig,
    /// Identity of the data and vocabulary the run trained on (absent in checkpoints written
    /// before fingerprints existed).
    #[serde(default)]
    pub data: Option<Fingerprint>,
    /// The frozen base of a LoRA run, by identity.
    #[serde(default)]
    pub base: Option<RecordedBase>,
}

/// The run settings loading reads from `trainer_state.json`'s `config`.
#[derive(Clone, Debug, Deserialize)]
pub struct RunConfig {
    /// The model the run was started from (a LoRA run's base).
    #[serde(default)]
    pub init_from: Option<String>,
    /// Transformer layers.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Width.
    pub n_embd: usize,
    /// Whether the linear layers have biases.
    pub bias: bool,
    /// Context length the run trained at.
    pub block_size: usize,
    /// The kind of data the run trained on.
    #[serde(default)]
    pub data: DataKind,
    /// The tokenizer the run's data was encoded with.
    #[serde(default)]
    pub tokenizer_path: Option<PathBuf>,
    /// `none` or `nf4` (a QLoRA run's 4-bit base).
    #[serde(default)]
    base_quant: Option<String>,
    /// Double quantization of a 4-bit base.
    #[serde(default)]
    base_quant_double: bool,
    /// Modules a 4-bit base kept in full precision, comma-separated.
    #[serde(default)]
    base_quant_skip: Option<String>,
}

impl RunConfig {
    /// How the run quantized its base, if it held it in 4 bits (`base_quant = "nf4"`).
    pub fn nf4_settings(&self) -> Option<Nf4Settings> {
        (self.base_quant.as_deref() == Some("nf4")).then(|| {
            let skip = self.base_quant_skip.as_deref().map(|s| {
                s.split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_string)
                    .collect()
            });
            Nf4Settings {
                double: self.base_quant_double,
                skip: skip.unwrap_or_else(|| Nf4Settings::default().skip),
            }
        })
    }
}

impl RunState {
    /// Errors unless `model` (read from `dir`'s `config.json`) is the model the run trained:
    /// the recorded shape, positions for the run's context, and (given `data`) an embedding
    /// for every token id of the data.
    pub fn check_model(
        &self,
        model: &dyn ModelConfig,
        data: Option<&dyn DataSource>,
        dir: &Path,
    ) -> Result<()> {
        let config = &self.config;
        let mut wrong = Vec::new();
        let shape = model.shape();
        for (name, in_model, in_run) in [
            ("n_layer", shape.n_layer, config.n_layer),
            ("n_head", shape.n_head, config.n_head),
            ("n_embd", shape.n_embd, config.n_embd),
        ] {
            if in_model != in_run {
                wrong.push(format!("{name} {in_model} (trainer_state.json: {in_run})"));
            }
        }
        if shape.bias != config.bias {
            wrong.push(format!(
                "bias {} (trainer_state.json: {})",
                shape.bias, config.bias
            ));
        }
        if model.max_positions() < config.block_size {
            wrong.push(format!(
                "n_positions {} < the run's block_size {}",
                model.max_positions(),
                config.block_size
            ));
        }
        if let Some(data) = data.filter(|d| model.vocab_size() < d.vocab_size()) {
            wrong.push(format!(
                "vocab_size {} < the data's {} token ids",
                model.vocab_size(),
                data.vocab_size()
            ));
        }
        if wrong.is_empty() {
            return Ok(());
        }
        Err(Error::checkpoint(
            dir.join(CONFIG_FILE),
            format!("disagrees with the run it belongs to: {}", wrong.join(", ")),
        ))
    }
}
