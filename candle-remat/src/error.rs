//! The crate's error type.

/// Errors returned by `candle-remat`.
#[derive(Debug, thiserror::Error)]
pub enum RematError {
    /// An error from Candle itself (shape mismatch, device error, ...), or from user code
    /// run inside a checkpointed segment.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Verification mode found that re-running a segment in the backward pass did not reproduce
    /// the values its forward produced (a non-deterministic op, an RNG not keyed by the segment
    /// seed, state mutated between forward and backward, ...).
    #[error(
        "recomputed values differ in segment {segment} (creation order path), output {output}: \
         {mismatches} of {elements} elements differ, max |diff| = {max_abs_diff:e}; the segment \
         is not deterministic: draw random numbers with candle_remat::dropout / \
         candle_remat::seeded_rng and do not mutate state captured by the closure"
    )]
    RecomputeMismatch {
        /// Path of the segment: `"3"` is the 4th top-level checkpoint, `"3/1"` the 2nd checkpoint
        /// nested inside it.
        segment: String,
        /// Index of the first mismatching output of that segment.
        output: usize,
        /// Number of elements that are not bit-identical (NaN counts as a mismatch).
        mismatches: usize,
        /// Number of elements of the output.
        elements: usize,
        /// Largest absolute difference found (NaN if either side holds a NaN).
        max_abs_diff: f64,
    },

    /// A recompute returned a different number of outputs than the forward did.
    #[error(
        "segment {segment}: forward returned {forward} outputs, recompute returned {recompute}"
    )]
    OutputCountMismatch {
        /// Path of the segment.
        segment: String,
        /// Outputs produced by the forward run.
        forward: usize,
        /// Outputs produced by the recompute.
        recompute: usize,
    },

    /// No memory plan over the chain fits the requested budget.
    #[error(
        "impossible memory budget: {budget} bytes requested, but the leanest plan for this chain \
         needs {min_bytes} bytes of activations (predicted)"
    )]
    ImpossibleBudget {
        /// The requested budget in bytes.
        budget: u64,
        /// The smallest predicted peak any plan reaches.
        min_bytes: u64,
    },

    /// A policy or a chain description is not valid (k = 0, empty chain, ...).
    #[error("invalid plan request: {0}")]
    InvalidPlan(String),

    /// [`crate::dropout`] was called outside any tape scope, so no seed is available.
    #[error("candle_remat::dropout called outside a Tape scope: run it inside Tape::checkpoint / Tape::scope or use Tape::dropout")]
    NoSeedContext,
}

impl From<RematError> for candle_core::Error {
    fn from(e: RematError) -> Self {
        match e {
            RematError::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, RematError>;
