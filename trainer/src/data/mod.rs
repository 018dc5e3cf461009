//! Training data: where the token batches come from.
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
//! prepared shard directory (see [`default_cache_dir`]), so a second run starts without
//! re-tokenising, and every text or shard source reads its tokens memory-mapped.
//!
//! ```
//! use trainer::data::{open, DataSpec, Split};
//! use rand_chacha::{rand_core::SeedableRng, ChaCha8Rng};
//!
//! let source = open(&DataSpec::default())?; // the embedded addition task
//! let mut rng = ChaCha8Rng::seed_from_u64(0);
//! let batch = source.batch(Split::Train, 4, 32, &mut rng, &candle_core::Device::Cpu)?;
//! assert_eq!(batch.x.dims(), &[4, 32]);
//! assert!(batch.mask.is_some()); // only answer tokens count in the loss
//! # Ok::<(), trainer::Error>(())
//! ```

mod addition;
mod cache;
pub mod chat_task;
pub(crate) mod iter;
pub mod lines;
mod open;
pub(crate) mod parquet;
pub mod sft;
pub mod shards;
mod text;
mod vocab;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, TensorId};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::{HostTokens, Rows, IGNORE};

pub use addition::Addition;
pub use cache::default_cache_dir;
pub use chat_task::{ChatTask, ChatTaskKind};
pub use iter::IntoBatch;
pub use open::{check_fingerprint, open_for_run};
pub use sft::SftSource;
pub use shards::{DataOrder, ShardOptions, ShardSource};
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

/// One batch of training windows.
///
/// `x` and `y` are `u32` tensors of shape `[B, T]` on the requested device; `y` is `x` shifted
/// left by one token (row `i` of `y` is the continuation of row `i` of `x`).
#[derive(Clone, Debug)]
pub struct Batch {
    /// Input token ids, `u32 [B, T]`.
    pub x: Tensor,
    /// Target token ids, `u32 [B, T]`: `y[i, j]` is the token that follows `x[i, j]`.
    pub y: Tensor,
    /// Loss weights, `f32 [B, T]`: 1.0 where the target `y[i, j]` counts in the loss, 0.0
    /// elsewhere. `None` means every target counts.
    pub mask: Option<Tensor>,
    /// Positions and document ids of the rows' tokens (default: `0..T`, one document a row).
    pub rows: Rows,
    /// The mask's counted targets per row, when the data source built the mask on the host
    /// ([`Batch::with_host_mask`]): counting and sharding then read nothing back from the
    /// device. Used only while `mask` is the tensor they were counted from.
    pub mask_counts: Option<MaskCounts>,
    /// A reference model's summed log-probability of each row's counted targets (`f32 [B]`),
    /// when the source holds them (DPO with reference values computed before training; see
    /// [`crate::model::Ctx::reference`]).
    pub reference: Option<Tensor>,
    /// The targets as the data source built them on the host ([`Batch::from_host`]): the
    /// cross-entropy ops then read nothing back from the device. Used only while `y` and
    /// `mask` are the tensors they were built with.
    pub host_targets: Option<HostTargets>,
}

/// A batch's targets on the host, the mask folded in ([`IGNORE`] where a target does not
/// count), flat, row-major (see [`Batch::host_targets`]).
#[derive(Clone, Debug)]
pub struct HostTargets {
    y: TensorId,
    mask: Option<TensorId>,
    values: Arc<[u32]>,
}

/// Counted targets per row of one mask tensor, summed on the host (see
/// [`Batch::mask_counts`]).
#[derive(Clone, Debug)]
pub struct MaskCounts {
    mask: TensorId,
    per_row: Vec<f32>,
}

impl Batch {
    /// A batch of inputs and targets in which every target counts.
    pub fn new(x: Tensor, y: Tensor) -> Self {
        Batch {
            x,
            y,
            mask: None,
            rows: Rows::default(),
            mask_counts: None,
            reference: None,
            host_targets: None,
        }
    }

    /// A batch of inputs `x` and targets `y` (`[B, T]` row-major on the host) copied to
    /// `device`, every target counting; the host copies of the targets ([`Batch::host_targets`])
    /// and of the token ids (for the embedding's backward) are kept.
    pub fn from_host(
        x: Vec<u32>,
        y: Vec<u32>,
        shape: (usize, usize),
        device: &Device,
    ) -> candle_core::Result<Self> {
        let values: Arc<[u32]> = y.as_slice().into();
        let y = crate::transfer::upload(y, shape, device)?;
        let host_targets = Some(HostTargets {
            y: y.id(),
            mask: None,
            values,
        });
        let tokens = HostTokens::new(x.clone(), shape.1);
        let mut batch = Batch {
            host_targets,
            ..Batch::new(crate::transfer::upload(x, shape, device)?, y)
        };
        batch.rows.tokens = Some(tokens);
        Ok(batch)
    }

    /// A batch of Hugging Face causal-LM inputs: `input_ids` and `labels` (`[B, T]`, integer
    /// ids; -100 = ignored), the labels shifted as transformers' `ForCausalLMLoss` shifts them:
    /// position `t` predicts `labels[t + 1]`, the last position nothing (the mask says which
    /// targets count).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use trainer::data::Batch;
    ///
    /// let ids = Tensor::new(&[[5u32, 6, 7, 8]], &Device::Cpu)?;
    /// let labels = Tensor::new(&[[-100i64, 6, -100, 8]], &Device::Cpu)?;
    /// let batch = Batch::from_hf_labels(&ids, &labels)?;
    /// let ignore = trainer::model::IGNORE;
    /// assert_eq!(batch.targets()?.to_vec2::<u32>()?, [[6, ignore, 8, ignore]]);
    /// # Ok::<(), trainer::Error>(())
    /// ```
    pub fn from_hf_labels(input_ids: &Tensor, labels: &Tensor) -> Result<Batch> {
        let (rows, t) = labels.dims2()?;
        if input_ids.dims() != [rows, t] || t == 0 {
            return Err(Error::Config(format!(
                "input_ids {:?} and labels {:?} must have the same [batch, length] shape, \
                 length at least 1",
                input_ids.dims(),
                labels.dims()
            )));
        }
        let labels = labels.to_dtype(DType::I64)?;
        let ignored = Tensor::full(-100i64, (rows, 1), labels.device())?;
        let shifted = Tensor::cat(&[&labels.narrow(1, 1, t - 1)?, &ignored], 1)?;
        let counts = shifted.ge(0i64)?;
        let y = counts.where_cond(&shifted, &shifted.zeros_like()?)?;
        Ok(
            Batch::new(input_ids.to_dtype(DType::U32)?, y.to_dtype(DType::U32)?)
                .with_mask(Some(counts.to_dtype(DType::F32)?)),
        )
    }

    /// The same batch with a loss mask.
    pub fn with_mask(self, mask: Option<Tensor>) -> Self {
        Batch {
            mask,
            mask_counts: None,
            ..self
        }
    }

    /// The same batch with the loss mask `mask` (`f32 [B, T]`, row-major, as laid out on the
    /// host) copied to `device`, and its counted targets per row summed on the host.
    pub fn with_host_mask(self, mask: Vec<f32>, device: &Device) -> candle_core::Result<Self> {
        let shape = self.y.shape().clone();
        let per_row = match shape.dims() {
            [_, t] if *t > 0 => mask.chunks_exact(*t).map(|r| r.iter().sum()).collect(),
            _ => Vec::new(),
        };
        let host_targets = self.host_targets().map(|ys| {
            let folded = ys.iter().zip(&mask);
            folded
                .map(|(&y, &m)| if m != 0.0 { y } else { IGNORE })
                .collect()
        });
        let mask = crate::transfer::upload(mask, shape, device)?;
        let mask_counts = (!per_row.is_empty()).then(|| MaskCounts {
            mask: mask.id(),
            per_row,
        });
        let host_targets = host_targets.map(|values| HostTargets {
            y: self.y.id(),
            mask: Some(mask.id()),
            values,
        });
        Ok(Batch {
            mask: Some(mask),
            mask_counts,
            host_targets,
            ..self
        })
    }

    /// Counted targets per row (the mask's row sums, or every target): from the host's
    /// counts when the mask came with them, else read back from the device once.
    pub fn row_counts(&self) -> candle_core::Result<Vec<f32>> {
        match (&self.mask, &self.mask_counts) {
            (None, _) => Ok(vec![self.y.dim(1)? as f32; self.y.dim(0)?]),
            (Some(mask), Some(c)) if c.mask == mask.id() => Ok(c.per_row.clone()),
            (Some(mask), _) => crate::transfer::read_vec1(&mask.sum(1)?),
        }
    }

    /// The targets with the mask folded in: [`IGNORE`] where a target does not count (what a
    /// model's head takes, as PyTorch's `ignore_index`).
    pub fn targets(&self) -> candle_core::Result<Tensor> {
        match &self.mask {
            None => Ok(self.y.clone()),
            Some(mask) => {
                let ignore = Tensor::full(IGNORE, self.y.shape(), self.y.device())?;
                mask.ne(0f32)?.where_cond(&self.y, &ignore)
            }
        }
    }

    /// [`Batch::targets`] on the host (flat, row-major) when the data source built them
    /// there and `y` and `mask` are still the tensors it built.
    pub fn host_targets(&self) -> Option<Arc<[u32]>> {
        let h = self.host_targets.as_ref()?;
        let mask = self.mask.as_ref().map(Tensor::id);
        (h.y == self.y.id() && h.mask == mask).then(|| h.values.clone())
    }

    /// The number of targets that count in the loss (the mask's sum, or every target).
    pub fn counted(&self) -> candle_core::Result<f64> {
        match &self.mask {
            None => Ok(self.y.elem_count() as f64),
            Some(_) => Ok(self.row_counts()?.iter().map(|&c| f64::from(c)).sum()),
        }
    }

    /// Rows `start..start + len` of the batch (inputs, targets, mask and the rows' context).
    pub fn narrow(&self, start: usize, len: usize) -> candle_core::Result<Batch> {
        let rows = |t: &Tensor| t.narrow(0, start, len);
        let mask = self.mask.as_ref().map(rows).transpose()?;
        let mask_counts = match (&self.mask, &self.mask_counts, &mask) {
            (Some(m), Some(c), Some(narrowed)) if c.mask == m.id() => Some(MaskCounts {
                mask: narrowed.id(),
                per_row: c.per_row[start..start + len].to_vec(),
            }),
            _ => None,
        };
        let y = rows(&self.y)?;
        let t = self.y.dim(1)?;
        let host_targets = self.host_targets().map(|v| HostTargets {
            y: y.id(),
            mask: mask.as_ref().map(Tensor::id),
            values: v[start * t..(start + len) * t].into(),
        });
        Ok(Batch {
            x: rows(&self.x)?,
            y,
            mask,
            rows: self.rows.narrow(start, len)?,
            mask_counts,
            reference: self.reference.as_ref().map(rows).transpose()?,
            host_targets,
        })
    }
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
    /// only on the arguments and the state `rng` was in.
    fn batch(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        rng: &mut ChaCha8Rng,
        device: &Device,
    ) -> Result<Batch>;

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

/// Kind of data source; serialised in lowercase (`"addition"`, `"char"`, `"byte"`,
/// `"tokenizer"`, `"sft"`, `"chat-task"`, `"shards"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// The embedded multi-digit addition task (no file).
    #[default]
    Addition,
    /// Character-level vocabulary built from a UTF-8 text file.
    Char,
    /// Byte-level vocabulary (256 tokens) over any file.
    Byte,
    /// A Hugging Face `tokenizer.json` applied to a UTF-8 text file.
    Tokenizer,
    /// Supervised fine-tuning records (JSONL) with a Hugging Face tokenizer and its chat
    /// template.
    Sft,
    /// A generated chat task ([`ChatTaskKind`]) with a Hugging Face tokenizer and its chat
    /// template, trained as `sft` data (no file).
    #[serde(rename = "chat-task")]
    ChatTask,
    /// A directory of token shards `trainer prepare` wrote, or nanoGPT's `train.bin` /
    /// `val.bin`, memory-mapped (see [`ShardSource`]).
    Shards,
    /// Preference records (JSONL `prompt` / `chosen` / `rejected`) with a Hugging Face
    /// tokenizer and its chat template, served as pairs for `objective = dpo`
    /// ([`sft::PreferenceSource`]).
    Preference,
}

impl DataKind {
    /// Whether this kind reads a Hugging Face `tokenizer.json` (`tokenizer`, `sft` and
    /// `chat-task`).
    pub fn uses_tokenizer(self) -> bool {
        matches!(
            self,
            DataKind::Tokenizer | DataKind::Sft | DataKind::ChatTask | DataKind::Preference
        )
    }

    /// Whether this kind reads a file named by `data_path` (not `addition` or `chat-task`,
    /// which generate their data).
    pub fn uses_path(self) -> bool {
        !matches!(self, DataKind::Addition | DataKind::ChatTask)
    }
}

named_enum!(DataKind, "data must be addition, char, byte, tokenizer, sft, chat-task, shards or preference", {
    Addition => "addition",
    Char => "char",
    Byte => "byte",
    Tokenizer => "tokenizer",
    Sft => "sft",
    ChatTask => "chat-task",
    Shards => "shards",
    Preference => "preference",
});

/// Configuration of the data source (the `[data]` section of a run config).
///
/// Every field has a default, so a config may give only the ones it changes; the default is
/// the embedded 3-digit addition task.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DataSpec {
    /// Which source to build.
    pub kind: DataKind,
    /// The text (or binary, for `byte`) file; required for `char`, `byte` and `tokenizer`,
    /// must be unset for `addition`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`; required for `tokenizer` and `sft` (whose chat
    /// template and special tokens are read from `chat_template.jinja` /
    /// `tokenizer_config.json` beside it), unused otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Fraction held out for validation, strictly between 0 and 1: the last part of a text
    /// corpus, or the fraction of (unordered) operand pairs held out for `addition`.
    pub val_fraction: f32,
    /// Where tokenised corpora are cached; `None` means [`default_cache_dir`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// `addition`: number of digits of each operand (1 to 9).
    pub digits: usize,
    /// `addition`: seed of the train/held-out split and of the evaluation problems; `sft`:
    /// seed of the train/validation split of the examples.
    pub seed: u64,
    /// `sft`: pack several examples into each row (positions restart and attention stays
    /// within each example) instead of one right-padded example a row.
    pub packing: bool,
    /// `sft`: only the assistant turns / completions count in the loss; `false` trains on
    /// every token.
    pub completion_only: bool,
    /// `chat-task`: which generated task.
    pub chat_task: ChatTaskKind,
    /// `chat-task`: number of generated conversations (both splits).
    pub chat_examples: usize,
    /// Text and shard sources: random windows, or one pass per epoch in a seeded order.
    pub order: DataOrder,
    /// `shards`: packed-document rows (positions restart and attention stays within each
    /// document; needs shards with a document-start stream).
    pub doc_mask: bool,
}

impl Default for DataSpec {
    fn default() -> Self {
        DataSpec {
            kind: DataKind::Addition,
            path: None,
            tokenizer: None,
            val_fraction: 0.1,
            cache_dir: None,
            digits: Addition::DEFAULT_DIGITS,
            seed: 1337,
            packing: true,
            completion_only: true,
            chat_task: ChatTaskKind::default(),
            chat_examples: chat_task::DEFAULT_EXAMPLES,
            order: DataOrder::Random,
            doc_mask: false,
        }
    }
}

impl DataSpec {
    /// Checks the fields that do not need the file system: `val_fraction` range and which paths
    /// each kind needs.
    pub fn validate(&self) -> Result<()> {
        let vf = self.val_fraction;
        if !(vf > 0.0 && vf < 1.0) {
            let subject = match &self.path {
                Some(p) => format!(" for {}", p.display()),
                None => String::new(),
            };
            return Err(Error::Config(format!(
                "val_fraction = {vf}{subject} must be strictly between 0 and 1"
            )));
        }
        match self.kind {
            DataKind::Addition => {
                if let Some(p) = &self.path {
                    return Err(Error::Config(format!(
                        "data_path = {} is set but data = addition (which needs no file); \
                         set --data to char, byte or tokenizer",
                        p.display()
                    )));
                }
                if !(1..=Addition::MAX_DIGITS).contains(&self.digits) {
                    return Err(Error::Config(format!(
                        "digits = {} must be between 1 and {}",
                        self.digits,
                        Addition::MAX_DIGITS
                    )));
                }
            }
            DataKind::ChatTask => {
                if let Some(p) = &self.path {
                    return Err(Error::Config(format!(
                        "data_path = {} is set but data = chat-task (which generates its data)",
                        p.display()
                    )));
                }
                if self.tokenizer.is_none() {
                    return Err(Error::Config(
                        "data = chat-task needs --tokenizer-path (tokenizer_path, a \
                         tokenizer.json with a chat template beside it; by default the \
                         --init-from model's)"
                            .into(),
                    ));
                }
            }
            DataKind::Char
            | DataKind::Byte
            | DataKind::Tokenizer
            | DataKind::Sft
            | DataKind::Shards
            | DataKind::Preference => {
                if self.path.is_none() {
                    let what = match self.kind {
                        DataKind::Sft => "a JSONL or Parquet file",
                        DataKind::Preference => "a JSONL file",
                        DataKind::Shards => "a directory of shards",
                        _ => "a text file",
                    };
                    return Err(Error::Config(format!(
                        "data = {} needs --data-path (data_path, {what})",
                        self.kind
                    )));
                }
                if self.kind.uses_tokenizer() && self.tokenizer.is_none() {
                    return Err(Error::Config(format!(
                        "data = {} needs --tokenizer-path (tokenizer_path, a tokenizer.json \
                         file; by default the --init-from model's)",
                        self.kind
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Builds the data source described by `spec`.
///
/// Text sources read (or load from the cache) and tokenise the whole file here; errors name the
/// file and the problem (missing, empty, invalid UTF-8 for `char`/`tokenizer`, bad
/// `tokenizer.json`...). The block size is not known yet: call
/// [`DataSource::check_block_size`] once it is.
pub fn open(spec: &DataSpec) -> Result<Box<dyn DataSource>> {
    spec.validate()?;
    match spec.kind {
        DataKind::Addition => Ok(Box::new(Addition::new(
            spec.digits,
            spec.val_fraction,
            spec.seed,
        )?)),
        DataKind::Char | DataKind::Byte | DataKind::Tokenizer => {
            Ok(Box::new(TextSource::open(spec)?))
        }
        DataKind::Sft => Ok(Box::new(SftSource::open(spec)?)),
        DataKind::Preference => Ok(Box::new(sft::PreferenceSource::open(spec)?)),
        DataKind::ChatTask => Ok(Box::new(ChatTask::open(spec)?)),
        DataKind::Shards => {
            let dir = spec.path.as_deref().unwrap_or(std::path::Path::new(""));
            let options = ShardOptions {
                order: spec.order,
                doc_mask: spec.doc_mask,
                tokenizer: spec.tokenizer.clone(),
            };
            Ok(Box::new(ShardSource::open(dir, options)?))
        }
    }
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

/// Builds a [`Batch`] from `batch_size` rows of `block_size + 1` tokens laid end to end.
///
/// `target_mask`, if given, has one weight per target, `batch_size * block_size` values.
pub(crate) fn rows_to_batch(
    rows: &[u32],
    target_mask: Option<Vec<f32>>,
    batch_size: usize,
    block_size: usize,
    device: &Device,
) -> Result<Batch> {
    let w = block_size + 1;
    debug_assert_eq!(rows.len(), batch_size * w);
    let mut x = Vec::with_capacity(batch_size * block_size);
    let mut y = Vec::with_capacity(batch_size * block_size);
    for row in rows.chunks_exact(w) {
        x.extend_from_slice(&row[..block_size]);
        y.extend_from_slice(&row[1..]);
    }
    let batch = Batch::from_host(x, y, (batch_size, block_size), device)?;
    Ok(match target_mask {
        Some(m) => batch.with_host_mask(m, device)?,
        None => batch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_spec_is_addition_and_valid() {
        let spec = DataSpec::default();
        assert_eq!(spec.kind, DataKind::Addition);
        spec.validate().unwrap();
        let src = open(&spec).unwrap();
        assert!(src.task().is_some());
    }

    #[test]
    fn spec_serde_round_trip_and_lowercase_kinds() {
        for kind in [
            DataKind::Addition,
            DataKind::Char,
            DataKind::Byte,
            DataKind::Tokenizer,
            DataKind::Sft,
            DataKind::ChatTask,
            DataKind::Shards,
        ] {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{kind}\""));
        }
        let spec = DataSpec {
            kind: DataKind::Char,
            path: Some("a.txt".into()),
            ..DataSpec::default()
        };
        let json = serde_json::to_string(&spec).unwrap();
        let back: DataSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
        // Missing fields take their defaults.
        let partial: DataSpec = serde_json::from_str(r#"{"kind":"byte","path":"x"}"#).unwrap();
        assert_eq!(partial.val_fraction, DataSpec::default().val_fraction);
        assert!(serde_json::from_str::<DataSpec>(r#"{"knd":"byte"}"#).is_err());
    }

    #[test]
    fn val_fraction_outside_open_interval_is_rejected() {
        for vf in [0.0, 1.0, -0.1, 1.5, f32::NAN] {
            let spec = DataSpec {
                kind: DataKind::Char,
                path: Some("corpus.txt".into()),
                val_fraction: vf,
                ..DataSpec::default()
            };
            let err = open(&spec).err().expect("must fail").to_string();
            assert!(err.contains("val_fraction"), "{err}");
            assert!(err.contains("corpus.txt"), "{err}");
        }
    }

    #[test]
    fn missing_paths_are_config_errors() {
        let no_path = DataSpec {
            kind: DataKind::Byte,
            ..DataSpec::default()
        };
        assert!(open(&no_path)
            .err()
            .unwrap()
            .to_string()
            .contains("data_path"));
        let no_tok = DataSpec {
            kind: DataKind::Tokenizer,
            path: Some("a.txt".into()),
            ..DataSpec::default()
        };
        let err = open(&no_tok).err().unwrap().to_string();
        assert!(err.contains("tokenizer_path"), "{err}");
        let addition_with_path = DataSpec {
            path: Some("a.txt".into()),
            ..DataSpec::default()
        };
        let err = open(&addition_with_path).err().unwrap().to_string();
        assert!(err.contains("a.txt"), "{err}");
        let zero_digits = DataSpec {
            digits: 0,
            ..DataSpec::default()
        };
        assert!(open(&zero_digits).is_err());
    }

    #[test]
    fn rows_to_batch_shifts_by_one() {
        let rows: Vec<u32> = (0..2 * 5).collect();
        let b = rows_to_batch(&rows, None, 2, 4, &Device::Cpu).unwrap();
        assert_eq!(
            b.x.to_vec2::<u32>().unwrap(),
            vec![vec![0, 1, 2, 3], vec![5, 6, 7, 8]]
        );
        assert_eq!(
            b.y.to_vec2::<u32>().unwrap(),
            vec![vec![1, 2, 3, 4], vec![6, 7, 8, 9]]
        );
        assert!(b.mask.is_none());
    }
}
