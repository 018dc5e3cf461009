#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod action;
pub mod balance;
pub mod error;
pub mod executor;
mod fence;
pub mod microbatch;
pub mod report;
pub mod schedule;
pub mod simulator;
pub mod stage;
pub mod transport;
pub mod worker;

pub use action::Action;
pub use balance::{
    balance_by_cost, balance_by_params, balance_by_time, measure_layer_times, split_by_params,
    split_layers,
};
pub use error::{PipelineError, Result};
pub use executor::{Pipeline, StepOutput};
pub use microbatch::{chunk_sizes, even_sizes, LossReduction, Microbatches};
pub use report::{Span, Timeline};
pub use schedule::Schedule;
pub use simulator::{simulate, Costs, Prediction};
pub use stage::{
    vars_with_prefix, Call, ForwardHook, Hooked, Layer, Sequential, Stage, StageBackward,
    StageForward,
};
pub use transport::{Envelope, Expected, InProcess, Message, Payload, Transport};
pub use worker::{Handoffs, LossFn, PipelineWorker, WorkerStep};
