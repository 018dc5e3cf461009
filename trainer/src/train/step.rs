//! One training step: `grad_accum` micro-batches through the executor, the data-parallel
//! reduction, then the update (the loss scaler's overflow-checked step over the fused
//! gradient norm, with clipping and the optimiser), the same for every precision and executor, with
//! one host sync.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_amp::{Amp, MasterWeights, StepOutcome, WeightMode};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use rand_chacha::ChaCha8Rng;

use super::cast::CastModel;
use super::{Executor, MicroLoss, Trainer};
use crate::config::{LossScale, Precision};
use crate::data::{Batch, DataSource, Split};
use crate::lora::Tuning;
use crate::metrics::StepStats;
use crate::model::{Ctx, Params};
use crate::objective::{check_groups, units_of, Objective};
use crate::optim::{accumulate, global_grad_norm, grad_sum_of_squares};
use crate::{transfer, Error, Result};

impl Trainer {
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
    /// into the optimiser's gradient coefficient. The non-finite policy: a non-finite loss is an
    /// error; non-finite gradients skip the step when the scaler can back off (dynamic
    /// scaling), and are an error otherwise (f32, bf16, a static scale), where retrying
    /// could not help. Either way the weights are untouched.
    ///
    /// Transfers ([`crate::transfer`]): one read back from the device, the loss and the
    /// gradient norm together (the overflow check and the clipping coefficient come from that
    /// norm), and copies to the device of the batch only (a data-parallel step reads twice;
    /// a pipeline reads its microbatches' losses too).
    pub fn train_step(&mut self) -> Result<StepStats> {
        let never = AtomicBool::new(false);
        let stats = self.train_step_until(&never)?;
        stats.ok_or_else(|| Error::Config("a step was abandoned without a stop request".into()))
    }

    /// [`Trainer::train_step`], abandoned between micro-batches once `stop` is set (a signal):
    /// `None`, with the data RNG put back where the step found it and nothing else changed, so
    /// that a step of many micro-batches (`--grad-accum`) does not hold a signal up for its
    /// whole length and a checkpoint saved then resumes bit-exactly. With data parallelism the
    /// step is always finished (the ranks must agree; they stop together between steps).
    pub fn train_step_until(&mut self, stop: &AtomicBool) -> Result<Option<StepStats>> {
        let never = AtomicBool::new(false);
        let stop = if self.dp.world_size() == 1 {
            stop
        } else {
            &never
        };
        let rng_at_start = self.rng.clone();
        let stats = self.step_or_stop(stop)?;
        if stats.is_none() {
            self.rng = rng_at_start;
        }
        Ok(stats)
    }

    fn step_or_stop(&mut self, stop: &AtomicBool) -> Result<Option<StepStats>> {
        let start = Instant::now();
        let lr = self.schedule.at(self.step);
        // The weights in the compute dtype, cast once per step (not at every use, not per
        // micro-batch); free in f32. Pipeline stages hold the master weights and cast at use.
        let cast = match self.executor {
            Executor::Pipeline(_) => None,
            Executor::Plain => Some(CastModel::new(self.model.as_ref(), self.dtype, true)?),
            Executor::Remat(_) => Some(CastModel::new(self.model.as_ref(), self.dtype, false)?),
        };
        let cfg = &self.config;
        // a rank's rows of every global batch are whole groups of the objective's rows
        check_groups(
            self.objective.as_ref(),
            cfg.batch_size,
            "a rank's batch (batch_size)",
        )?;
        let scale = self.amp.scale();
        // Every rank draws the step's global batches and trains on its shard of each (a world
        // of one: all of it). The loss is the objective's mean over the whole step's units
        // (counted targets for cross-entropy): a micro-batch weighs its share of the step's
        // units (and a shard its share of the micro-batch's), so micro-batches with fewer
        // units count less. The batches are drawn one at a time (memory does not grow with
        // `grad_accum`): the step's units come first, from the same draws on the host,
        // dropped at once.
        let Some(total) = units_total(
            self.objective.as_ref(),
            self.data.as_ref(),
            &self.rng,
            cfg.grad_accum,
            self.dp.world_size() * cfg.batch_size,
            cfg.block_size,
            stop,
        )?
        else {
            return Ok(None);
        };
        self.prepare_reference()?;
        let mut grads = GradStore::default();
        self.objective.take_metrics()?; // a stopped step's, dropped
        let Some(step_loss) = self.micro_batches(cast.as_ref(), total, scale, stop, &mut grads)?
        else {
            return Ok(None);
        };
        let objective_metrics = self.dp.mean_metrics(self.objective.take_metrics()?)?;
        let (loss, norm) = self.reduce_loss_and_norm(step_loss, &mut grads)?;
        let (grad_norm, skipped) = self.update(&grads, lr, norm)?;
        // Reported in mixed precision, and in f32 when the loss is scaled explicitly.
        let cfg = &self.config;
        let scaled = cfg.loss_scale.scaler(cfg.dtype) != candle_amp::ScalerConfig::none();
        let loss_scale = (cfg.dtype != Precision::F32 || scaled).then_some(scale);
        if !skipped {
            // ZeRO-1: each rank updated its shard; hand the new weights around.
            self.shards.share_updated_weights(self.dp.comm())?;
        }
        let mut stats = self.count_step(start, lr, loss, grad_norm, skipped, loss_scale);
        stats.objective = objective_metrics.into_iter().collect();
        Ok(Some(stats))
    }

    /// The step's `grad_accum` micro-batches through the executor, each weighing its share of
    /// the step's `total` units (see [`units_total`]) times the loss `scale`: their gradients
    /// summed into `grads`, their weighted losses returned; `None` when `stop` was set
    /// between two of them. `cast` is the model in the compute dtype (`None`: the master
    /// weights, a pipeline's), whose leaves' gradients go onto the masters.
    fn micro_batches(
        &mut self,
        cast: Option<&CastModel>,
        total: Option<f64>,
        scale: f64,
        stop: &AtomicBool,
        grads: &mut GradStore,
    ) -> Result<Option<StepLoss>> {
        let model = cast.map_or(self.model.as_ref(), CastModel::model);
        let cfg = &self.config;
        let accum = cfg.grad_accum;
        let world = self.dp.world_size();
        let mut step_loss = StepLoss::default();
        for micro in 0..accum {
            if micro > 0 && stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let global = self.data.batch(
                Split::Train,
                world * cfg.batch_size,
                cfg.block_size,
                &mut self.rng,
                &self.device,
            )?;
            let units = units_of(self.objective.as_ref(), &global)?;
            let count: f64 = units.iter().sum();
            let (batch, shard_weight) = self.dp.shard(global, cfg.batch_size, &units)?;
            let share = match total {
                Some(total) if total > 0.0 => count / total,
                Some(_) => 1.0 / accum as f64,
                None => 1.0,
            };
            let ctx = Ctx::train(self.dropout_seed(micro))
                .with_row(self.dp.rank() * cfg.batch_size)
                .with_dtype(self.dtype)
                .with_kernels(cfg.kernels)
                .with_chunked_loss(cfg.chunked_loss)
                .with_rows(batch.rows.clone());
            let ctx = self.with_reference(&batch, ctx)?;
            let weight = shard_weight * share;
            let (loss, mut g) = self.executor.forward_backward_deferred(
                model,
                &batch,
                &ctx,
                weight * scale,
                &self.objective,
            )?;
            if let Some(cast) = cast {
                cast.to_masters(&mut g)?;
            }
            step_loss.add(loss, weight)?;
            accumulate(grads, g, &self.vars)?;
        }
        Ok(Some(step_loss))
    }

    /// `ctx` for `batch` under an objective that
    /// [needs a reference](crate::objective::Objective::needs_reference): dropout off in the
    /// model and its reference (TRL's default), the reference's values of the batch's rows
    /// (computed before training, else by the reference now). `ctx` itself otherwise.
    pub(super) fn with_reference(&self, batch: &Batch, ctx: Ctx) -> Result<Ctx> {
        if !self.objective.needs_reference() {
            return Ok(ctx);
        }
        let ctx = Ctx {
            train: false,
            ..ctx
        };
        let reference = match &batch.reference {
            Some(computed_before) => computed_before.clone(),
            None => self.reference_log_probs(batch, &ctx)?,
        };
        Ok(ctx.with_reference(Some(reference)))
    }

    /// The reference model's summed log-probability of each row's counted targets, for an
    /// objective that [needs them](crate::objective::Objective::needs_reference): under LoRA
    /// the base (the adapters off, the modules to save restored), computed without a graph.
    fn reference_log_probs(&self, batch: &Batch, ctx: &Ctx) -> Result<Tensor> {
        if matches!(self.tuning, Tuning::Full) {
            return Err(Error::Config(format!(
                "objective `{}` compares the model with a reference: train LoRA adapters \
                 (--lora-r) so that the base is the reference, or compute the reference values \
                 once before training (--dpo-precompute-ref)",
                self.objective.name()
            )));
        }
        let base = self.tuning.without_adapters(self.model.as_ref())?;
        crate::objective::reference_log_probs(base.as_ref(), batch, &ctx.clone().without_adapters())
    }

    /// The step's loss and global gradient norm: in a world of one read together
    /// ([`Trainer::read_loss_and_norm`]); else the ranks average the loss and the gradients
    /// first (two reads). A non-finite loss is an error.
    fn reduce_loss_and_norm(
        &self,
        step_loss: StepLoss,
        grads: &mut GradStore,
    ) -> Result<(f32, f32)> {
        let StepLoss { on_device, on_host } = step_loss;
        let (loss, norm) = if self.dp.world_size() == 1 {
            self.read_loss_and_norm(on_device, on_host, grads)?
        } else {
            let mut local = on_host;
            if let Some(sum) = &on_device {
                local += transfer::read_scalar::<f32>(sum)?;
            }
            let loss = self.dp.reduce(grads, local)?;
            (
                loss,
                global_grad_norm(grads, &self.vars, self.config.kernels)?,
            )
        };
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                step: self.step + 1,
                loss,
            });
        }
        Ok((loss, norm))
    }

    /// The loss scaler's overflow-checked update at `lr` over the gradient norm `norm` (read
    /// already): the gradient norm to report and whether the update was skipped (NaN, `true`
    /// for inf/NaN gradients the scaler backs off from; otherwise those are an error).
    fn update(&mut self, grads: &GradStore, lr: f64, norm: f32) -> Result<(f32, bool)> {
        let kernels = self.config.kernels;
        // `amp.step` asks the optimiser for this norm first thing (it was read above).
        let mut update = crate::optim::Driven {
            optimizer: self.optimizer.as_mut(),
            lr,
            norm: Some(norm),
            kernels,
        };
        match self.amp.step(grads, &mut update)? {
            StepOutcome::Applied { grad_norm, .. } => Ok((grad_norm as f32, false)),
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
                        norm: global_grad_norm(grads, &self.vars, kernels)?,
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
                Ok((f32::NAN, true))
            }
        }
    }

    /// Counts the finished step (its tokens and time) and returns its statistics.
    fn count_step(
        &mut self,
        start: Instant,
        lr: f64,
        loss: f32,
        grad_norm: f32,
        skipped: bool,
        loss_scale: Option<f64>,
    ) -> StepStats {
        let cfg = &self.config;
        self.step += 1;
        let tokens =
            (self.dp.world_size() * cfg.grad_accum * cfg.batch_size * cfg.block_size) as u64;
        self.tokens_seen += tokens;
        let secs = start.elapsed().as_secs_f64();
        self.elapsed_secs += secs;
        let mfu = self
            .ceiling
            .utilisation(self.flops_per_token * tokens as f64 / secs.max(1e-12));
        StepStats {
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
            objective: Default::default(),
        }
    }

    /// The step's loss and global gradient norm with one read back from the device (the
    /// step's only host sync): the loss summed on the device and the gradients' sum of
    /// squares, stacked. `on_host` is the part of the loss already read (a pipeline's).
    fn read_loss_and_norm(
        &self,
        on_device: Option<Tensor>,
        on_host: f32,
        grads: &GradStore,
    ) -> Result<(f32, f32)> {
        let sumsq = grad_sum_of_squares(grads, &self.vars, self.config.kernels)?;
        Ok(match (on_device, sumsq) {
            (Some(loss), Some(sumsq)) => {
                let both = Tensor::stack(&[loss, sumsq], 0)?;
                let v = transfer::read_vec1::<f32>(&both)?;
                (on_host + v[0], v[1].sqrt())
            }
            (Some(loss), None) => (on_host + transfer::read_scalar::<f32>(&loss)?, 0.0),
            (None, Some(sumsq)) => (on_host, transfer::read_scalar::<f32>(&sumsq)?.sqrt()),
            (None, None) => (on_host, 0.0),
        })
    }
}

/// The step's loss, sum of weight x mean: on the device for plain and remat micro-batches
/// (read once, with the gradient norm), on the host for a pipeline's.
#[derive(Default)]
struct StepLoss {
    on_device: Option<Tensor>,
    on_host: f32,
}

impl StepLoss {
    /// Adds a micro-batch's mean loss times its `weight`.
    fn add(&mut self, loss: MicroLoss, weight: f64) -> Result<()> {
        match loss {
            // `affine` multiplies in f32 as the host did (`loss * weight as f32`).
            MicroLoss::Device(mean) => {
                let weighted = mean.to_dtype(DType::F32)?.affine(weight, 0.0)?;
                self.on_device = Some(match self.on_device.take() {
                    None => weighted,
                    Some(sum) => (sum + weighted)?,
                });
            }
            MicroLoss::Host(mean) => self.on_host += mean * weight as f32,
        }
        Ok(())
    }
}

/// The loss scaler over the model's f32 parameters (the masters), computing in `dtype`, for
/// every precision: a no-op scaler in f32 (and bf16 by default), dynamic scaling for f16 by
/// default, as `loss_scale` says. Clipping at `grad_clip` (a run's settings of these names;
/// 0: none) is part of its step.
///
/// The model casts each master weight at use (`WeightMode::Cast`), so the optimiser's state
/// stays in f32 and gradients arrive in f32 through `to_dtype`'s backward.
pub(crate) fn build_amp(
    params: &Params,
    dtype: Precision,
    loss_scale: LossScale,
    grad_clip: f32,
) -> Result<Amp> {
    let named = params.iter().map(|(n, v)| (n.clone(), v.clone()));
    let weights = MasterWeights::new(named, dtype.dtype(), WeightMode::Cast)?;
    let clip = (grad_clip > 0.0).then_some(grad_clip as f64);
    let amp = Amp::new(weights, loss_scale.scaler(dtype))?.with_clip_norm(clip)?;
    Ok(amp)
}

/// The objective's units of the `accum` global batches of `rows` rows the next step draws
/// from `rng` (left where it is), summed: drawn on the host one at a time and dropped, so
/// that a step holds one micro-batch whatever `grad_accum` is. `Some(None)` for a single
/// micro-batch (its share is the whole step); `None` when `stop` was set during the draws.
fn units_total(
    objective: &dyn Objective,
    data: &dyn DataSource,
    rng: &ChaCha8Rng,
    accum: usize,
    rows: usize,
    block: usize,
    stop: &AtomicBool,
) -> Result<Option<Option<f64>>> {
    if accum == 1 {
        return Ok(Some(None));
    }
    let mut rng = rng.clone();
    // On the host whatever the run's device: no transfer (`crate::transfer::on_host`).
    transfer::on_host(|| {
        let mut total = 0.0;
        for _ in 0..accum {
            if stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let batch = data.batch(Split::Train, rows, block, &mut rng, &Device::Cpu)?;
            total += units_of(objective, &batch)?.iter().sum::<f64>();
        }
        Ok(Some(Some(total)))
    })
}
