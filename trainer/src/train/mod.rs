//! The training loop: micro-batches, gradient accumulation, clipping, AdamW, evaluation,
//! checkpoints and exact resume.

pub mod compose;
mod eval;
mod init;
pub mod parallel;
pub mod pipeline;
mod run;
mod save;
pub mod step;
pub mod zero;

use std::path::{Path, PathBuf};

use std::time::Instant;

use candle_amp::{Amp, StepOutcome};
use candle_comm::Communicator;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Var};
use candle_remat::Plan;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub use eval::{estimate_loss, task_score};
pub use init::{check_fingerprint, open_data as open_data_for};
pub use parallel::DataParallel;
pub use run::{Event, Observer, Summary};
pub use step::Executor;

use crate::checkpoint::{self, TrainerState};
use crate::config::{Precision, TrainConfig};
use crate::data::{DataSource, Split};
use crate::metrics::{EvalStats, StepStats};
use crate::model::{Ctx, Gpt, Params};
use crate::optim::{accumulate, global_grad_norm, AdamW};
use crate::run_dir::{self, Claim, RunDir};
use crate::schedule::LrSchedule;
use crate::{Error, Result};

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
    pub model: Gpt,
    /// Its parameters.
    pub params: Params,
    /// The optimiser.
    pub optimizer: AdamW,
    vars: Vec<Var>,
    dtype: DType,
    executor: Executor,
    amp: Amp,
    schedule: LrSchedule,
    peak_flops: f64,
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
}

impl Trainer {
    /// Starts a new run from `config` (fresh weights, or `init_from` pretrained ones).
    pub fn new(config: TrainConfig) -> Result<Self> {
        config.validate()?;
        let device = config.device.open()?;
        let data = init::open_data(&config)?;
        let (model, params) = init::build_model(&config, data.as_ref(), &device)?;
        // A pretrained model brings its own shape: record it, so that run.toml and the saved
        // trainer state describe the model that is trained.
        let mut config = config;
        config.n_layer = model.config.n_layer;
        config.n_head = model.config.n_head;
        config.n_embd = model.config.n_embd;
        config.bias = model.config.bias;
        let optimizer = AdamW::new(&params, config.adamw_config())?.with_kernels(config.kernels);
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Self::assemble(config, device, data, model, params, optimizer, rng)
    }

    /// Continues the run saved in `path` (a run directory or a checkpoint directory).
    ///
    /// The run continues in the run directory that holds the checkpoint (`RUN` for
    /// `RUN/checkpoints/step-N`), whatever `out_dir` the checkpoint recorded. `adjust` may
    /// change the saved config (e.g. a longer `max_iters`); setting `out_dir` to another
    /// directory forks the run there (which must not hold a run). Fields that define the model
    /// or the data cannot change, and an attempt is an error.
    pub fn resume(path: &Path, adjust: impl FnOnce(&mut TrainConfig)) -> Result<Self> {
        let dir = checkpoint::resolve(path)?;
        let state: TrainerState = checkpoint::io::read_json(&dir.join(checkpoint::STATE_FILE))?;
        let mut config = state.config.clone();
        let home = run_dir::run_dir_of(&dir);
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
        init::check_resume_compatible(&state.config, &config, &dir)?;
        config.validate()?;
        let device = config.device.open()?;
        let data = init::open_data(&config)?;
        init::check_fingerprint(state.data.as_ref(), data.as_ref(), &dir, true)?;
        let (gpt_config, params) = checkpoint::load_model(&dir, &device)?;
        init::check_model_matches(&gpt_config, &config, data.as_ref(), &dir)?;
        let model = Gpt::from_params(&gpt_config, &params)?;
        let mut optimizer =
            AdamW::new(&params, config.adamw_config())?.with_kernels(config.kernels);
        checkpoint::load_optimizer(&dir, &mut optimizer, &device)?;
        let rng = state.rng.restore()?;
        let mut t = Self::assemble(config, device, data, model, params, optimizer, rng)?;
        // The scaler's state continues only under the same scaler: a run resumed in another
        // precision or with another loss_scale starts a fresh one (an f32 run's scale 1 would
        // be f16's minimum scale; an f16 run's 2^16 would stay on in f32).
        let path = dir.join(AMP_FILE);
        let saved = state.config.loss_scale.scaler(state.config.dtype);
        if saved != t.config.loss_scale.scaler(t.config.dtype) {
            tracing::warn!(
                "the checkpoint's loss scaler ({} with loss_scale {}) differs from this run's \
                 ({} with loss_scale {}): starting a fresh scaler",
                state.config.dtype,
                state.config.loss_scale,
                t.config.dtype,
                t.config.loss_scale
            );
        } else if path.exists() {
            t.amp
                .load_state(&path)
                .map_err(|e| Error::checkpoint(&path, e.to_string()))?;
        } else if t.config.dtype != Precision::F32 {
            tracing::warn!(
                "{} has no loss-scaler state (saved as {}): starting a fresh scaler",
                dir.display(),
                state.config.dtype
            );
        }
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

    fn assemble(
        config: TrainConfig,
        device: Device,
        data: Box<dyn DataSource>,
        model: Gpt,
        params: Params,
        optimizer: AdamW,
        rng: ChaCha8Rng,
    ) -> Result<Self> {
        let dtype = config.dtype.dtype();
        let executor = Executor::build(&config, &model, &params, &device, dtype)?;
        if device.is_cpu() {
            // Refuse before allocating what cannot fit (a GPU reports its own out-of-memory
            // errors; the CPU allocator aborts the process).
            let need = compose::estimate_step_bytes(&config, &model.config, dtype, executor.plan());
            compose::check_memory_fits(&config, need)?;
        }
        let peak_flops = if config.peak_flops > 0.0 {
            config.peak_flops
        } else {
            // On a CPU, Candle's f16/bf16 GEMMs are not faster than f32: measure f32.
            let peak_dtype = if device.is_cpu() { DType::F32 } else { dtype };
            crate::mfu::measure_matmul_flops(&device, peak_dtype)?
        };
        Ok(Trainer {
            peak_flops,
            schedule: config.lr_schedule(),
            vars: params.vars(),
            executor,
            amp: compose::build_amp(&config, &params)?,
            dtype,
            config,
            device,
            data,
            model,
            params,
            optimizer,
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
    /// (see [`parallel`]): every rank must build its trainer from the same config (or resume
    /// the same checkpoint) and call this. Rank 0's weights are broadcast to the others; rank 0
    /// alone writes the run directory. A resumed run must keep its world size.
    pub fn with_comm(mut self, comm: Box<dyn Communicator>) -> Result<Self> {
        let world = comm.world_size();
        self.check_world(world)?;
        self.dp = DataParallel::new(comm, self.vars.clone())?;
        self.dp.broadcast_from_main(&self.vars)?;
        self.dp.ensure_in_sync(&self.vars)?;
        if self.config.zero == 1 && world > 1 {
            // ZeRO-1: keep (and update) this rank's shard of the AdamW state only.
            self.shards = zero::Shards::balanced(&self.params, world);
            let (shards, rank) = (&self.shards, self.dp.rank());
            self.optimizer.retain(|name| shards.owner(name) == rank);
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
        if self.run_dir.is_none() && self.dp.is_main() {
            self.run_dir = Some(RunDir::claim(&self.config.out_dir, self.claim)?);
            self.claim = Claim::Continue;
        }
        Ok(())
    }

    /// The activation-checkpointing plan of the whole chain, if `remat` is on (a pipeline
    /// plans per stage).
    pub fn remat_plan(&self) -> Option<&Plan> {
        self.executor.plan()
    }

    /// The peak FLOP/s MFU is measured against (`peak_flops`, or a measured matmul ceiling).
    pub fn peak_flops(&self) -> f64 {
        self.peak_flops
    }

    /// How a micro-batch's forward and backward run (plain, remat plan or pipeline).
    pub fn executor(&self) -> &Executor {
        &self.executor
    }

    /// The loss scaler and its state (a no-op scaler in f32).
    pub fn amp(&self) -> &Amp {
        &self.amp
    }

    /// Optimiser steps completed.
    pub fn step(&self) -> usize {
        self.step
    }

    /// The dropout seed of micro-batch `micro` of step `step`: a pure function of the run seed,
    /// so a resumed run draws the same masks and needs no dropout RNG state. Data-parallel
    /// ranks share it and key their masks by their rows of the global batch ([`Ctx::row`]):
    /// together they draw the masks one process would.
    fn dropout_seed(&self, micro: usize) -> u64 {
        let mut z = self.config.seed ^ 0x9E37_79B9_7F4A_7C15;
        for v in [self.step as u64, micro as u64] {
            z = (z ^ v).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z ^= z >> 31;
        }
        z
    }

    /// Runs one optimiser step (`grad_accum` micro-batches) and returns its statistics.
    ///
    /// One path for every precision and executor. The loss is scaled by the loss scaler (a
    /// no-op in f32, as PyTorch's `GradScaler(enabled=False)`); the update is `candle-amp`'s
    /// overflow-checked step over the fused gradient norm, with unscaling and clipping folded
    /// into AdamW's gradient coefficient. The non-finite policy: a non-finite loss is an
    /// error; non-finite gradients skip the step when the scaler can back off (dynamic
    /// scaling), and are an error otherwise (f32, bf16, a static scale), where retrying
    /// could not help. Either way the weights are untouched.
    pub fn train_step(&mut self) -> Result<StepStats> {
        let start = Instant::now();
        let cfg = &self.config;
        let lr = self.schedule.at(self.step);
        let mut grads = GradStore::default();
        let mut loss_sum = 0f32;
        // The weights in the compute dtype, cast once per step (not at every use, not per
        // micro-batch); free in f32. Pipeline stages hold the master weights and cast at use.
        let model = match self.executor {
            Executor::Pipeline(_) => self.model.clone(),
            _ => self.model.to_dtype(self.dtype)?,
        };
        let accum = cfg.grad_accum;
        let world = self.dp.world_size();
        let scale = self.amp.scale();
        for micro in 0..accum {
            // Every rank draws the global batch and trains on its shard (a world of one: all).
            let global = self.data.batch(
                Split::Train,
                world * cfg.batch_size,
                cfg.block_size,
                &mut self.rng,
                &self.device,
            )?;
            let (batch, shard_weight) = self.dp.shard(global, cfg.batch_size)?;
            let ctx = Ctx::train(self.dropout_seed(micro))
                .with_row(self.dp.rank() * cfg.batch_size)
                .with_dtype(self.dtype)
                .with_kernels(cfg.kernels);
            let weight = shard_weight / accum as f64 * scale;
            let (loss, g) = self
                .executor
                .forward_backward(&model, &batch, &ctx, weight)?;
            loss_sum += loss * shard_weight as f32;
            accumulate(&mut grads, g, &self.vars)?;
        }
        let loss = self.dp.reduce(&mut grads, loss_sum / accum as f32)?;
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                step: self.step + 1,
                loss,
            });
        }
        candle_nn::Optimizer::set_learning_rate(&mut self.optimizer, lr);
        let outcome = self.amp.step(&grads, &mut self.optimizer)?;
        let (grad_norm, skipped) = match outcome {
            StepOutcome::Applied { grad_norm, .. } => (grad_norm as f32, false),
            StepOutcome::Skipped {
                scale_before,
                scale_after,
                change,
                nonfinite_params,
                ..
            } => {
                if change != candle_amp::ScaleChange::BackedOff
                    && change != candle_amp::ScaleChange::HysteresisAbsorbed
                {
                    return Err(Error::NonFiniteGradient {
                        step: self.step + 1,
                        // Computed again on this failure path only.
                        norm: global_grad_norm(&grads, &self.vars, cfg.kernels)?,
                        params: nonfinite_params,
                    });
                }
                tracing::warn!(
                    "step {}: inf/NaN gradients (in {} parameters, first: {:?}) at loss scale \
                     {scale_before}: update skipped, scale now {scale_after}",
                    self.step + 1,
                    nonfinite_params.len(),
                    nonfinite_params.first()
                );
                (f32::NAN, true)
            }
        };
        // Reported in mixed precision, and in f32 when the loss is scaled explicitly.
        let scaled = cfg.loss_scale.scaler(cfg.dtype) != candle_amp::ScalerConfig::none();
        let loss_scale = (cfg.dtype != Precision::F32 || scaled).then_some(scale);
        if !skipped {
            // ZeRO-1: each rank updated its shard; hand the new weights around.
            self.shards.share_updated_weights(self.dp.comm())?;
        }
        self.step += 1;
        let tokens = (world * accum * cfg.batch_size * cfg.block_size) as u64;
        self.tokens_seen += tokens;
        let secs = start.elapsed().as_secs_f64();
        self.elapsed_secs += secs;
        let mfu = crate::mfu::mfu(
            &self.model.config,
            cfg.block_size,
            tokens,
            secs,
            self.peak_flops,
        );
        Ok(StepStats {
            step: self.step,
            loss,
            lr,
            grad_norm,
            tokens_per_sec: tokens as f64 / secs.max(1e-9),
            step_ms: secs * 1e3,
            tokens_seen: self.tokens_seen,
            mfu,
            loss_scale,
            skipped,
        })
    }

    /// Measures train and val loss (and the task score, if any) without touching the training
    /// RNG: evaluation batches come from a generator seeded by the run seed, so every
    /// evaluation sees the same batches.
    pub fn evaluate(&self) -> Result<EvalStats> {
        let cfg = &self.config;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xE7A1);
        let train_loss = estimate_loss(self, Split::Train, &mut rng)?;
        let val_loss = estimate_loss(self, Split::Val, &mut rng)?;
        let (score, score_name) = match self.data.task() {
            Some(task) if cfg.eval_problems > 0 => (
                Some(task_score(
                    &self.model,
                    task,
                    cfg.eval_problems,
                    &self.device,
                )?),
                Some(task.name().to_string()),
            ),
            _ => (None, None),
        };
        Ok(EvalStats {
            step: self.step,
            train_loss,
            val_loss,
            score,
            score_name,
        })
    }
}
