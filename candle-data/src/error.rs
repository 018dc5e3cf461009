//! The data crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading, preparing or batching data.
///
/// Each variant names the file (when there is one) and the problem, so that a program can
/// print one clear line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Reading or writing a file failed. The OS error is part of the message and is not
    /// repeated as a separate cause (so `{:#}` prints it once).
    #[error("{}: {error}", path.display())]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// A setting is impossible or inconsistent.
    #[error("invalid config: {0}")]
    Config(String),
    /// A data file or data source is unusable (empty, too short, unreadable...).
    #[error("data {path}: {msg}")]
    Data {
        /// The data file (or a description of the source).
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A safetensors or JSON file written beside a run (a checkpoint's) is missing or corrupt.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A tokenizer could not be loaded or failed to encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

impl Error {
    /// Builds an [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }

    /// Builds an [`Error::Data`] for `path`.
    pub fn data(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data {
            path: path.into(),
            msg: msg.into(),
        }
    }

    /// Builds an [`Error::Checkpoint`] for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.into(),
        }
    }
}

/// Result with the data crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
