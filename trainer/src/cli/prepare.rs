//! `trainer prepare`: text, JSONL or SFT records (text, JSON-lines or Parquet files) → token
//! shards.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use trainer::data::shards::{
    prepare as run, verify_dir, Container, InputFormat, PrepareOptions, PrepareSummary, VocabSpec,
};

/// What the inputs' records are.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum FormatArg {
    /// UTF-8 text, one document a file (Parquet: the --field column, one document a row).
    Text,
    /// JSON lines or Parquet rows, one document a record (its --field).
    Jsonl,
    /// SFT records (messages, prompt/completion, text), rendered with the chat template and
    /// masked; the shards carry the loss mask. Parquet: the columns of those names, messages
    /// a list of {role, content} structs.
    Sft,
    /// Preference records (prompt/chosen/rejected, strings or messages, or chosen/rejected
    /// with an implicit prompt), one JSON object a line, tokenised as `--data preference`
    /// does: each pair a document of the shards' pair layout, read by `--data shards`.
    Preference,
}

/// How the input files are stored.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum InputFormatArg {
    /// By extension: .parquet files are Parquet, others text or JSON lines as --format says.
    Auto,
    /// Parquet (what the Hugging Face hub serves), read a row group at a time.
    Parquet,
    /// JSON lines.
    Jsonl,
    /// Plain text.
    Text,
}

/// The `prepare` flags.
#[derive(Args, Debug)]
pub(super) struct PrepareArgs {
    /// Input files, directories or globs (quoted), read in this order.
    #[arg(required_unless_present = "verify")]
    inputs: Vec<PathBuf>,
    /// The directory the shards and manifest.json go to.
    #[arg(long, required_unless_present = "verify")]
    out_dir: Option<PathBuf>,
    /// Instead of preparing: read every shard of the prepared directory DIR back, check its
    /// checksums and the manifest's counts, list each bad shard; exit 1 if any is bad.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["inputs", "out_dir"])]
    verify: Option<PathBuf>,
    /// What the inputs' records are [default: jsonl for .jsonl/.json/.parquet inputs or
    /// --input-format jsonl|parquet, else text].
    #[arg(long, value_enum)]
    format: Option<FormatArg>,
    /// How the input files are stored.
    #[arg(long, value_enum, default_value = "auto")]
    input_format: InputFormatArg,
    /// JSONL: the field holding each document's text (Parquet: the column).
    #[arg(long, default_value = "text")]
    field: String,
    /// A Hugging Face tokenizer.json (its tokenizer_config.json and chat template beside it).
    #[arg(long, conflicts_with = "vocab")]
    tokenizer: Option<PathBuf>,
    /// Without --tokenizer: a char or byte vocabulary.
    #[arg(long, value_parser = ["char", "byte"])]
    vocab: Option<String>,
    /// The token appended after each document [default: tokenizer_config.json's eos_token,
    /// else <|endoftext|>, else </s>].
    #[arg(long)]
    eos_token: Option<String>,
    /// Tokens a shard.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: u64,
    /// Fraction of documents held out (val-*.tok), chosen by a hash of the document index.
    #[arg(long, default_value_t = 0.0)]
    val_fraction: f64,
    /// Worker threads (0: one a core); the shards do not depend on it.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Replace a directory prepared from other inputs or settings.
    #[arg(long)]
    overwrite: bool,
    /// JSONL and SFT: the longest line in bytes; a longer one is refused naming file:line
    /// before it is read whole (parsing a line takes a few hundred times its size).
    #[arg(long, default_value_t = trainer::data::lines::MAX_LINE_BYTES)]
    max_line_bytes: usize,
    /// Preference: cut each sequence to this many tokens keeping its start (TRL's max_length;
    /// a run's block size + 1) and drop the records whose prompt alone fills them, counted
    /// [default: whole pairs; training cuts them to its block].
    #[arg(long)]
    max_length: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Bytes of input tokenised as one unit (tests; part of the output's identity).
    #[arg(long, default_value_t = 1 << 20, hide = true)]
    chunk_bytes: usize,
}

/// `prepare --verify DIR`: one line a shard, an error naming the bad ones.
fn verify(dir: &Path) -> Result<()> {
    let verdicts = verify_dir(dir).with_context(|| format!("cannot verify {}", dir.display()))?;
    let bad: Vec<&str> = verdicts
        .iter()
        .filter(|v| v.problem.is_some())
        .map(|v| v.file.as_str())
        .collect();
    for v in &verdicts {
        match &v.problem {
            None => outln!("ok          {}", v.file),
            Some(p) => outln!("BAD         {}: {p}", v.file),
        }
    }
    if !bad.is_empty() {
        bail!(
            "{}: {} of {} shards are bad ({}); rerun the `trainer prepare` command that made \
             it (it redoes a directory whose shards fail verification)",
            dir.display(),
            bad.len(),
            verdicts.len(),
            bad.join(", ")
        );
    }
    outln!("verified    {} ({} shards)", dir.display(), verdicts.len());
    Ok(())
}

pub(super) fn prepare(args: PrepareArgs) -> Result<()> {
    // Memory that does not grow with the corpus (see the function).
    trainer::runtime::init_streaming();
    if let Some(dir) = &args.verify {
        return verify(dir);
    }
    let out_dir = args.out_dir.clone().context("--out-dir is required")?;
    let quiet = args.quiet;
    let opts = options(args, &out_dir)?;
    let start = Instant::now();
    let summary = run_with_progress(&opts, quiet, start)
        .with_context(|| format!("cannot prepare {}", out_dir.display()))?;
    report(&summary, &out_dir, start.elapsed().as_secs_f64());
    Ok(())
}

/// The library's options from the command line's.
fn options(args: PrepareArgs, out_dir: &Path) -> Result<PrepareOptions> {
    let vocab = match (&args.tokenizer, args.vocab.as_deref()) {
        (Some(t), _) => VocabSpec::Tokenizer(t.clone()),
        (None, Some("char")) => VocabSpec::Char,
        (None, Some(_)) => VocabSpec::Byte,
        (None, None) => bail!("give --tokenizer tokenizer.json, or --vocab char|byte"),
    };
    let container = match args.input_format {
        InputFormatArg::Auto => Container::Auto,
        InputFormatArg::Parquet => Container::Parquet,
        InputFormatArg::Jsonl => Container::Jsonl,
        InputFormatArg::Text => Container::Text,
    };
    let format = match (args.format, container) {
        (Some(FormatArg::Text), _) => InputFormat::Text,
        (Some(FormatArg::Jsonl), _) => InputFormat::Jsonl,
        (Some(FormatArg::Sft), _) => InputFormat::Sft,
        (Some(FormatArg::Preference), _) => InputFormat::Preference,
        (None, Container::Parquet | Container::Jsonl) => InputFormat::Jsonl,
        (None, Container::Text) => InputFormat::Text,
        // Decided by the files the inputs name (a directory of .jsonl files is JSONL).
        (None, Container::Auto) => InputFormat::detect(&args.inputs)?,
    };
    Ok(PrepareOptions {
        inputs: args.inputs,
        out_dir: out_dir.to_path_buf(),
        format,
        container,
        field: args.field,
        vocab,
        eos_token: args.eos_token,
        shard_tokens: args.shard_tokens,
        val_fraction: args.val_fraction,
        threads: args.threads,
        overwrite: args.overwrite,
        chunk_bytes: args.chunk_bytes,
        max_line_bytes: args.max_line_bytes,
        max_length: args.max_length,
    })
}

/// Runs `prepare` with a progress bar (hidden when `quiet`), or off a terminal a plain line
/// every 30 s with the ETA.
fn run_with_progress(opts: &PrepareOptions, quiet: bool, start: Instant) -> Result<PrepareSummary> {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {msg} eta {eta}",
        )
        .context("progress bar template")?,
    );
    let last_line = std::sync::Mutex::new(start);
    let summary = run(opts, &|p| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        let rate = format!(
            "{:.2}M tokens/s, {} shards",
            p.tokens as f64 / secs / 1e6,
            p.shards
        );
        if bar.is_hidden() {
            let mut last = last_line.lock().unwrap_or_else(|e| e.into_inner());
            if last.elapsed() >= std::time::Duration::from_secs(30) {
                *last = Instant::now();
                let left = p.bytes_total.saturating_sub(p.bytes_done) as f64;
                let eta = secs * left / (p.bytes_done.max(1) as f64);
                errln!(
                    "prepare {:.1}/{:.1} MB | {rate} | ETA {}",
                    p.bytes_done as f64 / 1e6,
                    p.bytes_total as f64 / 1e6,
                    indicatif::HumanDuration(std::time::Duration::from_secs_f64(eta))
                );
            }
        }
        bar.set_message(rate);
    })?;
    bar.finish_and_clear();
    Ok(summary)
}

/// What `prepare` made, and how fast.
fn report(summary: &PrepareSummary, out_dir: &Path, secs: f64) {
    let m = &summary.manifest;
    if summary.up_to_date {
        outln!("up to date  {} (nothing to do)", out_dir.display());
    }
    outln!(
        "prepared    {} ({} vocab {}, width {}, eos {})",
        out_dir.display(),
        m.tokenizer.kind,
        m.vocab_size,
        m.width,
        m.eos_id.map_or("none".to_string(), |id| id.to_string())
    );
    outln!(
        "train       {} tokens in {} shards",
        m.tokens(trainer::data::Split::Train),
        m.train.len()
    );
    outln!(
        "val         {} tokens in {} shards",
        m.tokens(trainer::data::Split::Val),
        m.val.len()
    );
    if m.pairs {
        let pairs = |split| -> u64 { m.shards(split).iter().map(|s| s.docs).sum() };
        let (train, val) = (
            pairs(trainer::data::Split::Train),
            pairs(trainer::data::Split::Val),
        );
        outln!("pairs       {train} train / {val} val preference pairs");
        if summary.dropped > 0 {
            outln!(
                "dropped     {} of {} preference records: their prompt alone fills \
                 --max-length {} tokens",
                summary.dropped,
                summary.dropped + train + val,
                m.settings["max_length"]
            );
        }
    }
    if summary.resumed_shards > 0 {
        outln!(
            "resumed     {} finished shards kept",
            summary.resumed_shards
        );
    }
    outln!(
        "speed       {:.1} MB/s, {:.2}M tokens/s ({} tokens in {secs:.2}s)",
        summary.bytes_read as f64 / secs / 1e6,
        summary.tokens_made as f64 / secs / 1e6,
        summary.tokens_made
    );
}
