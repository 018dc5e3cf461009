//! The preference data source ([`DataKind::Preference`](crate::DataKind::Preference)):
//! preference records from a JSONL file, served as batches of pairs for DPO.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use candle_core::Device;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::preference::{preference_batch, read_preferences, LinePreference, PreferencePair};
use super::records::at_line;
use super::{open_records, split_examples, SftEncoder};
use crate::error::{Error, Result};
use crate::shards::format::{tokenizer_vocab_hash, Manifest, MANIFEST_FILE};
use crate::shards::pairs::read_pairs;
use crate::{check_shape, Batch, BatchRequest, DataSource, DataSpec, Fingerprint, Split};

/// Preference pairs from a JSONL file (see [`super::read_preferences`]), split into train and
/// validation pairs, served as batches whose rows `2i`, `2i + 1` are a pair's chosen and
/// rejected sequences (a batch of an odd number of rows ends with a chosen row alone).
///
/// Each sequence is cut to `block_size + 1` tokens keeping the start (TRL's `max_length`
/// with `keep_start`), and pairs whose prompt alone fills them are never drawn (counted and
/// logged once, as TRL drops them).
pub struct PreferenceSource {
    path: PathBuf,
    encoder: SftEncoder,
    pairs: Vec<PreferencePair>,
    lines: Vec<usize>,
    train: Vec<usize>,
    val: Vec<usize>,
    vocab_size: usize,
    description: String,
    fingerprint: Fingerprint,
    /// The block size whose dropped pairs were logged last (+1; 0: none yet).
    logged_block: AtomicUsize,
    /// Each pair's reference values (chosen, rejected), once computed (see
    /// [`PreferenceSource::set_reference`]).
    reference: OnceLock<Vec<[f32; 2]>>,
}

impl PreferenceSource {
    /// Reads and tokenises `spec.path` with `spec.tokenizer` (and the chat template beside
    /// it); `val_fraction` of the pairs (at least one) go to validation, chosen by `spec.seed`.
    pub fn open(spec: &DataSpec) -> Result<Self> {
        open_records(spec, read_preferences, Self::from_records)
    }

    /// Tokenises `records` (read from `path`) with `encoder`; the split comes from `spec`.
    pub fn from_records(
        path: &Path,
        encoder: SftEncoder,
        records: &[LinePreference],
        spec: &DataSpec,
    ) -> Result<Self> {
        let mut pairs = Vec::with_capacity(records.len());
        let mut lines = Vec::with_capacity(records.len());
        for r in records {
            let pair = encoder
                .encode_preference(&r.record)
                .map_err(at_line(path, r.line))?;
            pairs.push(pair);
            lines.push(r.line);
        }
        let what = "preference pairs";
        Self::from_pairs(path, encoder, (pairs, lines), None, spec, what)
    }

    /// The pairs of a directory `trainer prepare --format preference` wrote (`spec.path`;
    /// `data = shards`), read whole, tokenised with `spec.tokenizer` or the manifest's
    /// tokenizer (the same vocabulary). Its train and validation shards are the split; a
    /// directory prepared without validation pairs (`--val-fraction 0`) is split as `data =
    /// preference` splits a file (`spec.val_fraction`, `spec.seed`), so that it trains as
    /// that file does.
    pub fn open_shards(spec: &DataSpec) -> Result<Self> {
        let dir = spec.path.clone().unwrap_or_default();
        let manifest = Manifest::read(&dir)?;
        let at = dir.join(MANIFEST_FILE);
        let Some(tok) = spec.tokenizer.clone().or(manifest.tokenizer.path.clone()) else {
            return Err(Error::data(
                &at,
                "names no tokenizer.json; give --tokenizer-path",
            ));
        };
        let encoder = SftEncoder::open(&tok)?;
        let hash = format!("{:016x}", tokenizer_vocab_hash(encoder.tokenizer()));
        if hash != manifest.tokenizer.hash {
            return Err(Error::data(
                &dir,
                format!(
                    "was prepared with another vocabulary (hash {}) than {} (hash {hash}); \
                     prepare it again or give its tokenizer",
                    manifest.tokenizer.hash,
                    tok.display()
                ),
            ));
        }
        let train = read_pairs(&dir, &manifest, Split::Train)?;
        let val = read_pairs(&dir, &manifest, Split::Val)?;
        let (n_train, n) = (train.len(), train.len() + val.len());
        let split = (!val.is_empty()).then(|| ((0..n_train).collect(), (n_train..n).collect()));
        let (lines, pairs) = train.into_iter().chain(val).unzip();
        let what = match split {
            Some(_) => "preference pairs (prepared shards, their split)",
            None => "preference pairs (prepared shards)",
        };
        Self::from_pairs(&dir, encoder, (pairs, lines), split, spec, what)
    }

    /// The source over tokenised `pairs` and the lines they were read from (of `path`, named
    /// in errors and logs), split as `split` says (train and validation indices, ascending)
    /// or else by `spec`; `what` describes them.
    fn from_pairs(
        path: &Path,
        encoder: SftEncoder,
        (pairs, lines): (Vec<PreferencePair>, Vec<usize>),
        split: Option<(Vec<usize>, Vec<usize>)>,
        spec: &DataSpec,
        what: &str,
    ) -> Result<Self> {
        let n = pairs.len();
        if n < 2 {
            return Err(Error::data(
                path,
                format!("{n} preference record(s); a train and a validation split need at least 2"),
            ));
        }
        let (train, val) = split.unwrap_or_else(|| split_examples(n, spec));
        let max_id = pairs
            .iter()
            .flat_map(|p| p.chosen.iter().chain(&p.rejected))
            .max()
            .map_or(0, |&m| m as usize + 1);
        let vocab_size = encoder.tokenizer().get_vocab_size(true).max(max_id);
        let mut stream = Vec::new();
        for (i, p) in pairs.iter().enumerate() {
            stream.push(p.prompt_len as u32);
            stream.push(u32::from(val.binary_search(&i).is_ok()));
            for side in [&p.chosen, &p.rejected] {
                stream.push(side.len() as u32);
                stream.extend_from_slice(side);
            }
        }
        let vocab_hash = tokenizer_vocab_hash(encoder.tokenizer());
        let fingerprint = Fingerprint::of_tokens(&stream, train.len(), vocab_hash);
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let description = format!(
            "{name}: {n} {what}, {} train / {} val",
            train.len(),
            val.len()
        );
        Ok(PreferenceSource {
            path: path.to_path_buf(),
            encoder,
            pairs,
            lines,
            train,
            val,
            vocab_size,
            description,
            fingerprint,
            logged_block: AtomicUsize::new(0),
            reference: OnceLock::new(),
        })
    }

    /// The pairs (both splits, file order), uncut.
    pub fn pairs(&self) -> &[PreferencePair] {
        &self.pairs
    }

    /// The line of the file pair `i` was read from.
    pub fn line(&self, i: usize) -> usize {
        self.lines[i]
    }

    /// Pair `i` as a batch of its two rows, cut and padded as training batches are at
    /// `block_size`.
    pub fn pair_batch(&self, i: usize, block_size: usize, device: &Device) -> Result<Batch> {
        let p = self.pairs[i].cut(block_size + 1);
        preference_batch(&[&p], block_size, self.encoder.pad_id(), device)
    }

    /// Sets each pair's reference values (file order; the summed log-probabilities of its
    /// chosen and rejected completions), computed once before training: every batch carries
    /// its rows' values from then on ([`Batch::reference`]). An error when the count differs
    /// or they are already set.
    pub fn set_reference(&self, values: Vec<[f32; 2]>) -> Result<()> {
        if values.len() != self.pairs.len() {
            return Err(Error::data(
                &self.path,
                format!(
                    "{} reference values for {} preference pairs",
                    values.len(),
                    self.pairs.len()
                ),
            ));
        }
        self.reference
            .set(values)
            .map_err(|_| Error::data(&self.path, "the reference values are already set"))
    }

    /// Whether the pairs' reference values are set.
    pub fn has_reference(&self) -> bool {
        self.reference.get().is_some()
    }

    /// The pairs of `split` that keep a completion token in `block_size + 1` tokens.
    fn pool(&self, split: Split, block_size: usize) -> Vec<usize> {
        let all = match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        };
        all.iter()
            .copied()
            .filter(|&i| self.pairs[i].prompt_len <= block_size)
            .collect()
    }

    /// Logs (once per block size) how many pairs are dropped because their prompt fills
    /// `block_size + 1` tokens; an error when no training pair is left.
    fn check_dropped(&self, block_size: usize) -> Result<()> {
        if self.pool(Split::Train, block_size).is_empty() {
            return Err(Error::data(
                &self.path,
                format!(
                    "every training pair's prompt fills block_size + 1 = {} tokens; raise \
                     --block-size",
                    block_size + 1
                ),
            ));
        }
        if self.logged_block.swap(block_size + 1, Ordering::Relaxed) == block_size + 1 {
            return Ok(());
        }
        let dropped = self
            .pairs
            .iter()
            .filter(|p| p.prompt_len > block_size)
            .count();
        if dropped > 0 {
            tracing::info!(
                "{}: {dropped} of {} preference pairs dropped: their prompt alone fills \
                 block_size + 1 = {} tokens",
                self.path.display(),
                self.pairs.len(),
                block_size + 1
            );
        }
        Ok(())
    }
}

impl DataSource for PreferenceSource {
    source_methods!(fields);

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        let (split, batch_size, block_size) = (want.split, want.batch_size, want.block_size);
        let mut pool = self.pool(split, block_size);
        if pool.is_empty() {
            // every pair of the split dropped at this length (a short sampling prompt, a
            // small validation split): its pairs cut anyway, their completions not counted
            pool = match split {
                Split::Train => self.train.clone(),
                Split::Val => self.val.clone(),
            };
        }
        let picked: Vec<usize> = (0..batch_size.div_ceil(2))
            .map(|_| pool[rng.random_range(0..pool.len())])
            .collect();
        let cut: Vec<PreferencePair> = picked
            .iter()
            .map(|&i| self.pairs[i].cut(block_size + 1))
            .collect();
        let refs: Vec<&PreferencePair> = cut.iter().collect();
        let mut batch = preference_batch(&refs, block_size, self.encoder.pad_id(), want.device)?;
        if let Some(table) = self.reference.get() {
            let values: Vec<f32> = picked.iter().flat_map(|&i| table[i]).collect();
            let rows = values.len();
            batch.reference = Some(crate::transfer::upload(values, rows, want.device)?);
        }
        Ok(if batch_size % 2 == 1 {
            batch.narrow(0, batch_size)?
        } else {
            batch
        })
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encoder.tokenize(text, false)?.0)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.encoder.file.decode(ids)
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        check_shape(1, block_size)?;
        self.check_dropped(block_size)
    }

    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn preferences(&self) -> Option<&PreferenceSource> {
        Some(self)
    }
}
