//! Pre-tokenised token shards: a directory of `train-NNNNN.tok` / `val-NNNNN.tok` files and
//! a `manifest.json`, made once by `trainer prepare` and memory-mapped by training.
//!
//! - [`format`](mod@format): one shard file (header, tokens, document starts, loss mask), reading,
//!   writing and verifying it, and the [`Manifest`].
//! - [`prepare`](mod@prepare): text, JSONL or SFT records → shards, streaming, parallel, deterministic and
//!   resumable.

pub mod format;
mod input;
mod manifest;
pub mod prepare;

pub use format::{Manifest, ShardEntry, ShardHeader};
pub use prepare::{
    prepare, InputFormat, PrepareOptions, PrepareProgress, PrepareSummary, VocabSpec,
};
