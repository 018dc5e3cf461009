//! The crate's error type.

/// Errors returned by `candle-amp`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// An error from a Candle operation of the crate's own.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// The optimiser update ([`ScaledUpdate`](crate::ScaledUpdate)) failed, computing the
    /// gradient norm or applying the update; its error is the cause. The step was not
    /// counted (the scaler state is unchanged), but an update that failed midway may have
    /// changed some weights.
    #[error("the optimiser update failed")]
    Update(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// The dynamic loss scale had to back off below its minimum while gradients were still
    /// non-finite, and the [`CollapsePolicy`](crate::CollapsePolicy) is `Error`.
    ///
    /// The step was skipped and counted before this error was returned, so the state stays
    /// consistent if the caller decides to continue anyway.
    #[error("loss scale collapsed at step {step}: {diagnosis}")]
    ScaleCollapse {
        /// Index of the step (0-based count of steps attempted before this one).
        step: u64,
        /// The scale used for this step (equal to the minimum scale).
        scale: f64,
        /// The configured minimum scale.
        min_scale: f64,
        /// Number of consecutive skipped steps including this one.
        consecutive_skips: u64,
        /// Names of the parameters whose gradients held inf or NaN.
        nonfinite_params: Vec<String>,
        /// A human-readable explanation with likely causes and remedies.
        diagnosis: String,
    },

    /// A configuration value is invalid (for example a growth factor below 1).
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A parameter cannot be used as a master weight.
    #[error("parameter `{name}`: {reason}")]
    Param {
        /// The parameter's registered name.
        name: String,
        /// Why it was rejected.
        reason: String,
    },

    /// Saved scaler state is missing a field or is malformed.
    #[error("invalid scaler state: {0}")]
    State(String),

    /// Reading or writing a safetensors file failed.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),

    /// An I/O error while reading or writing state.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl AmpError {
    /// Wraps an error of the optimiser update.
    pub(crate) fn update(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Update(Box::new(e))
    }
}

/// Result alias using [`AmpError`].
pub type Result<T> = std::result::Result<T, AmpError>;
