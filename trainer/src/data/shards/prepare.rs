//! `trainer prepare`: text, JSONL or SFT records → token shards, streaming, in parallel,
//! deterministic and resumable.
//!
//! - **Streaming**: files are read in units of about [`PrepareOptions::chunk_bytes`] (whole
//!   lines); a window of units is tokenised at a time, and each split holds at most one shard
//!   in memory.
//! - **Deterministic**: units are cut by a rule on the bytes alone, documents are ordered by
//!   (file order, position in file), each split's token stream is cut every
//!   [`PrepareOptions::shard_tokens`] tokens, and a document goes to validation iff
//!   `splitmix64(index ^ VAL_SEED) < val_fraction * 2^64`. The thread count changes nothing.
//! - **Parquet** files (by extension, or [`PrepareOptions::container`]) are read a row group
//!   at a time, each row a record with the format's columns (see [`Container`]);
//!   units end at row group ends, and a resume point is a row.
//! - **Resumable**: shards are written to a temporary name and renamed; after each unit in
//!   which a shard was finished, the unfinished shard of each split is saved as a
//!   `partial-*.tok` file and `progress.json` records the finished shards, the partial ones
//!   and the end of that unit. A rerun verifies them by checksum, reloads the partial shards
//!   and continues from there (so a small validation split, whose one shard fills last, does
//!   not send it back to the first file), and ends by writing `manifest.json` (last) and
//!   removing `progress.json` and the partial files.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::encode::{build_encoder, Encoder, Piece};
use super::format::{
    width_for_vocab, Expect, InputEntry, Manifest, ShardEntry, ShardWriter, TokenizerInfo,
    MANIFEST_FILE, MANIFEST_FORMAT,
};
use super::input::{expand_inputs, parquet_files, start, unit_reader, Unit};
use super::plan;
use super::progress::{
    clear, load_partial, remove_partials, remove_temporaries, save_progress, verify_all, Progress,
    SplitState,
};
use crate::data::parquet::is_parquet;
use crate::error::{Error, Result};
use crate::hash::splitmix64;

pub use super::progress::PROGRESS_FILE;
/// Seed of the validation rule (see the module docs).
pub const VAL_SEED: u64 = 0x5eed_da7a;
/// Bumped whenever the way inputs become tokens changes.
const PREPARE_VERSION: u32 = 1;

/// How input files are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// Plain UTF-8 text: each file is one document.
    #[default]
    Text,
    /// JSON lines: each non-blank line is a document, its text in [`PrepareOptions::field`].
    Jsonl,
    /// SFT records (TRL `messages`, `prompt`/`completion`, `text`) rendered with the chat
    /// template and masked as [`SftEncoder`](crate::data::sft::SftEncoder) does; shards carry the loss mask. No EOS is
    /// appended (the encoder ends examples itself).
    Sft,
}

impl InputFormat {
    /// The format of `inputs` (files, directories, globs) when none is given: JSON lines (a
    /// document a record, its [`PrepareOptions::field`]) when every file they name ends in
    /// `.jsonl`, `.json` or `.parquet`, else text.
    pub fn detect(inputs: &[PathBuf]) -> Result<Self> {
        let files = super::input::expand_inputs(inputs)?;
        let jsonl = files.iter().all(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("jsonl") | Some("json") | Some("parquet")
            )
        });
        Ok(match jsonl {
            true => InputFormat::Jsonl,
            false => InputFormat::Text,
        })
    }
}

named_enum!(InputFormat, "--format must be text, jsonl or sft", {
    Text => "text",
    Jsonl => "jsonl",
    Sft => "sft",
});

/// How input files are stored (`trainer prepare --input-format`); what their records are is
/// the [`InputFormat`]. A Parquet file holds rows: with `text` and `jsonl` formats, each row
/// is a document (its [`PrepareOptions::field`] column); with `sft`, each row is a record.
///
/// ```
/// use trainer::data::shards::{Container, PrepareOptions};
///
/// let opts = PrepareOptions {
///     container: "parquet".parse::<Container>().map_err(trainer::Error::Config)?,
///     ..PrepareOptions::default()
/// };
/// assert_eq!(opts.container.to_string(), "parquet");
/// # Ok::<(), trainer::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Container {
    /// By extension: `.parquet` files are Parquet, others text or JSON lines as the format
    /// says.
    #[default]
    Auto,
    /// Every file is Parquet.
    Parquet,
    /// Every file is JSON lines (`jsonl` and `sft` formats).
    Jsonl,
    /// Every file is plain text (`text` format).
    Text,
}

named_enum!(Container, "--input-format must be auto, parquet, jsonl or text", {
    Auto => "auto",
    Parquet => "parquet",
    Jsonl => "jsonl",
    Text => "text",
});

/// The vocabulary tokens come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VocabSpec {
    /// A Hugging Face `tokenizer.json`.
    Tokenizer(PathBuf),
    /// The sorted unique characters of the inputs (an extra pass over them).
    Char,
    /// One token a byte.
    Byte,
}

/// What `prepare` does.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Files, directories or globs, read in this order.
    pub inputs: Vec<PathBuf>,
    /// The directory shards and `manifest.json` go to.
    pub out_dir: PathBuf,
    /// What the records of the files are.
    pub format: InputFormat,
    /// How the files are stored (by extension by default).
    pub container: Container,
    /// JSONL: the field holding the text.
    pub field: String,
    /// The vocabulary.
    pub vocab: VocabSpec,
    /// The EOS token text (default: `tokenizer_config.json`'s `eos_token`, else
    /// `<|endoftext|>`, else `</s>`). Char and byte vocabularies append none.
    pub eos_token: Option<String>,
    /// Tokens a shard (the last of each split may be shorter).
    pub shard_tokens: u64,
    /// Fraction of documents held out for validation, in `[0, 1)`.
    pub val_fraction: f64,
    /// Worker threads (0: one a core). Changes nothing in the output.
    pub threads: usize,
    /// Bytes of input tokenised as one unit (part of the output's identity for text files).
    pub chunk_bytes: usize,
    /// Replace a directory prepared with other inputs or settings.
    pub overwrite: bool,
    /// JSONL and SFT: the longest line, in bytes (a longer one is refused naming `file:line`
    /// before it is read whole; see [`crate::data::lines`]).
    pub max_line_bytes: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            inputs: Vec::new(),
            out_dir: PathBuf::from("prepared"),
            format: InputFormat::Text,
            container: Container::Auto,
            field: "text".into(),
            vocab: VocabSpec::Byte,
            eos_token: None,
            shard_tokens: 100_000_000,
            val_fraction: 0.0,
            threads: 0,
            chunk_bytes: 1 << 20,
            overwrite: false,
            max_line_bytes: crate::data::lines::MAX_LINE_BYTES,
        }
    }
}

/// Where `prepare` is, for a progress bar.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrepareProgress {
    /// Input bytes read so far (counting those before a resume point).
    pub bytes_done: u64,
    /// Input bytes in all.
    pub bytes_total: u64,
    /// Tokens made by this call.
    pub tokens: u64,
    /// Shards finished (both splits, resumed ones included).
    pub shards: usize,
}

/// What `prepare` did.
#[derive(Clone, Debug)]
pub struct PrepareSummary {
    /// The manifest written.
    pub manifest: Manifest,
    /// Finished shards kept from an earlier, interrupted run.
    pub resumed_shards: usize,
    /// Whether the directory was already fully prepared (nothing was done).
    pub up_to_date: bool,
    /// Input bytes read by this call.
    pub bytes_read: u64,
    /// Tokens made by this call.
    pub tokens_made: u64,
}

const SPLITS: [&str; 2] = ["train", "val"];

/// One split's token stream being cut into shards.
struct Stream {
    name: &'static str,
    writer: ShardWriter,
    /// Tokens emitted to this stream so far (skipped ones included).
    pos: u64,
    /// Tokens before this belong to finished shards (resume).
    skip_until: u64,
    done: Vec<ShardEntry>,
}

struct Cutter<'a> {
    dir: &'a Path,
    shard_tokens: u64,
    width: u32,
    vocab: u64,
    mask: bool,
    streams: [Stream; 2],
    doc: u64,
    in_val: bool,
    val_below: u64,
    finished_now: bool,
}

impl Stream {
    /// What a progress save records of this split.
    fn state(&self) -> SplitState<'_> {
        (self.name, &self.done, &self.writer)
    }
}

impl Cutter<'_> {
    fn new_writer(&self) -> ShardWriter {
        ShardWriter::new(self.width, self.vocab, true, self.mask)
    }

    fn is_val(&self, doc: u64) -> bool {
        splitmix64(doc ^ VAL_SEED) < self.val_below
    }

    fn feed(&mut self, pieces: Vec<Piece>) -> Result<u64> {
        let mut made = 0;
        for p in pieces {
            if p.starts {
                self.in_val = self.is_val(self.doc);
                self.doc += 1;
            }
            made += p.tokens.len() as u64;
            let s = usize::from(self.in_val);
            self.push(s, &p.tokens, p.counted.as_deref(), p.starts)?;
        }
        Ok(made)
    }

    fn push(
        &mut self,
        s: usize,
        tokens: &[u32],
        counted: Option<&[bool]>,
        mut starts: bool,
    ) -> Result<()> {
        let n = tokens.len();
        let mut i = 0;
        while i < n {
            let st = &mut self.streams[s];
            if st.pos < st.skip_until {
                let k = ((st.skip_until - st.pos) as usize).min(n - i);
                i += k;
                st.pos += k as u64;
                starts = false;
                continue;
            }
            let k = ((self.shard_tokens - st.writer.len()) as usize).min(n - i);
            if starts {
                st.writer.start_doc();
                starts = false;
            }
            st.writer
                .push(&tokens[i..i + k], counted.map(|c| &c[i..i + k]));
            i += k;
            st.pos += k as u64;
            if st.writer.len() == self.shard_tokens {
                self.finish(s)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self, s: usize) -> Result<()> {
        let fresh = self.new_writer();
        let st = &mut self.streams[s];
        let writer = std::mem::replace(&mut st.writer, fresh);
        let file = format!("{}-{:05}.tok", st.name, st.done.len());
        st.done.push(writer.finish_entry(self.dir, file)?);
        self.finished_now = true;
        Ok(())
    }
}

/// Tokenises `opts.inputs` into shards in `opts.out_dir` (see the module docs), calling
/// `progress` after each unit of input.
pub fn prepare(
    opts: &PrepareOptions,
    progress: &dyn Fn(&PrepareProgress),
) -> Result<PrepareSummary> {
    if opts.shard_tokens == 0 {
        return Err(Error::Config("--shard-tokens must be positive".into()));
    }
    if !(0.0..1.0).contains(&opts.val_fraction) {
        return Err(Error::Config(format!(
            "--val-fraction {} must be in [0, 1)",
            opts.val_fraction
        )));
    }
    if opts.inputs.is_empty() {
        return Err(Error::Config("prepare needs at least one input".into()));
    }
    let files = expand_inputs(&opts.inputs)?;
    let parquet = parquet_files(opts, &files)?;
    let dir = opts.out_dir.as_path();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    remove_temporaries(dir)?;
    // An earlier run: finished (manifest) or interrupted (progress).
    let progress_path = dir.join(PROGRESS_FILE);
    let finished = match dir.join(MANIFEST_FILE).is_file() {
        true => Some(Manifest::read(dir)?),
        false => None,
    };
    let interrupted: Option<Progress> = match progress_path.is_file() {
        true => Some(crate::io::read_json(&progress_path)?),
        false => None,
    };
    let earlier_inputs = match (&finished, &interrupted) {
        (Some(m), _) => &m.inputs[..],
        (None, Some(p)) => &p.inputs[..],
        (None, None) => &[],
    };
    let inputs = plan::record_inputs(&files, earlier_inputs)?;
    let bytes_total: u64 = inputs.iter().map(|i| i.bytes).sum();

    let (encoder, tokenizer, vocab_size) = build_encoder(opts, &files)?;
    let width = width_for_vocab(vocab_size as usize);
    let vocab = u64::from_str_radix(&tokenizer.hash, 16).unwrap_or_default();
    let mask = opts.format == InputFormat::Sft;
    let eos_id = match &encoder {
        Encoder::Tokenizer { eos, .. } => *eos,
        _ => None,
    };
    let mut settings = serde_json::json!({
        "version": PREPARE_VERSION,
        "format": opts.format,
        "field": opts.field,
        "shard_tokens": opts.shard_tokens,
        "val_fraction": opts.val_fraction,
        "val_rule": format!("splitmix64(doc ^ {VAL_SEED:#x}) < val_fraction * 2^64"),
        "chunk_bytes": opts.chunk_bytes,
        "eos_id": eos_id,
    });
    // Recorded only when it is not what the file names say (earlier plans stay the same).
    let by_name: Vec<bool> = files.iter().map(|p| is_parquet(p)).collect();
    if parquet != by_name {
        settings["input_format"] = serde_json::json!(opts.container);
    }
    let plan = plan::plan(&settings, &inputs, &tokenizer)?;
    let expect = Expect {
        vocab: Some(vocab),
        width: Some(width),
    };
    let now = Now {
        settings: &settings,
        inputs: &inputs,
        tokenizer: &tokenizer,
        plan: &plan,
        legacy: plan::legacy_plan(&settings, &inputs, &tokenizer)?,
        expect,
    };
    let resume = match earlier_run(dir, opts.overwrite, finished, interrupted, &now)? {
        Earlier::UpToDate(manifest) => {
            return Ok(PrepareSummary {
                manifest: *manifest,
                resumed_shards: 0,
                up_to_date: true,
                bytes_read: 0,
                tokens_made: 0,
            })
        }
        Earlier::Resume(p) => p.map(|p| *p),
    };

    settings["plan"] = plan.clone().into();
    let base = Progress {
        plan: plan.clone(),
        resume: start(),
        train: Vec::new(),
        val: Vec::new(),
        partial: [None, None],
        inputs: inputs.clone(),
        settings: settings.clone(),
        tokenizer: Some(tokenizer.clone()),
    };
    let val_below = (opts.val_fraction * 18_446_744_073_709_551_616.0) as u64;
    let at = resume.as_ref().map_or_else(start, |p| p.resume.clone());
    let resumed_shards = resume.as_ref().map_or(0, |p| p.train.len() + p.val.len());
    let partial = |i: usize| -> Result<ShardWriter> {
        match resume.as_ref().and_then(|p| p.partial[i].as_ref()) {
            Some(e) => load_partial(&dir.join(&e.file), &expect),
            None => Ok(ShardWriter::new(width, vocab, true, mask)),
        }
    };
    let writers = [partial(0)?, partial(1)?];
    let [w0, w1] = writers;
    let stream = |i: usize, done: Vec<ShardEntry>, pos: u64, writer: ShardWriter| Stream {
        name: SPLITS[i],
        skip_until: done.len() as u64 * opts.shard_tokens + writer.len(),
        writer,
        pos,
        done,
    };
    let (done_t, done_v) = resume.map_or((Vec::new(), Vec::new()), |p| (p.train, p.val));
    let mut cut = Cutter {
        dir,
        shard_tokens: opts.shard_tokens,
        width,
        vocab,
        mask,
        streams: [
            stream(0, done_t, at.pos[0], w0),
            stream(1, done_v, at.pos[1], w1),
        ],
        doc: at.doc,
        in_val: false,
        val_below,
        finished_now: false,
    };
    // A resumed unit in the middle of a text file continues the document before it.
    cut.in_val = at.doc > 0 && cut.is_val(at.doc - 1);

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads)
        .build()
        .map_err(|e| Error::Config(format!("cannot start worker threads: {e}")))?;
    let window = 4 * pool.current_num_threads().max(1);
    let mut reader = unit_reader(opts, &files, at.clone())?;
    let mut state = PrepareProgress {
        bytes_done: inputs[..at.file.min(inputs.len())]
            .iter()
            .map(|i| i.bytes)
            .sum::<u64>()
            + at.offset,
        bytes_total,
        tokens: 0,
        shards: resumed_shards,
    };
    let bytes_before = state.bytes_done;
    loop {
        let mut units: Vec<Unit> = Vec::with_capacity(window);
        while units.len() < window {
            match reader.next_unit()? {
                Some(u) => units.push(u),
                None => break,
            }
        }
        if units.is_empty() {
            break;
        }
        let encoded: Vec<Result<Vec<Piece>>> = pool.install(|| {
            units
                .par_iter()
                .map(|u| encoder.encode_unit(u, &files[u.at.file], opts.format, &opts.field))
                .collect()
        });
        for (unit, pieces) in units.iter().zip(encoded) {
            state.tokens += cut.feed(pieces?)?;
            state.bytes_done += unit.size;
            if std::mem::take(&mut cut.finished_now) {
                state.shards = cut.streams[0].done.len() + cut.streams[1].done.len();
                let mut next = unit.next.clone();
                next.doc = cut.doc;
                next.pos = [cut.streams[0].pos, cut.streams[1].pos];
                let streams = cut.streams.each_ref().map(Stream::state);
                save_progress(dir, &base, next, streams)?;
            }
            progress(&state);
        }
    }
    for s in 0..2 {
        if !cut.streams[s].writer.is_empty() {
            cut.finish(s)?;
        }
    }
    let [train, val] = cut.streams.map(|s| s.done);
    if train.is_empty() {
        return Err(Error::data(
            &opts.inputs[0],
            "the inputs gave no training tokens (empty files, or every document held out)",
        ));
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        tokenizer,
        vocab_size,
        eos_id,
        width,
        docs: true,
        mask,
        train,
        val,
        inputs,
        settings,
    };
    manifest.write(dir)?;
    let _ = std::fs::remove_file(&progress_path);
    remove_partials(dir, &[])?;
    state.shards = manifest.train.len() + manifest.val.len();
    progress(&state);
    Ok(PrepareSummary {
        manifest,
        resumed_shards,
        up_to_date: false,
        bytes_read: state.bytes_done - bytes_before,
        tokens_made: state.tokens,
    })
}

/// What this run is made from (see [`earlier_run`]).
struct Now<'a> {
    settings: &'a serde_json::Value,
    inputs: &'a [InputEntry],
    tokenizer: &'a TokenizerInfo,
    plan: &'a str,
    /// The plan as older trainers computed it.
    legacy: String,
    expect: Expect,
}

/// What an earlier run in the directory leaves to do.
enum Earlier {
    /// Finished with this plan, its shards intact: nothing.
    UpToDate(Box<Manifest>),
    /// Everything from the start (`None`), or from where an interrupted run of this plan
    /// stopped.
    Resume(Option<Box<Progress>>),
}

/// Decides what to do with the `finished` or `interrupted` run found in `dir`: refuses one of
/// another plan (unless `overwrite`), saying what changed; clears one whose shards fail
/// verification.
fn earlier_run(
    dir: &Path,
    overwrite: bool,
    finished: Option<Manifest>,
    interrupted: Option<Progress>,
    now: &Now<'_>,
) -> Result<Earlier> {
    let same_plan = |p: Option<&str>| p == Some(now.plan) || p == Some(now.legacy.as_str());
    let changed = |earlier: plan::Earlier<'_>, what: &str, advice: &str| {
        let what_changed = plan::changes(&earlier, now.settings, now.inputs, now.tokenizer);
        Error::data(dir, format!("{what} ({what_changed}); {advice}"))
    };
    let expect = &now.expect;
    if let Some(mut m) = finished {
        let same = same_plan(m.settings.get("plan").and_then(|p| p.as_str()));
        if same
            && verify_all(dir, &m.train, expect).is_ok()
            && verify_all(dir, &m.val, expect).is_ok()
        {
            if m.inputs != now.inputs {
                // Same bytes, new times (or digests an older trainer did not record).
                m.inputs = now.inputs.to_vec();
                m.settings["plan"] = now.plan.into();
                m.write(dir)?;
            }
            return Ok(Earlier::UpToDate(Box::new(m)));
        }
        if !same && !overwrite {
            let earlier = plan::Earlier {
                settings: &m.settings,
                inputs: &m.inputs,
                tokenizer: Some(&m.tokenizer),
            };
            return Err(changed(
                earlier,
                "already holds shards prepared from other inputs or settings",
                "use --overwrite or another --out-dir",
            ));
        }
        clear(dir)?;
    }
    // (`clear` above removed any progress file.)
    let Some(p) = interrupted.filter(|_| dir.join(PROGRESS_FILE).is_file()) else {
        return Ok(Earlier::Resume(None));
    };
    let same = same_plan(Some(&p.plan));
    if !same && !overwrite {
        let earlier = plan::Earlier {
            settings: &p.settings,
            inputs: &p.inputs,
            tokenizer: p.tokenizer.as_ref(),
        };
        return Err(changed(
            earlier,
            "holds an interrupted `prepare` of other inputs or settings",
            "rerun that one, or use --overwrite or another --out-dir",
        ));
    }
    let partials: Vec<ShardEntry> = p.partial.iter().flatten().cloned().collect();
    let ok = same
        && verify_all(dir, &p.train, expect).is_ok()
        && verify_all(dir, &p.val, expect).is_ok()
        && verify_all(dir, &partials, expect).is_ok();
    if ok {
        return Ok(Earlier::Resume(Some(Box::new(p))));
    }
    clear(dir)?;
    Ok(Earlier::Resume(None))
}
