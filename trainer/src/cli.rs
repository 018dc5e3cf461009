//! Subcommands of the `trainer` binary.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use trainer::checkpoint::{self, TrainerState};
use trainer::config::{Overrides, TrainConfig};
use trainer::pretrained::{EvalRequest, ModelDir, TokenizerFile};
use trainer::sample::{generate, SamplingConfig};
use trainer::train::{Event, Observer, Summary, Trainer};

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
    /// Hugging Face model directory (config.json + model.safetensors) or a model id in the
    /// local hub cache (HF_HOME; nothing is downloaded). Text is encoded with --tokenizer-path,
    /// else the run's data (trainer checkpoints), else the tokenizer.json next to the weights.
    Sample(SampleArgs),
    /// Measure train/val loss (and the task score) of a trainer checkpoint or a Hugging Face
    /// model.
    ///
    /// MODEL is a trainer run directory (its latest checkpoint), a checkpoint directory, a
    /// Hugging Face model directory (config.json + model.safetensors) or a model id in the
    /// local hub cache (HF_HOME; nothing is downloaded).
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
    /// Redraw a run's loss curve (loss.svg) from its metrics.jsonl.
    Plot(PlotArgs),
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

#[derive(Args, Debug)]
struct SampleArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, or a hub model id.
    model: String,
    /// A tokenizer.json to encode the prompt and decode the samples with.
    #[arg(long)]
    tokenizer_path: Option<PathBuf>,
    /// Text to continue (if it encodes to no token: the model's bos token, else id 0).
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens only.
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Device (cpu, cuda, cuda:N, metal).
    #[arg(long, default_value = "cpu")]
    device: trainer::config::DeviceSpec,
}

#[derive(Args, Debug)]
struct EvalArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, or a hub model id.
    model: String,
    #[command(flatten)]
    request: EvalRequest,
}

#[derive(Args, Debug)]
struct InspectArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, a hub model id, or a
    /// `.safetensors` file. Exits non-zero when the weights do not match config.json.
    checkpoint: String,
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => train(*a),
        Command::Sample(a) => sample(a),
        Command::Eval(a) => eval(a),
        Command::Inspect(a) => inspect(a),
        Command::Plot(a) => plot(a),
    }
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
    println!("{}", out.display());
    Ok(())
}

fn train(args: TrainArgs) -> Result<()> {
    // `mpirun -np N trainer train ...`: this process is one data-parallel rank.
    let comm = trainer::train::parallel::communicator_from_env()?;
    let main = comm.rank() == 0;
    let trainer = if let Some(dir) = &args.resume {
        if args.config.is_some() {
            bail!("--resume uses the run's saved config; pass changes as --key value flags");
        }
        let t = Trainer::resume(dir, |c| args.overrides.apply(c))
            .with_context(|| format!("cannot resume from {}", dir.display()))?
            .overwrite(args.overwrite);
        if main {
            eprintln!(
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
            print!("{}", config.to_toml());
            return Ok(());
        }
        let chosen = args.overrides.out_dir.is_some() || file_keys.iter().any(|k| k == "out_dir");
        if !chosen && !args.overwrite {
            // The default run directory gets a fresh name per run, so that running the
            // README's first command twice just works and keeps both runs.
            let fresh = trainer::run_dir::fresh_name(&config.out_dir);
            if fresh != config.out_dir && main {
                eprintln!(
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
    trainer.claim_run_dir().context("cannot start the run")?;
    if main {
        print_banner(&trainer);
    }
    let stop = Arc::new(AtomicBool::new(false));
    install_signal_handler(stop.clone())?;
    let summary = if main {
        let mut progress = Progress::new(trainer.config.max_iters, trainer.step());
        let summary = trainer.run(&mut progress, &stop);
        progress.bar.finish_and_clear();
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
    Ok(())
}

fn print_banner(trainer: &Trainer) {
    let cfg = &trainer.config;
    let dp = trainer.data_parallel();
    eprintln!(
        "data: {}\nmodel: {} layers, {} heads, {} embd, block {} | {:.2}M parameters | device {}\n\
         run: {} steps of {} x {} x {} tokens -> {}",
        trainer.data.describe(),
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        trainer.params.num_elements() as f64 / 1e6,
        cfg.device,
        cfg.max_iters,
        cfg.grad_accum,
        cfg.batch_size,
        cfg.block_size,
        cfg.out_dir.display(),
    );
    if let Some(plan) = trainer.remat_plan() {
        eprintln!("activation checkpointing ({}):\n{plan}", cfg.remat);
    }
    if cfg.dtype != trainer::config::Precision::F32 {
        eprintln!(
            "mixed precision: {} compute, f32 master weights, loss scale {}",
            cfg.dtype, cfg.loss_scale
        );
    }
    if cfg.pipeline_stages > 1 {
        eprintln!(
            "pipeline: {} stages, {} microbatches, schedule {}",
            cfg.pipeline_stages, cfg.microbatches, cfg.schedule
        );
    }
    if dp.world_size() > 1 {
        eprintln!(
            "data parallel: {} ranks ({}), {} rows per rank, global batch {} rows",
            dp.world_size(),
            dp.comm().backend(),
            cfg.batch_size,
            dp.world_size() * cfg.batch_size
        );
    }
}

fn install_signal_handler(stop: Arc<AtomicBool>) -> Result<()> {
    {
        // SIGINT, SIGTERM and SIGHUP (the crate's `termination` feature): finish the step,
        // checkpoint, exit. A second signal exits at once; the last checkpoint stays intact
        // because checkpoints are written atomically.
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::SeqCst) {
                eprintln!("\nsecond signal: exiting without a checkpoint");
                std::process::exit(130);
            }
            eprintln!(
                "\nstop requested (signal): finishing this step and saving a checkpoint \
                 (send it again to exit at once)"
            );
        })
        .context("cannot install the signal handler")?;
    }
    Ok(())
}

struct Progress {
    bar: ProgressBar,
}

impl Progress {
    fn new(total: usize, start: usize) -> Self {
        let bar = ProgressBar::new(total as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos:>5}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_position(start as u64);
        bar.reset_eta();
        bar.enable_steady_tick(Duration::from_millis(500));
        Progress { bar }
    }

    fn line(&self, text: &str) {
        if self.bar.is_hidden() {
            eprintln!("{text}");
        } else {
            self.bar.println(text);
        }
    }
}

impl Observer for Progress {
    fn on_event(&mut self, event: Event<'_>) {
        match event {
            Event::Step(s) => {
                self.bar.set_position(s.step as u64);
                self.bar.set_message(format!(
                    "loss {:.4} | lr {:.2e} | gnorm {:.3} | {:.0} tok/s | {:.1} ms | MFU {:.1}%",
                    s.loss,
                    s.lr,
                    s.grad_norm,
                    s.tokens_per_sec,
                    s.step_ms,
                    100.0 * s.mfu
                ));
                if self.bar.is_hidden() && (s.step % 50 == 0 || s.step == 1) {
                    eprintln!(
                        "step {:>6} | loss {:.4} | lr {:.2e} | gnorm {:.3} | {:.0} tok/s | {:.1} ms | MFU {:.1}%",
                        s.step,
                        s.loss,
                        s.lr,
                        s.grad_norm,
                        s.tokens_per_sec,
                        s.step_ms,
                        100.0 * s.mfu
                    );
                }
            }
            Event::Eval(e) => {
                let score = match (&e.score, &e.score_name) {
                    (Some(s), Some(n)) => format!(" | {n} {:.1}%", 100.0 * s),
                    _ => String::new(),
                };
                self.line(&format!(
                    "eval step {:>6} | train {:.4} | val {:.4}{score}",
                    e.step, e.train_loss, e.val_loss
                ));
            }
            Event::Sample(text) => self.line(&format!("--- sample ---\n{text}\n--------------")),
            Event::Checkpoint(dir) => self.line(&format!("checkpoint {}", dir.display())),
        }
    }
}

fn print_summary(trainer: &Trainer, s: &Summary) {
    let out = &trainer.config.out_dir;
    println!(
        "{}",
        if s.interrupted {
            "== interrupted =="
        } else {
            "== done =="
        }
    );
    println!("steps          {}", s.step);
    println!(
        "time           {:.1} s ({:.0} tokens/s)",
        s.elapsed_secs,
        s.tokens_seen as f64 / s.elapsed_secs.max(1e-9)
    );
    let cfg = &trainer.config;
    let mfu = trainer::mfu::flops_per_token(&trainer.model.config, cfg.block_size)
        * s.tokens_seen as f64
        / s.elapsed_secs.max(1e-9)
        / trainer.peak_flops();
    println!(
        "MFU            {:.1}% of {:.1} GFLOP/s ({}, kernels {})",
        100.0 * mfu,
        trainer.peak_flops() / 1e9,
        if cfg.peak_flops > 0.0 {
            "--peak-flops"
        } else {
            "measured matmul ceiling"
        },
        cfg.kernels
    );
    if let Some(e) = &s.last_eval {
        println!("train loss     {:.4}", e.train_loss);
        println!("val loss       {:.4}", e.val_loss);
        if let (Some(score), Some(name)) = (e.score, &e.score_name) {
            println!("{name:<14} {:.1}%", 100.0 * score);
        }
    }
    if let Some(b) = s.best_val_loss {
        println!("best val loss  {b:.4}");
    }
    if let Some(c) = &s.checkpoint {
        println!("checkpoint     {}", c.display());
    }
    println!("metrics        {}", out.join("metrics.jsonl").display());
    println!("loss curve     {}", out.join("loss.svg").display());
}

/// How `sample` turns text into tokens and back.
enum Codec {
    /// A run's data source (trainer checkpoints).
    Data(Box<dyn trainer::data::DataSource>),
    /// A tokenizer.json.
    Tokenizer(Box<TokenizerFile>),
}

impl Codec {
    /// `--tokenizer-path`, else the run's data, else the model directory's tokenizer.json.
    fn for_model(model: &ModelDir, tokenizer: Option<&Path>) -> Result<Self> {
        if let Some(path) = tokenizer {
            return Ok(Codec::Tokenizer(Box::new(TokenizerFile::open(path)?)));
        }
        if let Some(run) = model.run_config() {
            let data = trainer::train::open_data_for(run).with_context(|| {
                format!(
                    "cannot open the data of the run of {} to encode the prompt (or give \
                     --tokenizer-path)",
                    model.dir.display()
                )
            })?;
            let state = model.run.as_ref().map(|r| r.data.as_ref());
            trainer::train::check_fingerprint(state.flatten(), data.as_ref(), &model.dir, false)?;
            return Ok(Codec::Data(data));
        }
        Ok(Codec::Tokenizer(Box::new(model.tokenizer()?)))
    }

    fn encode(&self, text: &str) -> trainer::Result<Vec<u32>> {
        match self {
            Codec::Data(d) => d.encode(text),
            Codec::Tokenizer(t) => t.encode(text),
        }
    }

    fn decode(&self, ids: &[u32]) -> trainer::Result<String> {
        match self {
            Codec::Data(d) => d.decode(ids),
            Codec::Tokenizer(t) => t.decode(ids),
        }
    }
}

fn sample(args: SampleArgs) -> Result<()> {
    let model_dir = ModelDir::open(&args.model)?;
    let device = args.device.open()?;
    let codec = Codec::for_model(&model_dir, args.tokenizer_path.as_deref())?;
    let model = model_dir.load_model(&device)?;
    let prompt = codec
        .encode(&args.prompt)
        .with_context(|| format!("cannot encode the prompt {:?}", args.prompt))?;
    let prompt = if prompt.is_empty() {
        vec![model.config.bos_token_id.unwrap_or(0)]
    } else {
        prompt
    };
    let sampling = SamplingConfig {
        temperature: args.temperature,
        top_k: Some(args.top_k),
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    for i in 0..args.num_samples {
        let out = generate(
            &model,
            &prompt,
            args.max_new_tokens,
            sampling,
            &mut rng,
            &device,
        )?;
        if i > 0 {
            println!("---------------");
        }
        println!("{}", codec.decode(&out)?);
    }
    Ok(())
}

fn eval(args: EvalArgs) -> Result<()> {
    let model = ModelDir::open(&args.model)?;
    let e = args
        .request
        .evaluate(&model)
        .with_context(|| format!("cannot evaluate {}", model.dir.display()))?;
    println!("step        {}", e.step);
    println!("train loss  {:.4}", e.train_loss);
    println!("val loss    {:.4}", e.val_loss);
    if let (Some(s), Some(n)) = (e.score, &e.score_name) {
        println!("{n}  {:.1}%", 100.0 * s);
    }
    Ok(())
}

fn inspect(args: InspectArgs) -> Result<()> {
    let spec = &args.checkpoint;
    let (model_file, dir) = if Path::new(spec).is_file() {
        (PathBuf::from(spec), None)
    } else {
        let dir = trainer::pretrained::resolve(spec)?;
        (dir.join(checkpoint::MODEL_FILE), Some(dir))
    };
    let loaded = checkpoint::io::load_safetensors(&model_file, &candle_core::Device::Cpu)?;
    let mut names: Vec<_> = loaded.tensors.keys().cloned().collect();
    names.sort();
    println!("file        {}", model_file.display());
    let mut total = 0usize;
    for n in &names {
        let t = &loaded.tensors[n];
        total += t.elem_count();
        println!(
            "  {n:<44} {:<14} {:?}",
            format!("{:?}", t.dims()),
            t.dtype()
        );
    }
    println!("tensors     {}", names.len());
    println!("parameters  {total} ({:.2}M)", total as f64 / 1e6);
    drop(loaded);
    if let Some(dir) = dir {
        inspect_dir(&dir, &model_file)?;
    }
    Ok(())
}

/// Prints the config, the weight check and the trainer state of checkpoint or model directory
/// `dir`; weights that do not match `config.json` are an error (after the report).
fn inspect_dir(dir: &Path, model_file: &Path) -> Result<()> {
    let cfg_path = dir.join(checkpoint::CONFIG_FILE);
    let mut mismatch = None;
    if cfg_path.is_file() {
        let cfg = trainer::model::GptConfig::from_hf_json_file(&cfg_path)?;
        println!(
            "config      n_layer {} n_head {} n_embd {} block_size {} vocab_size {} dropout {} bias {}",
            cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.dropout, cfg.bias
        );
        let id = |t: Option<u32>| t.map_or("none".to_string(), |t| t.to_string());
        println!(
            "special     bos {} eos {}",
            id(cfg.bos_token_id),
            id(cfg.eos_token_id)
        );
        // The loader's own check: Hugging Face names (no `transformer.` prefix, mask buffers,
        // a tied lm_head) are accepted as they are when training.
        match checkpoint::load_params(model_file, &cfg, &candle_core::Device::Cpu) {
            Ok(_) => println!("check       weights match the config"),
            Err(e) => {
                println!("check       MISMATCH");
                mismatch = Some(
                    anyhow::Error::new(e)
                        .context(format!("the weights do not match {}", cfg_path.display())),
                );
            }
        }
    }
    let state_path = dir.join(checkpoint::STATE_FILE);
    if state_path.is_file() {
        let state: TrainerState = checkpoint::io::read_json(&state_path)?;
        println!("step        {}", state.step);
        println!("tokens      {}", state.tokens_seen);
        if let Some(b) = state.best_val_loss {
            println!(
                "best val    {b:.4} ({})",
                state.best_checkpoint.unwrap_or_default()
            );
        }
        println!("--- run config ---\n{}", state.config.to_toml());
    }
    mismatch.map_or(Ok(()), Err)
}
