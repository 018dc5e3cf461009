#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod cost;
pub mod grid;
mod transport;

pub use grid::{Grid2D, GridError, Topology};
pub use transport::CommTransport;
