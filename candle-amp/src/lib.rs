#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod amp;
mod check;
mod error;
mod master;
mod outcome;
mod scaler;
mod state;
mod update;

pub use amp::Amp;
pub use error::{AmpError, Result};
pub use master::{MasterWeights, WeightMode};
pub use outcome::{SkipReason, StepOutcome};
pub use scaler::{CollapsePolicy, ScaleChange, ScalerConfig, ScalerKind};
pub use state::ScalerState;
pub use update::{Plain, ScaledUpdate};
