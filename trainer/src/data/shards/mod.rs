//! Pre-tokenised token shards: a directory of `train-NNNNN.tok` / `val-NNNNN.tok` files and
//! a `manifest.json`, made once by `trainer prepare` and memory-mapped by training.
//!
//! - [`format`]: one shard file (header, tokens, document starts, loss mask), reading,
//!   writing and verifying it, and the [`Manifest`].

pub mod format;

pub use format::{Manifest, ShardEntry, ShardHeader};
