//! One unit of work of a pipeline worker: the plain type that schedules, the simulator, the
//! executor, reports and errors all speak of.

use std::fmt;

/// One unit of work of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// Forward pass of microbatch `mb` through virtual stage `stage`.
    Forward {
        /// Microbatch index.
        mb: usize,
        /// Virtual stage index.
        stage: usize,
    },
    /// Backward pass of microbatch `mb` through virtual stage `stage`.
    Backward {
        /// Microbatch index.
        mb: usize,
        /// Virtual stage index.
        stage: usize,
    },
}

impl Action {
    /// Microbatch of the action.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. } | Action::Backward { mb, .. } => mb,
        }
    }

    /// Virtual stage of the action.
    pub fn stage(&self) -> usize {
        match *self {
            Action::Forward { stage, .. } | Action::Backward { stage, .. } => stage,
        }
    }

    /// True for [`Action::Forward`].
    pub fn is_forward(&self) -> bool {
        matches!(self, Action::Forward { .. })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Forward { mb, stage } => {
                write!(f, "forward of microbatch {mb} on stage {stage}")
            }
            Action::Backward { mb, stage } => {
                write!(f, "backward of microbatch {mb} on stage {stage}")
            }
        }
    }
}
