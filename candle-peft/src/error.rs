//! Error type of the crate: every error says which file, key or module it is about.

use std::path::PathBuf;

/// Errors of configuring, building, loading or saving adapters.
#[derive(Debug, thiserror::Error)]
pub enum PeftError {
    /// A configuration value is invalid (`r = 0`, a dropout outside `[0, 1)`, a bad regex...).
    #[error("LoRA config: `{key}`: {message}")]
    Config {
        /// The `adapter_config.json` key (or setting) at fault.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// `adapter_config.json` sets a PEFT option this crate does not implement.
    #[error(
        "{path}: `{key}` = {value} is a PEFT option this crate does not support \
         (supported: plain LoRA and rsLoRA with r, lora_alpha, lora_dropout, target_modules, \
         modules_to_save, fan_in_fan_out)"
    )]
    Unsupported {
        /// The config file.
        path: PathBuf,
        /// The option.
        key: String,
        /// Its value, as JSON.
        value: String,
    },
    /// A file of an adapter is missing, unreadable, or not what it should be.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An adapter does not fit the model it is applied to (a target that matches nothing, a
    /// tensor of the wrong shape, a tensor for a module the model does not have).
    #[error("{what}: {message}")]
    Mismatch {
        /// The adapter (its directory) or the config.
        what: String,
        /// What does not fit.
        message: String,
    },
    /// A Candle operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl PeftError {
    pub(crate) fn config(key: &str, message: impl Into<String>) -> Self {
        PeftError::Config {
            key: key.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        PeftError::File {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, PeftError>;
