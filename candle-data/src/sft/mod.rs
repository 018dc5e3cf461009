//! Supervised fine-tuning data ([`DataKind::Sft`](super::DataKind::Sft)): chat
//! conversations, prompt/completion pairs or plain text from a JSONL file, tokenised as TRL's
//! `SFTTrainer` does, with a loss mask over the parts the model learns to write.
//!
//! - `{"messages": [...]}`: rendered with the model's chat template ([`ChatTemplate`]); the
//!   loss covers the assistant turns, their end-of-turn token included.
//! - `{"prompt", "completion"}` (strings, or lists of messages rendered with the template):
//!   the loss covers the completion, i.e. the tokens after the common prefix of the tokenised
//!   prompt and the tokenised prompt + completion (TRL's rule).
//! - `{"text"}`: every token counts.
//!
//! Text and string completions get the tokenizer's EOS appended when they do not end with it
//! (TRL does the same) and are tokenised with the tokenizer's post-processor (its BOS, as
//! `tokenizer(text)` does in TRL); rendered conversations are tokenised without it, since the
//! template writes its own BOS (`apply_chat_template(tokenize=True)` passes
//! `add_special_tokens=False`).
//!
//! A batch either packs several examples into each row (best-fit decreasing, positions
//! restarting and a document id per example: TRL's padding-free `bfd` packing) or puts one
//! example in each row, right-padded; see [`DataSpec::packing`].

mod chat_prompt;
mod encoder;
mod jinja;
mod layout;
pub(crate) mod preference;
mod preference_source;
pub(crate) mod records;
mod template;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::shards::format::tokenizer_vocab_hash;
use super::{
    check_shape, decimal_f64, Batch, BatchRequest, DataSource, DataSpec, Fingerprint, Split,
};
use crate::error::{Error, Result};
use crate::{HostTokens, Rows};

pub use encoder::{Example, SftEncoder};
pub use preference::{
    preference_batch, read_preferences, LinePreference, Preference, PreferencePair, Preferences,
    Turns,
};
pub use preference_source::PreferenceSource;
pub(crate) use records::{at_line, parse_line};
pub use records::{parse_messages, parse_records, LineRecord, Message, Record, Role};
pub use template::{ChatTemplate, Rendered};

/// Reads a file of records (see the module docs): JSONL a line at a time (a line longer than
/// [`MAX_LINE_BYTES`](crate::lines::MAX_LINE_BYTES) is refused naming `file:line` before
/// it is read whole), or a `.parquet` file's rows from the columns of the same names
/// (`messages` a list of `{role, content}` structs), a row group at a time.
pub fn read_records(path: &Path) -> Result<Vec<LineRecord>> {
    match crate::parquet::is_parquet(path) {
        true => records::no_records(crate::parquet::read_records(path)?, path),
        false => records::read_jsonl_records(path),
    }
}

/// Supervised fine-tuning examples from a JSONL file, split into train and validation
/// examples, served as packed or padded batches with a loss mask.
///
/// Built by [`super::open`] for [`DataKind::Sft`](super::DataKind::Sft).
pub struct SftSource {
    path: PathBuf,
    encoder: SftEncoder,
    examples: Vec<Example>,
    /// The line of the file each example was read from.
    lines: Vec<usize>,
    train: Vec<usize>,
    val: Vec<usize>,
    packing: bool,
    vocab_size: usize,
    description: String,
    fingerprint: Fingerprint,
    warned_truncation: AtomicBool,
}

/// The source `from` makes of the records `read` reads from `spec.path`, encoded with
/// `spec.tokenizer` (and the chat template beside it), once `spec` is validated.
pub(crate) fn open_records<R, S>(
    spec: &DataSpec,
    read: fn(&Path) -> Result<Vec<R>>,
    from: fn(&Path, SftEncoder, &[R], &DataSpec) -> Result<S>,
) -> Result<S> {
    spec.validate()?;
    let (Some(path), Some(tok)) = (&spec.path, &spec.tokenizer) else {
        return Err(Error::Config(format!(
            "data = {} needs --data-path and --tokenizer-path",
            spec.kind
        )));
    };
    from(path, SftEncoder::open(tok)?, &read(path)?, spec)
}

impl SftSource {
    /// Reads and tokenises `spec.path` with `spec.tokenizer` (and the chat template beside
    /// it), and splits the examples (`val_fraction` of them, at least one, chosen by
    /// `spec.seed`, go to validation).
    pub fn open(spec: &DataSpec) -> Result<Self> {
        open_records(spec, read_records, Self::from_records)
    }

    /// Tokenises `records` (read from `path`) with `encoder`; the split, packing and loss
    /// options come from `spec`.
    pub fn from_records(
        path: &Path,
        encoder: SftEncoder,
        records: &[LineRecord],
        spec: &DataSpec,
    ) -> Result<Self> {
        let (examples, lines, formats) =
            encode_records(path, &encoder, records, spec.completion_only)?;
        let n = examples.len();
        if n < 2 {
            return Err(Error::data(
                path,
                format!("{n} usable example(s); a train and a validation split need at least 2"),
            ));
        }
        let (train, val) = split_examples(n, spec);
        let max_id = examples
            .iter()
            .flat_map(|e| e.tokens.iter())
            .max()
            .map_or(0, |&m| m as usize + 1);
        let vocab_size = encoder.tokenizer().get_vocab_size(true).max(max_id);
        let tokens: usize = examples.iter().map(|e| e.tokens.len()).sum();
        let counted: usize = examples.iter().map(Example::counted_targets).sum();
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let template = match encoder.template() {
            Some(t) => format!("chat template {}", t.origin().display()),
            None => "no chat template".to_string(),
        };
        let description = format!(
            "{name}: {n} examples ({}), {tokens} tokens, {counted} counted targets, {} train / \
             {} val examples, {template}, {}{}",
            formats.join(", "),
            train.len(),
            val.len(),
            if spec.packing { "packed" } else { "padded" },
            if spec.completion_only {
                ""
            } else {
                ", every token trained on"
            }
        );
        let fingerprint = fingerprint_of(&examples, &val, train.len(), &encoder);
        Ok(SftSource {
            path: path.to_path_buf(),
            encoder,
            examples,
            lines,
            train,
            val,
            packing: spec.packing,
            vocab_size,
            description,
            fingerprint,
            warned_truncation: AtomicBool::new(false),
        })
    }

    /// The examples of `split`, in file order.
    pub fn examples(&self, split: Split) -> impl Iterator<Item = &Example> {
        self.indices(split).iter().map(|&i| &self.examples[i])
    }

    /// Every example, in record order (skipped records left out).
    pub fn all_examples(&self) -> &[Example] {
        &self.examples
    }

    /// Number of examples (both splits).
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    /// Whether there are no examples (never, for an opened source).
    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// Example `i` of [`SftSource::all_examples`].
    pub fn example(&self, i: usize) -> &Example {
        &self.examples[i]
    }

    /// Indices into [`SftSource::all_examples`] of the examples of `split`, ascending.
    pub fn indices(&self, split: Split) -> &[usize] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Number of examples (both splits) longer than `block_size + 1` tokens, which batches
    /// cut to their first `block_size + 1` tokens.
    pub fn truncated(&self, block_size: usize) -> usize {
        self.examples
            .iter()
            .filter(|e| e.tokens.len() > block_size + 1)
            .count()
    }

    /// The encoder the examples were made with.
    pub fn encoder(&self) -> &SftEncoder {
        &self.encoder
    }

    /// Checks the targets the model actually sees: each example cut to `block_size` inputs (as
    /// batches cut it). Records left with no target in the loss are reported (how many, the
    /// first lines); if no training example keeps one, every step would train on nothing
    /// (loss 0, gradient 0), and that is an error.
    pub fn check_targets_kept(&self, block_size: usize) -> Result<()> {
        let kept = |ex: &Example| {
            let n = layout::input_len(ex, block_size);
            ex.counted[1..=n].iter().any(|&c| c)
        };
        let lost: Vec<usize> = (0..self.examples.len())
            .filter(|&i| !kept(&self.examples[i]))
            .collect();
        if lost.is_empty() {
            return Ok(());
        }
        const SHOWN: usize = 5;
        let mut at: Vec<String> = lost
            .iter()
            .take(SHOWN)
            .map(|&i| self.lines[i].to_string())
            .collect();
        if lost.len() > SHOWN {
            at.push("...".into());
        }
        let longest = self
            .examples
            .iter()
            .map(|e| e.tokens.len())
            .max()
            .unwrap_or(0);
        let what = format!(
            "{} of {} records keep no target in the loss once cut to block_size + 1 = {} tokens \
             (line {})",
            lost.len(),
            self.examples.len(),
            block_size + 1,
            at.join(", ")
        );
        let fix = format!(
            "raise --block-size (the longest record is {longest} tokens) or shorten the records \
             so that their answers fit"
        );
        if self.train.iter().all(|i| lost.binary_search(i).is_ok()) {
            return Err(Error::data(
                &self.path,
                format!(
                    "no training record keeps a target in the loss: {what}; every step would \
                     train on nothing (loss 0); {fix}"
                ),
            ));
        }
        tracing::warn!(
            "{}: {what}: they train on nothing; {fix}",
            self.path.display()
        );
        Ok(())
    }

    fn warn_truncation(&self, block_size: usize) {
        if self.warned_truncation.load(Ordering::Relaxed) {
            return;
        }
        let n = self.truncated(block_size);
        if n > 0 && !self.warned_truncation.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{}: {n} of {} examples are longer than block_size + 1 = {} tokens and are cut \
                 to their start",
                self.path.display(),
                self.examples.len(),
                block_size + 1
            );
        }
    }
}

/// `records` tokenised with `encoder` (every token counted unless `completion_only`), those
/// with fewer than 2 tokens or no counted target left out with a warning; with the line each
/// example was read from and the record formats met, in order.
fn encode_records<'r>(
    path: &Path,
    encoder: &SftEncoder,
    records: &'r [LineRecord],
    completion_only: bool,
) -> Result<(Vec<Example>, Vec<usize>, Vec<&'r str>)> {
    let mut examples = Vec::with_capacity(records.len());
    let mut lines = Vec::with_capacity(records.len());
    let mut skipped = 0usize;
    let mut formats: Vec<&str> = Vec::new();
    for r in records {
        let mut ex = encoder
            .encode_record(&r.record)
            .map_err(at_line(path, r.line))?;
        if !completion_only {
            ex.counted.iter_mut().for_each(|c| *c = true);
        }
        if ex.tokens.len() < 2 || ex.counted_targets() == 0 {
            skipped += 1;
            continue;
        }
        if !formats.contains(&r.record.format()) {
            formats.push(r.record.format());
        }
        examples.push(ex);
        lines.push(r.line);
    }
    if skipped > 0 {
        tracing::warn!(
            "{}: {skipped} record(s) skipped (fewer than 2 tokens or no target in the loss)",
            path.display()
        );
    }
    Ok((examples, lines, formats))
}

/// The train and validation indices of `n >= 2` examples (or preference pairs):
/// `spec.val_fraction` of them (at least one, at most `n - 1`) chosen by `spec.seed` for
/// validation; each list sorted.
fn split_examples(n: usize, spec: &DataSpec) -> (Vec<usize>, Vec<usize>) {
    let n_val = ((n as f64) * decimal_f64(spec.val_fraction)).round() as usize;
    let n_val = n_val.clamp(1, n - 1);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(spec.seed));
    let mut val = order[..n_val].to_vec();
    let mut train = order[n_val..].to_vec();
    val.sort_unstable();
    train.sort_unstable();
    (train, val)
}

/// The fingerprint of `examples` (each one's length, split, tokens and counted flags) under
/// the encoder's tokenizer.
fn fingerprint_of(
    examples: &[Example],
    val: &[usize],
    n_train: usize,
    encoder: &SftEncoder,
) -> Fingerprint {
    let mut is_val = vec![false; examples.len()];
    for &i in val {
        is_val[i] = true;
    }
    let tokens: usize = examples.iter().map(|e| e.tokens.len()).sum();
    let mut stream = Vec::with_capacity(2 * tokens + 2 * examples.len());
    for (ex, v) in examples.iter().zip(&is_val) {
        stream.push(ex.tokens.len() as u32);
        stream.push(u32::from(*v));
        stream.extend_from_slice(&ex.tokens);
        stream.extend(ex.counted.iter().map(|&c| u32::from(c)));
    }
    let vocab_hash = tokenizer_vocab_hash(encoder.tokenizer());
    Fingerprint::of_tokens(&stream, n_train, vocab_hash)
}

impl DataSource for SftSource {
    source_methods!(fields);

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        let (split, batch_size, block_size) = (want.split, want.batch_size, want.block_size);
        self.warn_truncation(block_size);
        let pool = self.indices(split);
        let mut draw = || &self.examples[pool[rng.random_range(0..pool.len())]];
        let pad = self.encoder.pad_id();
        let l = if self.packing {
            // Draw until the examples would fill every row and place them best-fit
            // decreasing (those that fit nowhere are left out); then fill the gaps best-fit
            // with further draws, until the rows are full or `batch_size` draws in a row fit
            // nowhere (those are left out).
            let capacity = batch_size * block_size;
            let mut drawn = Vec::new();
            let mut total = 0;
            while total < capacity {
                let ex = draw();
                total += layout::input_len(ex, block_size);
                drawn.push(ex);
            }
            let lens: Vec<usize> = drawn
                .iter()
                .map(|e| layout::input_len(e, block_size))
                .collect();
            let mut packer = layout::Packer::new(batch_size, block_size);
            packer.place_decreasing(&lens);
            let mut misses = 0;
            while !packer.is_full() && misses < batch_size {
                let ex = draw();
                if packer.place(drawn.len(), layout::input_len(ex, block_size)) {
                    drawn.push(ex);
                    misses = 0;
                } else {
                    misses += 1;
                }
            }
            layout::packed(&drawn, packer.into_rows(), block_size, pad)
        } else {
            let drawn: Vec<&Example> = (0..batch_size).map(|_| draw()).collect();
            layout::padded(&drawn, block_size, pad)
        };
        let shape = (batch_size, block_size);
        let u32s = |v: Vec<u32>| crate::transfer::upload(v, shape, want.device);
        let rows = Rows {
            positions: l.positions.map(u32s).transpose()?,
            doc_ids: l.doc_ids.map(u32s).transpose()?,
            tokens: Some(HostTokens::new(l.x.clone(), block_size)),
        };
        let mut batch =
            Batch::from_host(l.x, l.y, shape, want.device)?.with_host_mask(l.mask, want.device)?;
        batch.rows = rows;
        Ok(batch)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encoder.tokenize(text, false)?.0)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::data(
                &self.path,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        self.encoder.file.decode(ids)
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        check_shape(1, block_size)?;
        self.check_targets_kept(block_size)?;
        self.warn_truncation(block_size);
        Ok(())
    }

    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }
}

#[cfg(test)]
mod tests;
