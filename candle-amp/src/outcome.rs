//! What happened at a step.

use crate::scaler::ScaleChange;

/// Why a step's update was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Gradients held inf or NaN at the current scale; the scale was handled by the scaler
    /// (backoff or hysteresis).
    NonFiniteGradients,
    /// Gradients held inf or NaN while the scale was already at its minimum and
    /// [`CollapsePolicy::Continue`](crate::CollapsePolicy::Continue) is set.
    ScaleCollapsed,
}

/// The result of [`Amp::step`](crate::Amp::step): every step says what happened.
///
/// ```
/// # use candle_amp::StepOutcome;
/// fn log(o: &StepOutcome) -> String {
///     match o {
///         StepOutcome::Applied { grad_norm, scale, .. } => format!("ok |g|={grad_norm:.3} scale={scale}"),
///         StepOutcome::Skipped { reason, scale_before, scale_after, nonfinite_params, .. } => {
///             format!("skipped ({reason:?}) {scale_before}->{scale_after}, bad: {nonfinite_params:?}")
///         }
///     }
/// }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The optimiser stepped the master weights.
    Applied {
        /// Index of this step (number of steps attempted before it).
        step: u64,
        /// Global L2 norm of the unscaled gradients, before clipping.
        grad_norm: f64,
        /// Factor the unscaled gradients were multiplied with by clipping (`1.0` if none).
        clip_coef: f64,
        /// Loss scale the applied gradients were computed with.
        scale: f64,
        /// Loss scale for the next step (differs from `scale` after a growth).
        next_scale: f64,
        /// Change of the scale made by this step (`Grew` or `Unchanged`).
        change: ScaleChange,
    },
    /// The update was skipped: no weight or optimiser state changed.
    Skipped {
        /// Index of this step.
        step: u64,
        /// Why.
        reason: SkipReason,
        /// Loss scale the failing backward used.
        scale_before: f64,
        /// Loss scale for the next step.
        scale_after: f64,
        /// Change of the scale made by this step.
        change: ScaleChange,
        /// Names of the parameters whose gradients held inf/NaN (registration order).
        nonfinite_params: Vec<String>,
    },
}

impl StepOutcome {
    /// True if the optimiser step was applied.
    pub fn is_applied(&self) -> bool {
        matches!(self, Self::Applied { .. })
    }

    /// True if the step was skipped.
    pub fn is_skipped(&self) -> bool {
        matches!(self, Self::Skipped { .. })
    }

    /// The step index.
    pub fn step(&self) -> u64 {
        match self {
            Self::Applied { step, .. } | Self::Skipped { step, .. } => *step,
        }
    }

    /// The loss scale for the next step.
    pub fn next_scale(&self) -> f64 {
        match self {
            Self::Applied { next_scale, .. } => *next_scale,
            Self::Skipped { scale_after, .. } => *scale_after,
        }
    }

    /// The gradient norm, if the step was applied.
    pub fn grad_norm(&self) -> Option<f64> {
        match self {
            Self::Applied { grad_norm, .. } => Some(*grad_norm),
            Self::Skipped { .. } => None,
        }
    }
}

impl std::fmt::Display for StepOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Applied {
                step,
                grad_norm,
                clip_coef,
                scale,
                next_scale,
                ..
            } => {
                write!(
                    f,
                    "step {step}: applied, grad norm {grad_norm:.4e}, scale {scale}"
                )?;
                if *clip_coef < 1.0 {
                    write!(f, ", clipped x{clip_coef:.4}")?;
                }
                if next_scale != scale {
                    write!(f, ", next scale {next_scale}")?;
                }
                Ok(())
            }
            Self::Skipped {
                step,
                reason,
                scale_before,
                scale_after,
                nonfinite_params,
                ..
            } => {
                write!(
                    f,
                    "step {step}: skipped ({reason:?}), scale {scale_before} -> {scale_after}"
                )?;
                if !nonfinite_params.is_empty() {
                    write!(
                        f,
                        ", non-finite gradients in {}",
                        nonfinite_params.join(", ")
                    )?;
                }
                Ok(())
            }
        }
    }
}
