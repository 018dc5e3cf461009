//! Error type of the crate.

use crate::action::Action;

/// Errors raised while building or running a pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A Candle operation failed inside a stage action.
    #[error("worker {worker}, {action}: {source}")]
    Stage {
        /// Worker (thread / device) that ran the action.
        worker: usize,
        /// The action (microbatch and virtual stage) that failed.
        action: Action,
        /// The underlying Candle error.
        #[source]
        source: candle_core::Error,
    },
    /// A stage panicked while running an action; the panic was caught and the pipeline stopped.
    #[error("worker {worker}, {action}: panic: {message}")]
    Panic {
        /// Worker that panicked.
        worker: usize,
        /// The action during which the panic happened.
        action: Action,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// This worker stopped because another worker failed first (see the other error).
    #[error("worker {worker} aborted because worker {cause} failed")]
    Aborted {
        /// The worker that stopped.
        worker: usize,
        /// The worker that failed first.
        cause: usize,
    },
    /// The transport between workers failed (closed channel, lost peer, ...).
    #[error("transport error on worker {worker}: {message}")]
    Transport {
        /// Worker that observed the failure.
        worker: usize,
        /// Description of the failure.
        message: String,
    },
    /// A schedule is malformed or would deadlock.
    #[error("invalid schedule: {0}")]
    InvalidSchedule(String),
    /// The pipeline configuration is inconsistent (stage/worker counts, devices, balance input ...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A Candle error outside of a stage action (splitting a batch, merging gradients, ...).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, PipelineError>;
