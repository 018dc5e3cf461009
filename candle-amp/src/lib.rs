#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod amp;
mod check;
mod error;
mod master;
mod outcome;
mod policy;
mod scaler;
mod state;

pub use amp::Amp;
pub use check::{GradCheck, NonFinite};
pub use error::{AmpError, Result};
pub use master::{MasterParam, MasterWeights, WeightMode};
pub use outcome::{SkipReason, StepOutcome};
pub use policy::PrecisionPolicy;
pub use scaler::{CollapsePolicy, LossScaler, ScaleChange, ScaleUpdate, ScalerConfig, ScalerKind};
pub use state::{ScalerState, DEFAULT_PREFIX};
