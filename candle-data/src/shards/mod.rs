//! Pre-tokenised token shards: a directory of `train-NNNNN.tok` / `val-NNNNN.tok` files and
//! a `manifest.json`, made once by `trainer prepare` and memory-mapped by training.
//!
//! - [`format`](mod@format): one shard file (header, tokens, document starts, loss mask), reading,
//!   writing and verifying it, and the [`Manifest`].
//! - [`prepare`](mod@prepare): text, JSONL or SFT records (from text, JSON-lines or Parquet
//!   files) → shards, streaming, parallel, deterministic and
//!   resumable.
//! - [`ShardSource`]: the [`DataSource`](crate::DataSource) over a prepared directory
//!   (or nanoGPT's `train.bin` / `val.bin`), memory-mapped, in random or epoch order
//!   ([`DataOrder`]).
//! - `pairs`: the preference pairs of a directory prepared with `--format preference`
//!   (the pair layout), read whole for [`PreferenceSource`](crate::sft::PreferenceSource).
//! - [`verify_dir`]: `trainer prepare --verify DIR`, every shard read back and checked.
//! - [`write_prepared`]: a whole prepared directory from token streams in memory (the text
//!   sources' token cache).

mod cutter;
mod encode;
mod files;
pub mod format;
mod input;
mod manifest;
mod options;
pub(crate) mod order;
pub(crate) mod pairs;
mod plan;
pub mod prepare;
mod progress;
mod read_bytes;
mod read_parquet;
mod source;
mod unit;
mod verify;
pub(crate) mod view;
mod write;

pub use format::{Manifest, ShardEntry, ShardHeader};
pub use options::{
    Container, InputFormat, PrepareOptions, PrepareProgress, PrepareSummary, VocabSpec,
};
pub use order::DataOrder;
pub use prepare::prepare;
pub(crate) use source::human;
pub use source::{ShardOptions, ShardSource};
pub use verify::{verify_dir, ShardVerdict};
pub use write::{write_prepared, ShardData};
