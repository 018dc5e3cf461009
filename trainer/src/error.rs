//! The trainer library's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the trainer library.
///
/// Each variant names the file (when there is one) and the problem, so that the CLI can print
/// one clear line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A configuration value is impossible or inconsistent.
    #[error("invalid config: {0}")]
    Config(String),
    /// An error of the kinds shared with the data crate: a file that could not be read or
    /// written, an unusable data file, a missing or corrupt checkpoint file, a tokenizer. Its
    /// message is the data crate's, unchanged.
    #[error(transparent)]
    Data(#[from] candle_data::Error),
    /// A fresh run was pointed at a directory that already holds a run.
    #[error(
        "{} already holds a run (run.toml, metrics.jsonl or checkpoints/): continue it with \
         `--resume {}`, replace it with `--overwrite`, or choose another --out-dir",
        path.display(),
        path.display()
    )]
    RunDirExists {
        /// The run directory.
        path: PathBuf,
    },
    /// Another process holds the run directory's lock.
    #[error("{} is in use by another process (its .lock is held); wait for it to finish or stop it", path.display())]
    RunDirBusy {
        /// The run directory.
        path: PathBuf,
    },
    /// Activation checkpointing failed (`candle-remat`).
    #[error(transparent)]
    Remat(#[from] candle_remat::RematError),
    /// No activation-checkpointing plan satisfies the policy (e.g. a budget below the
    /// smallest possible peak).
    #[error("remat `{policy}`{where_}: {source}")]
    RematPlan {
        /// The policy as configured (`budget:2GiB`, ...).
        policy: String,
        /// Where the plan was made (empty for the whole chain, " in a pipeline stage").
        where_: &'static str,
        /// The planner's error.
        #[source]
        source: Box<candle_remat::RematError>,
    },
    /// A checkpoint's loss-scaler state could not be loaded.
    #[error("checkpoint {}: {source}", path.display())]
    AmpState {
        /// The scaler state file.
        path: PathBuf,
        /// candle-amp's error.
        #[source]
        source: Box<candle_amp::AmpError>,
    },
    /// The pipeline failed (`candle-pipeline`): the error names the worker and the action
    /// (microbatch and stage) where it happened.
    #[error("pipeline: {0}")]
    Pipeline(Box<candle_pipeline::PipelineError>),
    /// Communication between data-parallel ranks failed (`candle-comm`): the error names the
    /// rank, the operation and, when another rank caused it, that rank.
    #[error("data parallel: {0}")]
    Comm(Box<candle_comm::CommError>),
    /// Mixed precision failed (`candle-amp`), e.g. the loss scale collapsed.
    #[error(transparent)]
    Amp(#[from] candle_amp::AmpError),
    /// Training produced non-finite gradients where skipping the step could not help (no
    /// dynamic loss scale to back off: f32, bf16, a static scale).
    #[error(
        "non-finite gradient norm {norm} at step {step} (in {}: {}); the weights were not \
         updated. Lower the learning rate or resume from an earlier checkpoint",
        params.len(),
        params.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
    )]
    NonFiniteGradient {
        /// The step at which the gradients were computed.
        step: usize,
        /// The global gradient norm (at the loss scale).
        norm: f32,
        /// The parameters whose gradients hold inf or NaN.
        params: Vec<String>,
    },
    /// Training produced a non-finite loss.
    #[error("non-finite loss {loss} at step {step}")]
    NonFiniteLoss {
        /// The step at which the loss was observed.
        step: usize,
        /// The loss value.
        loss: f32,
    },
}

impl Error {
    /// Builds the data crate's [`candle_data::Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Data(candle_data::Error::io(path, error))
    }

    /// Builds the data crate's [`candle_data::Error::Data`] for `path`.
    pub fn data(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data(candle_data::Error::data(path, msg))
    }

    /// Builds the data crate's [`candle_data::Error::Checkpoint`] for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data(candle_data::Error::checkpoint(path, msg))
    }
}

impl From<candle_pipeline::PipelineError> for Error {
    fn from(e: candle_pipeline::PipelineError) -> Self {
        Error::Pipeline(Box::new(e)) // boxed: it carries an action and a Candle error
    }
}

impl From<candle_comm::CommError> for Error {
    fn from(e: candle_comm::CommError) -> Self {
        Error::Comm(Box::new(e))
    }
}

/// The trainer's errors where the models crate calls back into the trainer (a LoRA layer's
/// weights, a 4-bit base's): the shared kinds keep their kind; the trainer's own keep their
/// message (and come back to the trainer as it).
impl From<Error> for candle_data::Error {
    fn from(e: Error) -> Self {
        use candle_data::Error as D;
        match e {
            Error::Data(e) => e,
            Error::Candle(e) => D::Candle(e),
            Error::Config(msg) => D::Config(msg),
            other => D::Candle(candle_core::Error::Msg(other.to_string())),
        }
    }
}

/// Result with the trainer's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
