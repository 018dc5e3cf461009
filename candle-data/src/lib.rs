#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! A [`DataSource`] turns a corpus (or a generated task) into `[B, T]` batches of input and
//! target token ids. Sampling is driven only by the [`ChaCha8Rng`] the caller passes in, so saving
//! that generator's state is enough to resume a run bit-exactly.
//!
//! Sources, chosen by [`DataSpec::kind`] and built with [`open`]:
//! - [`DataKind::Addition`] (the default): multi-digit addition generated on the fly, no file
//!   needed, with an exact-match [`Task`] on held-out problems (see [`Addition`]).
//! - [`DataKind::Char`]: a UTF-8 text file with a character vocabulary (the sorted unique
//!   characters of the file, as in nanoGPT's `shakespeare_char`).
//! - [`DataKind::Byte`]: any file, one token per byte (vocabulary 256).
//! - [`DataKind::Tokenizer`]: a UTF-8 text file encoded with a Hugging Face `tokenizer.json`.
//! - [`DataKind::Sft`]: supervised fine-tuning records (chat conversations, prompt/completion
//!   pairs, text) from a JSONL file, rendered with the tokenizer's chat template, with a loss
//!   mask over the assistant's tokens (see [`sft`]).
//! - [`DataKind::ChatTask`]: generated chat conversations (letter-string tasks, no file)
//!   trained as `sft` data with the model's chat template, with an exact-match [`Task`] on
//!   held-out questions (see [`chat_task`]).
//!
//! Text sources split the token stream into the first `1 - val_fraction` (train) and the last
//! `val_fraction` (validation) and sample windows of `block_size + 1` tokens. They are a
//! special case of [`ShardSource`]: char and tokenizer encodings are cached on disk as a
//! prepared shard directory (under [`DataSpec::cache_dir`]), so a second run starts without
//! re-tokenising, and every text or shard source reads its tokens memory-mapped.
//!
//! ```
//! use candle_data::{open, DataSpec, Split};
//! use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
//!
//! let source = open(&DataSpec::default())?; // the embedded addition task
//! let mut rng = ChaCha8Rng::seed_from_u64(0);
//! let batch = source.batch(Split::Train, 4, 32, &mut rng, &candle_core::Device::Cpu)?;
//! assert_eq!(batch.x.dims(), &[4, 32]);
//! assert!(batch.mask.is_some()); // only answer tokens count in the loss
//! # Ok::<(), candle_data::Error>(())
//! ```
//!
//! Beside the sources: [`shards`] (the token shard format, `prepare`, `verify`), [`sft`]
//! (records, chat templates, preference pairs), [`tokenizer`] (a Hugging Face
//! `tokenizer.json`), [`Rows`] (what travels with a batch's rows), and the shared leaves a
//! trainer builds on: [`io`] (atomic writes, JSON and safetensors files), [`transfer`] (the
//! counted host-device transfer points) and [`hash`] (the digests fingerprints are made of).
#![warn(missing_docs)]

#[macro_use]
mod names;
#[macro_use]
mod source_methods;

mod addition;
mod batch;
mod cache;
pub mod chat_task;
pub mod digest;
mod error;
pub mod hash;
pub mod io;
mod iter;
pub mod lines;
mod open;
pub(crate) mod parquet;
mod rows;
pub mod sft;
pub mod shards;
mod spec;
mod text;
pub mod tokenizer;
pub mod transfer;
mod vocab;

use candle_core::Device;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use addition::Addition;
pub use batch::{Batch, BatchRequest, HostTargets, MaskCounts};
pub use chat_task::{ChatTask, ChatTaskKind};
pub use error::{Error, Result};
pub use iter::{BatchIter, IntoBatch};
pub use open::{check_fingerprint, open, open_for_run};
pub use rows::{HostTokens, Rows, IGNORE};
pub use sft::SftSource;
pub use shards::{DataOrder, ShardOptions, ShardSource};
pub use spec::{DataKind, DataSpec};
pub use text::TextSource;

/// Which part of the data a batch is drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// The training split.
    Train,
    /// The held-out validation split.
    Val,
}

/// A source of training batches plus the vocabulary that goes with it.
///
/// Implementations must draw all randomness from the `rng` argument of [`DataSource::batch`]
/// (never `thread_rng` or Candle's RNG), so that the same generator state gives the same batch.
pub trait DataSource: Send + Sync {
    /// Number of token ids the model must be able to embed (every id is `< vocab_size()`).
    fn vocab_size(&self) -> usize;

    /// One line for logs, e.g.
    /// `tinyshakespeare.txt: 1.1M chars, char vocab 65, 1003854 train / 111540 val tokens`.
    fn describe(&self) -> String;

    /// Samples `batch_size` windows of `block_size` inputs (and their shifted targets) from
    /// `split`, using only `rng` for randomness, and uploads them to `device`.
    ///
    /// Fails with a clear error if `batch_size` or `block_size` is zero, or if a text split is
    /// shorter than `block_size + 1` tokens. The batch and the state `rng` is left in depend
    /// only on the arguments and the state `rng` was in. Checks the sizes and [`draw`]s the
    /// batch; a source implements `draw` (or overrides this whole).
    ///
    /// [`draw`]: DataSource::draw
    fn batch(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        rng: &mut ChaCha8Rng,
        device: &Device,
    ) -> Result<Batch> {
        check_shape(batch_size, block_size)?;
        let want = BatchRequest {
            split,
            batch_size,
            block_size,
            device,
        };
        self.draw(&want, rng)
    }

    /// Draws the batch `want` asks for (its sizes already checked by [`DataSource::batch`]),
    /// using only `rng` for randomness: what a source implements. The default, for a source
    /// that overrides `batch` instead, is an error.
    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        let _ = (want, rng);
        Err(Error::Config(
            "this data source implements neither DataSource::draw nor DataSource::batch".into(),
        ))
    }

    /// Encodes text into token ids (errors on text the vocabulary cannot represent).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;

    /// Decodes token ids into text (errors on ids outside the vocabulary).
    fn decode(&self, ids: &[u32]) -> Result<String>;

    /// Checks up front that `block_size` is usable for training, so that a misconfigured run
    /// fails before the model is built: text sources need `block_size + 1` tokens in each split;
    /// the addition task needs room for one whole problem's answer. ([`DataSource::batch`]
    /// still serves shorter blocks of the addition task, e.g. as sampling prompts.)
    fn check_block_size(&self, block_size: usize) -> Result<()> {
        let _ = block_size;
        Ok(())
    }

    /// A task with an exact-match score, if this source has one.
    fn task(&self) -> Option<&dyn Task> {
        None
    }

    /// Identity of the token stream and the vocabulary, stored with a run's checkpoints so
    /// that a changed corpus or vocabulary is caught before it silently shifts token ids.
    fn fingerprint(&self) -> Fingerprint;

    /// The source as preference pairs, if it is one (DPO's reference values are computed
    /// over its pairs).
    fn preferences(&self) -> Option<&sft::PreferenceSource> {
        None
    }
}

/// Identity of a data source: stable 64-bit hashes (hex) of its token stream and of its
/// vocabulary. Not cryptographic; it detects edits, not tampering.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// Hash of every token id in order (both splits) and of the split point.
    pub tokens: String,
    /// Hash of the vocabulary (characters, the byte vocabulary, or the tokenizer file).
    pub vocab: String,
}

impl Fingerprint {
    /// The fingerprint of `tokens` split after `n_train`, under the vocabulary hashed as
    /// `vocab`.
    pub(crate) fn of_tokens(tokens: &[u32], n_train: usize, vocab: u64) -> Self {
        let mut h = crate::hash::Hasher64::new();
        h.update(&(n_train as u64).to_le_bytes());
        let mut buf = Vec::with_capacity(4 * 4096);
        for chunk in tokens.chunks(4096) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            h.update(&buf);
        }
        Fingerprint {
            tokens: format!("{:016x}", h.finish()),
            vocab: format!("{vocab:016x}"),
        }
    }
}

/// Held-out problems for exact-match evaluation by greedy decoding.
///
/// The caller feeds each prompt (starting at position 0), greedily generates
/// `answer.len()` tokens and counts the problem as solved when the generated tokens equal the
/// expected answer exactly, token by token.
pub trait Task: Send + Sync {
    /// Name of the score for logs, e.g. `"addition accuracy"`.
    fn name(&self) -> &str;

    /// `n` held-out problems: (prompt tokens, expected answer tokens). All prompts have the same
    /// length and all answers the same length, so the caller can decode them as one batch. The
    /// list is deterministic: the same `n` always gives the same problems, and a smaller `n`
    /// gives a prefix of a larger one.
    fn eval_problems(&self, n: usize) -> Vec<(Vec<u32>, Vec<u32>)>;
}

/// `v` as the `f64` nearest to its shortest decimal form, so that `0.1f32` means 0.1 (and
/// `int(n * 0.9)` splits as in nanoGPT), not 0.10000000149.
pub(crate) fn decimal_f64(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::from(v))
}

/// Errors unless `batch_size` and `block_size` are both positive.
pub(crate) fn check_shape(batch_size: usize, block_size: usize) -> Result<()> {
    if batch_size == 0 || block_size == 0 {
        return Err(Error::Config(format!(
            "batch_size ({batch_size}) and block_size ({block_size}) must both be positive"
        )));
    }
    Ok(())
}
