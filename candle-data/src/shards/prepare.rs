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
//!   at a time, each row a record with the format's columns (see [`Container`](super::Container));
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

use super::cutter::{Cutter, ShardShape, VAL_SEED};
use super::encode::{build_encoder, Encoder, Piece};
use super::files::expand_inputs;
use super::format::{
    width_for_vocab, Expect, InputEntry, Manifest, ShardEntry, TokenizerInfo, MANIFEST_FILE,
    MANIFEST_FORMAT,
};
use super::input::{parquet_files, unit_reader};
use super::options::{InputFormat, PrepareOptions, PrepareProgress, PrepareSummary};
use super::plan;
use super::progress::{
    clear, remove_partials, remove_temporaries, save_progress, verify_all, Progress,
};
use super::unit::{start, Position, Unit};
use crate::error::{Error, Result};
use crate::parquet::is_parquet;

pub use super::progress::PROGRESS_FILE;
/// Bumped whenever the way inputs become tokens changes.
const PREPARE_VERSION: u32 = 1;

/// Tokenises `opts.inputs` into shards in `opts.out_dir` (see the module docs), calling
/// `progress` after each unit of input.
pub fn prepare(
    opts: &PrepareOptions,
    progress: &dyn Fn(&PrepareProgress),
) -> Result<PrepareSummary> {
    check_options(opts)?;
    let files = expand_inputs(&opts.inputs)?;
    let parquet = parquet_files(opts, &files)?;
    let dir = opts.out_dir.as_path();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    remove_temporaries(dir)?;
    let (finished, interrupted) = earlier_in(dir)?;
    let earlier_inputs = match (&finished, &interrupted) {
        (Some(m), _) => &m.inputs[..],
        (None, Some(p)) => &p.inputs[..],
        (None, None) => &[],
    };
    let inputs = plan::record_inputs(&files, earlier_inputs)?;

    let (encoder, tokenizer, vocab_size) = build_encoder(opts, &files)?;
    let shape = ShardShape {
        width: width_for_vocab(vocab_size as usize),
        vocab: u64::from_str_radix(&tokenizer.hash, 16).unwrap_or_default(),
        mask: opts.format == InputFormat::Sft,
        pairs: opts.format == InputFormat::Preference,
    };
    let eos_id = encoder.eos();
    let mut settings = settings_of(opts, eos_id, &files, &parquet);
    let plan = plan::plan(&settings, &inputs, &tokenizer)?;
    let expect = Expect {
        vocab: Some(shape.vocab),
        width: Some(shape.width),
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
        Earlier::UpToDate(manifest) => return Ok(up_to_date(*manifest)),
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
    let at = resume.as_ref().map_or_else(start, |p| p.resume.clone());
    let resumed_shards = resume.as_ref().map_or(0, |p| p.train.len() + p.val.len());
    let mut state = progress_at(&inputs, &at, resumed_shards);
    let mut cut = Cutter::new(dir, opts, shape, resume, &expect)?;
    let bytes_before = state.bytes_done;
    let job = Job {
        opts,
        files: &files,
        encoder: &encoder,
    };
    job.encode_units(at, &mut cut, &base, &mut state, progress)?;
    let dropped = cut.dropped;
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        tokenizer,
        vocab_size,
        eos_id,
        width: shape.width,
        docs: true,
        mask: shape.mask,
        pairs: shape.pairs,
        train: Vec::new(),
        val: Vec::new(),
        inputs,
        settings,
    };
    let manifest = close(cut, manifest, opts)?;
    state.shards = manifest.train.len() + manifest.val.len();
    progress(&state);
    Ok(PrepareSummary {
        manifest,
        resumed_shards,
        up_to_date: false,
        bytes_read: state.bytes_done - bytes_before,
        tokens_made: state.tokens,
        dropped,
    })
}

/// What `prepare` did in a directory already prepared as asked: nothing.
fn up_to_date(manifest: Manifest) -> PrepareSummary {
    PrepareSummary {
        manifest,
        resumed_shards: 0,
        up_to_date: true,
        bytes_read: 0,
        tokens_made: 0,
        dropped: 0,
    }
}

/// The manifest (finished) or progress file (interrupted) of an earlier run in `dir`.
fn earlier_in(dir: &Path) -> Result<(Option<Manifest>, Option<Progress>)> {
    let progress_path = dir.join(PROGRESS_FILE);
    let finished = match dir.join(MANIFEST_FILE).is_file() {
        true => Some(Manifest::read(dir)?),
        false => None,
    };
    let interrupted: Option<Progress> = match progress_path.is_file() {
        true => Some(crate::io::read_json(&progress_path)?),
        false => None,
    };
    Ok((finished, interrupted))
}

/// Progress at `at`, before which `shards` shards were finished: the bytes of the inputs
/// before it counted as done.
fn progress_at(inputs: &[InputEntry], at: &Position, shards: usize) -> PrepareProgress {
    PrepareProgress {
        bytes_done: inputs[..at.file.min(inputs.len())]
            .iter()
            .map(|i| i.bytes)
            .sum::<u64>()
            + at.offset,
        bytes_total: inputs.iter().map(|i| i.bytes).sum(),
        tokens: 0,
        shards,
    }
}

/// Finishes the last shard of each split into `manifest` (refused when no training token
/// came), writes it (last), and removes the progress file and the partial shards.
fn close(cut: Cutter<'_>, mut manifest: Manifest, opts: &PrepareOptions) -> Result<Manifest> {
    let dir = opts.out_dir.as_path();
    let dropped = cut.dropped;
    let [train, val] = cut.close()?;
    if train.is_empty() && dropped > 0 {
        return Err(Error::data(
            &opts.inputs[0],
            format!(
                "no training pair: {dropped} preference records dropped, their prompt alone \
                 filling --max-length {} tokens, the others (if any) held out",
                opts.max_length.unwrap_or_default()
            ),
        ));
    }
    if train.is_empty() {
        return Err(Error::data(
            &opts.inputs[0],
            "the inputs gave no training tokens (empty files, or every document held out)",
        ));
    }
    manifest.train = train;
    manifest.val = val;
    manifest.write(dir)?;
    let _ = std::fs::remove_file(dir.join(PROGRESS_FILE));
    remove_partials(dir, &[])?;
    Ok(manifest)
}

/// Errors on options no run could use.
fn check_options(opts: &PrepareOptions) -> Result<()> {
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
    match (opts.max_length, opts.format) {
        (Some(0), _) => Err(Error::Config("--max-length must be positive".into())),
        (Some(_), f) if f != InputFormat::Preference => Err(Error::Config(format!(
            "--max-length cuts preference pairs (--format preference), not --format {f}"
        ))),
        _ => Ok(()),
    }
}

/// The settings that make the output what it is, as the manifest records them (the plan is
/// their digest with the inputs' and the tokenizer's).
fn settings_of(
    opts: &PrepareOptions,
    eos_id: Option<u32>,
    files: &[PathBuf],
    parquet: &[bool],
) -> serde_json::Value {
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
    if let Some(max) = opts.max_length {
        settings["max_length"] = max.into();
    }
    // Recorded only when it is not what the file names say (earlier plans stay the same).
    let by_name: Vec<bool> = files.iter().map(|p| is_parquet(p)).collect();
    if parquet != by_name {
        settings["input_format"] = serde_json::json!(opts.container);
    }
    settings
}

/// The inputs of one `prepare` and the encoder that tokenises them.
struct Job<'a> {
    opts: &'a PrepareOptions,
    files: &'a [PathBuf],
    encoder: &'a Encoder,
}

impl Job<'_> {
    /// Reads the inputs from `at` a window of units at a time, tokenises each window in
    /// parallel and feeds the pieces to `cut` in input order, saving progress after each unit
    /// in which a shard was finished and calling `progress` after each unit.
    fn encode_units(
        &self,
        at: Position,
        cut: &mut Cutter<'_>,
        base: &Progress,
        state: &mut PrepareProgress,
        progress: &dyn Fn(&PrepareProgress),
    ) -> Result<()> {
        let (opts, files) = (self.opts, self.files);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads)
            .build()
            .map_err(|e| Error::Config(format!("cannot start worker threads: {e}")))?;
        let window = 4 * pool.current_num_threads().max(1);
        let mut reader = unit_reader(opts, files, at)?;
        loop {
            let mut units: Vec<Unit> = Vec::with_capacity(window);
            while units.len() < window {
                match reader.next_unit()? {
                    Some(u) => units.push(u),
                    None => break,
                }
            }
            if units.is_empty() {
                return Ok(());
            }
            let encoded: Vec<Result<Vec<Piece>>> = pool.install(|| {
                units
                    .par_iter()
                    .map(|u| {
                        let path = &files[u.at.file];
                        self.encoder.encode_unit(u, path, opts.format, &opts.field)
                    })
                    .collect()
            });
            for (unit, pieces) in units.iter().zip(encoded) {
                state.tokens += cut.feed(pieces?)?;
                state.bytes_done += unit.size;
                if std::mem::take(&mut cut.finished_now) {
                    state.shards = cut.shards();
                    let (next, streams) = cut.save_point(&unit.next);
                    save_progress(&opts.out_dir, base, next, streams)?;
                }
                progress(state);
            }
        }
    }
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
