#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! * [`tape`]: [`Tape`], checkpointed segments and the backward driver (and *why* it is built
//!   as a tape: Candle's graph is private);
//! * [`seed`]: deterministic recompute: per-segment seeds, [`dropout`], [`seeded_rng`];
//! * [`policy`]: [`Policy`] (none, every-k, sqrt(N), byte budget), the DP planner and [`Plan`];
//! * [`measure`]: [`measure_chain`], per-block costs for the planner.
//!
//! Fused, memory-lean attention, LayerNorm and GELU (with their own backward) live in the
//! `candle-fused` crate; they compose with checkpointing (their recompute is bit-identical).
#![warn(missing_docs)]

pub mod error;
pub mod measure;
mod parse;
pub mod policy;
pub mod seed;
pub mod tape;
mod verify;

pub use error::{RematError, Result};
pub use measure::measure_chain;
pub use parse::parse_bytes;
pub use policy::{BlockCost, ChainCosts, Plan, PlanSegment, Policy};
pub use seed::{dropout, seeded_rng};
pub use tape::Tape;
