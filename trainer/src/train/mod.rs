//! Training a model: building a run ([`Trainer::builder`], `builder.rs`, which
//! [`Trainer::new`] and [`Trainer::with_model`] call; [`Trainer::resume`], here), the loop with evaluation and checkpoints (`run.rs`), one
//! step (`step.rs`: micro-batches, accumulation, the data-parallel reduction, the scaler's
//! step with clipping and the optimiser), and how a micro-batch's forward and backward run
//! (`executor.rs`: plain, remat or a [`PipelineRun`]).

mod builder;
mod cast;
mod eval;
pub(crate) mod executor;
pub(crate) mod memory;
pub(crate) mod parallel;
pub(crate) mod pipeline;
mod reference;
mod run;
mod save;
mod step;
pub(crate) mod zero;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_amp::Amp;
use candle_comm::Communicator;
use candle_core::{DType, Device, Var};
use candle_remat::Plan;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub(crate) use builder::OptimizerFn;
pub use builder::TrainerBuilder;

use crate::pretrained::task_score_until;
pub(crate) use executor::MicroLoss;
pub use executor::{remat_plan, run_chain, Executor};
pub use memory::{estimate_step_bytes, trained_bytes_per_param, MemorySettings};
pub use parallel::{communicator_from_env, DataParallel};
pub use pipeline::{ExecutorSettings, PipelineRun};
pub use run::{Event, Observer, Summary};
pub(crate) use step::build_amp;

use crate::checkpoint::{self, TrainerState};
use crate::config::{Precision, TrainConfig};
use crate::data::{DataSource, Split};
use crate::lora::Tuning;
use crate::metrics::EvalStats;
use crate::model::{Model, ModelConfig, Params};
use crate::objective::Objective;
use crate::optim::Optimizer;
use crate::run_dir::{self, Claim, RunDir};
use crate::schedule::LrSchedule;
use crate::{load, Error, Result};

/// Loss-scaler state file in a checkpoint of a mixed-precision run.
pub const AMP_FILE: &str = "amp.safetensors";

/// A training run: model, optimiser, data and the position in the run.
pub struct Trainer {
    /// The run's config.
    pub config: TrainConfig,
    /// Where tensors live.
    pub device: Device,
    /// The data source.
    pub data: Box<dyn DataSource>,
    /// The model.
    pub model: Box<dyn Model>,
    /// Its parameters.
    pub params: Params,
    /// The optimiser ([`crate::optim::build`] makes the config's; a program may put in its own before
    /// [`Trainer::with_comm`] and training, and resume with it by [`Trainer::resume_with`]).
    pub optimizer: Box<dyn Optimizer>,
    /// The loss ([`crate::objective::build`] makes the config's `objective`; a program may
    /// put in its own before training, and again after a resume).
    pub objective: Arc<dyn Objective>,
    vars: Vec<Var>,
    dtype: DType,
    executor: Executor,
    amp: Amp,
    schedule: LrSchedule,
    ceiling: crate::mfu::Ceiling,
    flops_per_token: f64,
    rng: ChaCha8Rng,
    step: usize,
    tokens_seen: u64,
    best_val_loss: Option<f32>,
    best_checkpoint: Option<String>,
    elapsed_secs: f64,
    last_checkpoint: Option<PathBuf>,
    claim: Claim,
    run_dir: Option<RunDir>,
    dp: DataParallel,
    shards: zero::Shards,
    /// The world size of the checkpoint this run resumed from.
    resumed_world: Option<usize>,
    /// Every weight, or LoRA adapters over a frozen base.
    tuning: Tuning,
    /// Whether the run has a run directory to write into (see [`TrainerBuilder::run_dir`]).
    writes: bool,
    /// Whether the data has held-out batches to evaluate on (a batch iterator has none).
    evaluates: bool,
}

impl Trainer {
    /// Starts a new run from `config` (fresh weights, or `init_from` pretrained ones), in the
    /// run directory `config.out_dir`: [`Trainer::builder`] given the config.
    pub fn new(config: TrainConfig) -> Result<Self> {
        let out_dir = config.out_dir.clone();
        Self::builder().config(config).run_dir(out_dir).build()
    }

    /// Starts a new run of a model the caller built (any [`Model`]: the trainer knows it only
    /// through that interface), over its parameters on `config.device`, in the run directory
    /// `config.out_dir`: [`Trainer::builder`] given the config and the model. Its architecture
    /// must be known to the loading paths ([`crate::model::register`]) for checkpoints to
    /// resume.
    pub fn with_model(config: TrainConfig, model: Box<dyn Model>, params: Params) -> Result<Self> {
        let out_dir = config.out_dir.clone();
        Self::builder()
            .config(config)
            .model(model, params)
            .run_dir(out_dir)
            .build()
    }

    fn start(
        mut config: TrainConfig,
        device: Device,
        data: Box<dyn DataSource>,
        model: Box<dyn Model>,
        params: Params,
        tuning: Tuning,
        optimizer: OptimizerFn,
    ) -> Result<Self> {
        let mc = model.config();
        if config.block_size > mc.max_positions() {
            return Err(Error::Config(format!(
                "block_size {} exceeds the model's {} positions ({})",
                config.block_size,
                mc.max_positions(),
                mc.describe()
            )));
        }
        if data.vocab_size() > mc.vocab_size() {
            return Err(Error::Config(format!(
                "the data has {} token ids but the model ({}) embeds only {}",
                data.vocab_size(),
                mc.describe(),
                mc.vocab_size()
            )));
        }
        // A pretrained model brings its own shape: record it, so that run.toml and the saved
        // trainer state describe the model that is trained.
        let shape = mc.shape();
        config.n_layer = shape.n_layer;
        config.n_head = shape.n_head;
        config.n_embd = shape.n_embd;
        config.bias = shape.bias;
        if let Ok(arch) = mc.architecture().parse() {
            config.arch = arch;
        }
        let optimizer = optimizer(&config, &params)?;
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Self::assemble(config, device, data, model, params, optimizer, rng, tuning)
    }

    /// Continues the run saved in `path` (a run directory or a checkpoint directory).
    ///
    /// The run continues in the run directory that holds the checkpoint (`RUN` for
    /// `RUN/checkpoints/step-N`), whatever `out_dir` the checkpoint recorded. `adjust` may
    /// change the saved config (e.g. a longer `max_iters`); setting `out_dir` to another
    /// directory forks the run there (which must not hold a run). Fields that define the model
    /// or the data cannot change, and an attempt is an error.
    pub fn resume(path: &Path, adjust: impl FnOnce(&mut TrainConfig)) -> Result<Self> {
        Self::resume_with(path, adjust, builder::run_optimizer)
    }

    /// [`Trainer::resume`] with the optimiser `optimizer` builds (given the run's config and
    /// parameters), its state loaded from the checkpoint by name: how a program that trained
    /// with an optimiser of its own continues its run.
    pub fn resume_with(
        path: &Path,
        adjust: impl FnOnce(&mut TrainConfig),
        optimizer: impl FnOnce(&TrainConfig, &Params) -> Result<Box<dyn Optimizer>>,
    ) -> Result<Self> {
        let dir = checkpoint::resolve(path)?;
        let state: TrainerState = checkpoint::io::read_json(&dir.join(checkpoint::STATE_FILE))?;
        let (config, claim) = resumed_config(&state, &dir, adjust)?;
        let device = config.open_device()?;
        let data = config.open_data()?;
        // The one loading path (`crate::load`): the data and config.json against the run,
        // memory, the weights, then the optimiser state, then the manifest.
        let quant = config.nf4_settings();
        let step = memory::MemorySettings::from(&config);
        let fits = |m: &dyn ModelConfig, d: &Device, q: Option<bool>| {
            memory::check_loaded_fits(&step, m, d, q).map_err(Into::into)
        };
        let checks = load::Checks {
            train: Some(&fits),
            data: Some(load::DataCheck {
                source: data.as_ref(),
                fingerprint: load::FingerprintCheck::Corpus,
            }),
            unmerged: true,
            four_bit: quant
                .as_ref()
                .map_or(load::FourBit::Refuse, load::FourBit::Quantize),
            ..load::Checks::default()
        };
        // A LoRA run's checkpoint holds its adapters; the frozen base is its `init_from`,
        // checked against the identity the run recorded.
        let (_, (model, params, tuning, optimizer)) =
            load::ModelDir::at(dir.clone())?.load_then(&checks, &device, |l| {
                // The base was checked against the recorded one by the loader; the run goes
                // on recording its identity as found now (an old run's file digests become
                // the semantic identity).
                let (model, params, tuning) =
                    builder::resume_model(l, state.base.is_some(), &config, &dir)?;
                let mut o = optimizer(&config, &params)?;
                checkpoint::load_optimizer(&dir, o.as_mut(), &device)?;
                Ok::<_, Error>((model, params, tuning, o))
            })?;
        // The manifest holds (checked last by the loader); the files must also be the ones
        // trainer_state.json was saved with.
        let weights = checkpoint::ModelFiles::of(&tuning, model.config()).weights_file();
        checkpoint::check_files_match(&dir, &state, weights)?;
        let rng = state.rng.restore()?;
        let mut t = Self::assemble(config, device, data, model, params, optimizer, rng, tuning)?;
        t.restore_scaler(&state, &dir)?;
        t.step = state.step;
        t.tokens_seen = state.tokens_seen;
        t.best_val_loss = state.best_val_loss;
        t.best_checkpoint = state.best_checkpoint;
        t.elapsed_secs = state.elapsed_secs;
        t.last_checkpoint = Some(dir);
        t.claim = claim;
        t.resumed_world = Some(state.world_size);
        Ok(t)
    }

    /// Loads the loss scaler's state saved in the checkpoint `dir`, when the checkpoint ran
    /// the same scaler; warns and keeps the fresh one otherwise.
    fn restore_scaler(&mut self, state: &TrainerState, dir: &Path) -> Result<()> {
        // The scaler's state continues only under the same scaler: a run resumed in another
        // precision or with another loss_scale starts a fresh one (an f32 run's scale 1 would
        // be f16's minimum scale; an f16 run's 2^16 would stay on in f32).
        let path = dir.join(AMP_FILE);
        let saved = state.config.loss_scale.scaler(state.config.dtype);
        if saved != self.config.loss_scale.scaler(self.config.dtype) {
            tracing::warn!(
                "the checkpoint's loss scaler ({} with loss_scale {}) differs from this run's \
                 ({} with loss_scale {}): starting a fresh scaler",
                state.config.dtype,
                state.config.loss_scale,
                self.config.dtype,
                self.config.loss_scale
            );
        } else if path.exists() {
            self.amp.load_state(&path).map_err(|e| Error::AmpState {
                path: path.clone(),
                source: Box::new(e),
            })?;
        } else if self.config.dtype != Precision::F32 {
            tracing::warn!(
                "{} has no loss-scaler state (saved as {}): starting a fresh scaler",
                dir.display(),
                state.config.dtype
            );
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: TrainConfig,
        device: Device,
        data: Box<dyn DataSource>,
        model: Box<dyn Model>,
        params: Params,
        optimizer: Box<dyn Optimizer>,
        rng: ChaCha8Rng,
        tuning: Tuning,
    ) -> Result<Self> {
        // Before the first matmul (the peak-FLOP/s measurement below runs in TF32 too).
        crate::runtime::apply_gpu_settings(config.tf32, config.triton_kernels);
        let dtype = config.dtype.dtype();
        params.check_ownership(&model.links())?;
        let executor = Executor::build(&(&config).into(), model.as_ref(), &params, &device)?;
        let ceiling = if config.peak_flops > 0.0 {
            crate::mfu::Ceiling::new(config.peak_flops, true)
        } else {
            // On a CPU, Candle's f16/bf16 GEMMs are not faster than f32: measure f32.
            let peak_dtype = if device.is_cpu() { DType::F32 } else { dtype };
            crate::mfu::Ceiling::new(
                crate::mfu::measure_matmul_flops(&device, peak_dtype)?,
                false,
            )
        };
        let lora = tuning.trainable_split(&params);
        let flops_per_token =
            crate::mfu::training_flops_per_token(model.config(), config.block_size, lora);
        let objective = Arc::from(crate::objective::build(&config)?);
        Ok(Trainer {
            ceiling,
            flops_per_token,
            schedule: config.lr_schedule(),
            vars: params.vars(),
            executor,
            amp: build_amp(&params, config.dtype, config.loss_scale, config.grad_clip)?,
            dtype,
            config,
            device,
            data,
            model,
            params,
            optimizer,
            objective,
            rng,
            step: 0,
            tokens_seen: 0,
            best_val_loss: None,
            best_checkpoint: None,
            elapsed_secs: 0.0,
            last_checkpoint: None,
            claim: Claim::Fresh,
            run_dir: None,
            dp: DataParallel::single(),
            shards: zero::Shards::none(),
            resumed_world: None,
            tuning,
            writes: true,
            evaluates: true,
        })
    }

    /// Lets a new run replace the run already in its `out_dir` (its checkpoints, metrics and
    /// loss curve are deleted when the run starts) instead of refusing to start. No effect on a
    /// resumed run, which continues its own directory.
    pub fn overwrite(mut self, yes: bool) -> Self {
        if self.claim != Claim::Continue {
            self.claim = if yes { Claim::Overwrite } else { Claim::Fresh };
        }
        self
    }

    /// Makes this trainer rank `comm.rank()` of `comm.world_size()` data-parallel replicas
    /// (see [`DataParallel`]): every rank must build its trainer from the same config (or resume
    /// the same checkpoint) and call this. Rank 0's weights are broadcast to the others; rank 0
    /// alone writes the run directory. A resumed run must keep its world size.
    pub fn with_comm(mut self, comm: Box<dyn Communicator>) -> Result<Self> {
        let world = comm.world_size();
        self.check_world(world)?;
        if world > 1 && !crate::config::tracks_streams(&self.device) {
            return Err(Error::Config(format!(
                "this trainer's CUDA device was prepared for a run on one stream (no events \
                 per allocation); {world} data-parallel ranks need the ranks announced by the \
                 launcher's environment before the trainer is built (see \
                 `trainer::train::parallel::world_size_from_env`)"
            )));
        }
        self.dp = DataParallel::new(comm, self.vars.clone())?;
        self.dp.broadcast_from_main(&self.vars)?;
        self.dp.ensure_in_sync(&self.vars)?;
        if self.config.zero == 1 && world > 1 {
            // ZeRO-1: keep (and update) this rank's shard of the optimiser state only.
            self.shards = zero::Shards::balanced(&self.params, world, self.optimizer.as_ref());
            let (shards, rank) = (&self.shards, self.dp.rank());
            self.optimizer.retain(&|name| shards.owner(name) == rank);
        }
        Ok(self)
    }

    /// The data-parallel group this trainer belongs to (a world of one by default).
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    fn check_world(&self, world: usize) -> Result<()> {
        match self.resumed_world {
            Some(saved) if saved != world => Err(Error::Config(format!(
                "the checkpoint was written by {saved} data-parallel rank(s) and this run has \
                 {world}: resume with the same number of processes (the global batch and the \
                 data stream depend on it)"
            ))),
            _ => Ok(()),
        }
    }

    /// Claims the run directory on first use (see [`crate::run_dir`]): refuses to start a
    /// fresh run over an existing one, locks it, and cleans a killed writer's leftovers.
    pub fn claim_run_dir(&mut self) -> Result<()> {
        self.check_writes()?;
        if self.run_dir.is_none() && self.dp.is_main() {
            self.run_dir = Some(RunDir::claim(&self.config.out_dir, self.claim)?);
            self.claim = Claim::Continue;
        }
        Ok(())
    }

    fn check_writes(&self) -> Result<()> {
        match self.writes {
            true => Ok(()),
            false => Err(Error::Config(
                "this run has no run directory (Trainer::builder() without run_dir): it writes \
                 no checkpoints, metrics or run.toml"
                    .into(),
            )),
        }
    }

    /// The activation-checkpointing plan of the whole chain, if `remat` is on (a pipeline
    /// plans per stage).
    pub fn remat_plan(&self) -> Option<&Plan> {
        self.executor.plan()
    }

    /// The peak FLOP/s MFU is measured against (`peak_flops`, or a measured matmul ceiling),
    /// raised to the best rate a step achieved ([`crate::mfu::Ceiling`]).
    pub fn peak_flops(&self) -> f64 {
        self.ceiling.flops
    }

    /// The MFU ceiling: where it came from and whether a step raised it.
    pub fn ceiling(&self) -> crate::mfu::Ceiling {
        self.ceiling
    }

    /// Model FLOPs of one token of a training step (LoRA: frozen weights count 4, trained
    /// ones 6; [`crate::mfu::training_flops_per_token`]).
    pub fn flops_per_token(&self) -> f64 {
        self.flops_per_token
    }

    /// How a micro-batch's forward and backward run (plain, remat plan or pipeline).
    pub fn executor(&self) -> &Executor {
        &self.executor
    }

    /// The loss scaler and its state (a no-op scaler in f32).
    pub fn amp(&self) -> &Amp {
        &self.amp
    }

    /// Whether the run trains every weight or LoRA adapters over a frozen base.
    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    /// Whether the run writes a run directory (`run.toml`, metrics, checkpoints): the one
    /// in `config.out_dir`, or none for a [`Trainer::builder`] run without
    /// [`TrainerBuilder::run_dir`].
    pub fn writes(&self) -> bool {
        self.writes
    }

    /// Optimiser steps completed.
    pub fn step(&self) -> usize {
        self.step
    }

    /// Measures train and val loss (and the task score, if any) without touching the training
    /// RNG: evaluation batches come from a generator seeded by the run seed, so every
    /// evaluation sees the same batches.
    pub fn evaluate(&self) -> Result<EvalStats> {
        let never = std::sync::atomic::AtomicBool::new(false);
        match self.evaluate_until(&never)? {
            Some(stats) => Ok(stats),
            None => unreachable!("an evaluation without a stop flag runs to its end"),
        }
    }

    /// [`Trainer::evaluate`], given up between batches once `stop` is set (Ctrl-C, SIGTERM):
    /// `None`, so that a signal during a long evaluation does not wait for its end.
    pub fn evaluate_until(
        &self,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<EvalStats>> {
        if !self.evaluates {
            return Err(Error::Config(
                "this run's data is a batch iterator, with no held-out batches to evaluate on"
                    .into(),
            ));
        }
        let cfg = &self.config;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xE7A1);
        let Some(train_loss) = eval::estimate_loss_until(self, Split::Train, &mut rng, stop)?
        else {
            return Ok(None);
        };
        let Some(val_loss) = eval::estimate_loss_until(self, Split::Val, &mut rng, stop)? else {
            return Ok(None);
        };
        let Some(objective) = eval::objective_until(self, stop)? else {
            return Ok(None);
        };
        let (score, score_name) = match self.data.task() {
            Some(task) if cfg.eval_problems > 0 => {
                let Some(score) = task_score_until(
                    self.model.as_ref(),
                    task,
                    cfg.eval_problems,
                    &self.device,
                    stop,
                )?
                else {
                    return Ok(None);
                };
                (Some(score), Some(task.name().to_string()))
            }
            _ => (None, None),
        };
        Ok(Some(EvalStats {
            step: self.step,
            train_loss,
            val_loss,
            score,
            score_name,
            objective,
        }))
    }
}

/// The config a run resumed from the checkpoint `dir` continues with (`adjust`ed, paths
/// absolute, checked against the saved one and validated), and whether it continues the
/// checkpoint's own run directory or starts another.
fn resumed_config(
    state: &TrainerState,
    dir: &Path,
    adjust: impl FnOnce(&mut TrainConfig),
) -> Result<(TrainConfig, Claim)> {
    let mut config = state.config.clone();
    let home = run_dir::run_dir_of(dir);
    config.out_dir = home.clone().unwrap_or_default();
    // The cosine decay ends at max_iters unless lr_decay_iters is set: pin it to the saved
    // run's end, so that resuming with a larger max_iters continues the same schedule
    // (constant min_lr after the old end) instead of jumping back up.
    if config.lr_decay_iters.is_none() {
        config.lr_decay_iters = Some(state.config.max_iters);
    }
    adjust(&mut config);
    if config.out_dir.as_os_str().is_empty() {
        return Err(Error::Config(format!(
            "{} is not inside a run directory (RUN/checkpoints/step-N): choose the run \
             directory to continue in with --out-dir",
            dir.display()
        )));
    }
    let same_dir = |d: &Path| {
        home.as_deref()
            .zip(std::fs::canonicalize(d).ok())
            .is_some_and(|(h, d)| h == d)
    };
    let claim = if same_dir(&config.out_dir) {
        Claim::Continue
    } else {
        Claim::Fresh
    };
    // Paths compare (and are kept) absolute: a checkpoint that recorded relative ones
    // (written before they were made absolute) resolves them from here, as it opens them.
    config.absolute_paths()?;
    let mut saved = state.config.clone();
    saved.absolute_paths()?;
    crate::config::resume::check_resume_compatible(&saved, &config, dir)?;
    config.validate()?;
    Ok((config, claim))
}
