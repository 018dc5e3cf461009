//! Subcommands of the `trainer` binary.

mod export;
mod models;
mod prepare;
mod progress;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use trainer::checkpoint;
use trainer::config::{Overrides, TrainConfig};
use trainer::train::Trainer;

use models::{eval, inspect, sample, EvalArgs, InspectArgs, SampleArgs};
use progress::{install_signal_handler, print_banner, print_summary, Progress};

/// Train GPT-2 style transformers on Candle.
///
/// `trainer train` with no arguments trains a small GPT on an embedded multi-digit addition
/// task (no download) and reports exact-match accuracy on held-out problems as it learns.
#[derive(Parser, Debug)]
#[command(name = "trainer", version, about, long_about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model (defaults < --config file < --key value flags).
    Train(Box<TrainArgs>),
    /// Generate text from a trainer checkpoint or a Hugging Face model.
    ///
    /// MODEL is a trainer run directory (its latest checkpoint), a checkpoint directory, a
    /// Hugging Face model directory (config.json + model.safetensors, or shards named by
    /// model.safetensors.index.json) or a model id in the local hub cache (HF_HOME; nothing is
    /// downloaded). Text is encoded with --tokenizer-path, else the run's data (trainer
    /// checkpoints), else the tokenizer.json next to the weights.
    /// A sample ends early at any of the model's end tokens (`eos_token_id` of
    /// generation_config.json, else of config.json; instruction-tuned models list several).
    Sample(SampleArgs),
    /// Measure train/val loss (and the task score) of a trainer checkpoint or a Hugging Face
    /// model.
    ///
    /// MODEL is a trainer run directory (its latest checkpoint), a checkpoint directory, a
    /// Hugging Face model directory (config.json + model.safetensors, or shards named by
    /// model.safetensors.index.json) or a model id in the local hub cache (HF_HOME; nothing is
    /// downloaded).
    ///
    /// A trainer checkpoint is evaluated as its run evaluates itself (same data, block size,
    /// batch size and batches); the flags below replace single settings. A bare Hugging Face
    /// model has no run config: give the text with --data-path FILE, tokenised with the
    /// model's own tokenizer.json (or --data / --tokenizer-path), in batches of
    /// min(n_positions, 256) tokens (or --block-size).
    Eval(EvalArgs),
    /// Show a model's tensors, shapes, dtypes, parameter count, config and step; fail when the
    /// weights do not match its config.json.
    Inspect(InspectArgs),
    /// Write a model as a Hugging Face model directory that transformers'
    /// AutoModelForCausalLM.from_pretrained loads.
    ///
    /// SOURCE is a trainer run directory (its latest checkpoint), a checkpoint directory, a
    /// Hugging Face model directory or a model id in the local hub cache. OUT_DIR receives
    /// config.json, the weights (model.safetensors, or shards with
    /// model.safetensors.index.json) and, when the model's origin has them, tokenizer.json,
    /// tokenizer_config.json, special_tokens_map.json, generation_config.json and
    /// chat_template.jinja (a run trained on `tokenizer` data exports its own tokenizer).
    Export(export::ExportArgs),
    /// Redraw a run's loss curve (loss.svg) from its metrics.jsonl.
    Plot(PlotArgs),
    /// Tokenise text, JSONL or SFT records into token shards (train-*.tok, val-*.tok,
    /// manifest.json): streaming, parallel, deterministic (whatever --threads) and resumable
    /// (rerun the same command after an interruption; finished shards are kept).
    Prepare(prepare::PrepareArgs),
    /// Write the word-level tokenizer and ChatML chat template of the generated chat tasks
    /// (`--data chat-task`) into DIR: tokenizer.json and tokenizer_config.json, as in
    /// data/chat-base (scripts/make_chat_base.sh pretrains that base with them).
    ChatTokenizer(ChatTokenizerArgs),
}

#[derive(Args, Debug)]
struct ChatTokenizerArgs {
    /// The directory to write into (created if needed).
    dir: PathBuf,
}

#[derive(Args, Debug)]
struct PlotArgs {
    /// The run directory.
    run: PathBuf,
    /// Output file (default: RUN/loss.svg).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct TrainArgs {
    /// A TOML file of config fields (see `--print-config` for every field).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue the run in this run or checkpoint directory, bit-exactly.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Print the resolved config as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Replace the run already in --out-dir (its checkpoints, metrics and loss curve are
    /// deleted) instead of refusing to start.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    overrides: Overrides,
}

/// How a command ended, when it did not fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It did all it was asked (exit status 0).
    Done,
    /// Training stopped on request (Ctrl-C, SIGTERM, SIGHUP) after saving a checkpoint that
    /// resumes: exit status [`Outcome::INTERRUPTED`], so a script or scheduler can tell it
    /// from a finished run (0) and a failed one (1).
    Interrupted,
}

impl Outcome {
    /// The exit status of an interrupted run (`EX_TEMPFAIL` of sysexits.h: retry later, here
    /// with `--resume`).
    pub const INTERRUPTED: u8 = 75;
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<Outcome> {
    let done = |r: Result<()>| r.map(|()| Outcome::Done);
    match cli.command {
        Command::Train(a) => train(*a),
        Command::Sample(a) => done(sample(a)),
        Command::Eval(a) => done(eval(a)),
        Command::Inspect(a) => done(inspect(a)),
        Command::Export(a) => done(export::export(a)),
        Command::Plot(a) => done(plot(a)),
        Command::ChatTokenizer(a) => done(chat_tokenizer(a)),
        Command::Prepare(a) => done(prepare::prepare(a)),
    }
}

fn chat_tokenizer(args: ChatTokenizerArgs) -> Result<()> {
    trainer::data::chat_task::write_tokenizer(&args.dir)?;
    outln!("{}", args.dir.display());
    Ok(())
}

fn plot(args: PlotArgs) -> Result<()> {
    let records = trainer::metrics::read(&args.run.join("metrics.jsonl"))?;
    let out = args.out.unwrap_or_else(|| args.run.join("loss.svg"));
    let name = args
        .run
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    trainer::plot::loss_curve(&out, &name, &records)?;
    outln!("{}", out.display());
    Ok(())
}

/// Claims the trainer's run directory. A default directory (`fresh_base`, not chosen by the
/// user) that another process claims first, between our choice of a fresh name and the claim
/// (runs started at once), is passed over for the next fresh name.
fn claim(trainer: &mut Trainer, fresh_base: Option<&std::path::Path>) -> trainer::Result<()> {
    let Some(base) = fresh_base else {
        return trainer.claim_run_dir();
    };
    let mut taken = Vec::new();
    loop {
        match trainer.claim_run_dir() {
            Err(trainer::Error::RunDirExists { path } | trainer::Error::RunDirBusy { path })
                if taken.len() < 1000 =>
            {
                taken.push(path);
                let next = trainer::run_dir::fresh_name_besides(base, &taken);
                errln!(
                    "{} was taken meanwhile: this run goes to {}",
                    taken[taken.len() - 1].display(),
                    next.display()
                );
                trainer.config.out_dir = next;
            }
            other => return other,
        }
    }
}

fn train(args: TrainArgs) -> Result<Outcome> {
    // `mpirun -np N trainer train ...`: this process is one data-parallel rank.
    let comm = trainer::train::communicator_from_env()?;
    let mut fresh_base = None;
    let main = comm.rank() == 0;
    let trainer = if let Some(dir) = &args.resume {
        if args.config.is_some() {
            bail!("--resume uses the run's saved config; pass changes as --key value flags");
        }
        let t = Trainer::resume(dir, |c| args.overrides.apply(c))
            .with_context(|| format!("cannot resume from {}", dir.display()))?
            .overwrite(args.overwrite);
        if main {
            errln!(
                "resuming {} at step {} in {}",
                dir.display(),
                t.step(),
                t.config.out_dir.display()
            );
        }
        t
    } else {
        let (mut config, file_keys) = match &args.config {
            Some(path) => TrainConfig::from_toml_file_with_keys(path)?,
            None => (TrainConfig::default(), Vec::new()),
        };
        args.overrides.apply(&mut config);
        if args.print_config {
            out!("{}", config.to_toml());
            return Ok(Outcome::Done);
        }
        let chosen = args.overrides.out_dir.is_some() || file_keys.iter().any(|k| k == "out_dir");
        if !chosen && !args.overwrite {
            fresh_base = Some(config.out_dir.clone());
            // The default run directory gets a fresh name per run, so that running the
            // README's first command twice just works and keeps both runs.
            let fresh = trainer::run_dir::fresh_name(&config.out_dir);
            if fresh != config.out_dir && main {
                errln!(
                    "{} holds an earlier run: this one goes to {}",
                    config.out_dir.display(),
                    fresh.display()
                );
                config.out_dir = fresh;
            }
        }
        Trainer::new(config)
            .context("cannot start the run")?
            .overwrite(args.overwrite)
    };
    let mut trainer = trainer.with_comm(comm).context("cannot start the run")?;
    claim(&mut trainer, fresh_base.as_deref()).context("cannot start the run")?;
    if main {
        print_banner(&trainer);
    }
    let stop = Arc::new(AtomicBool::new(false));
    install_signal_handler(stop.clone())?;
    let summary = if main {
        let mut progress = Progress::new(trainer.config.max_iters, trainer.step());
        let summary = trainer.run(&mut progress, &stop);
        progress.finish();
        summary
    } else {
        trainer.run(&mut (), &stop)
    };
    if let Err(e) = &summary {
        // The other ranks would wait for this one until their timeout: stop them now.
        trainer.data_parallel().abort(e);
    }
    let summary = summary.with_context(|| {
        format!(
            "training failed; the last good checkpoint (if any) is intact in {}",
            checkpoint::checkpoints_dir(&trainer.config.out_dir).display()
        )
    })?;
    if main {
        print_summary(&trainer, &summary);
    }
    Ok(match summary.interrupted {
        true => Outcome::Interrupted,
        false => Outcome::Done,
    })
}
