//! Pipeline-parallel steps with `candle-pipeline`: the model's chain ([`Model::links`]) is cut
//! into stages that run on their own threads (and devices), and each micro-batch of the trainer
//! is split again into pipeline microbatches.
//!
//! Everything the plain step does composes here:
//! - **the loss** is the step's objective's ([`Objective::loss`] of the head's outputs, run by
//!   the pipeline's loss function on the last stage, whose last layer lists the head's
//!   parameters): targets travel with the loss mask folded in as an ignore index, and
//!   microbatch `k` is weighted by its share of the micro-batch's units
//!   ([`Objective::row_units`]: counted target tokens for cross-entropy), so the accumulated
//!   gradients equal the full batch's (up to f32 summation order);
//! - **the rows' context** (positions, document ids) of the trainer's micro-batch is handed
//!   to every stage for its microbatch's rows, and the reference values of an objective that
//!   compares with a reference ([`Ctx::reference`]) to the loss of each microbatch;
//! - **dropout**: each stage is told its microbatch ([`Call`]); the masks are keyed by the
//!   step's seed (the batch key) and the microbatch's first row, so every row draws the mask it
//!   draws in the plain step, in its forward and in a recompute;
//! - **remat**: the run's policy plans over each stage's blocks, and the checkpointed ones are
//!   recomputed inside the stage ([`Sequential::with_recompute`]);
//! - **devices**: stage `s` runs on `pipeline_devices[s]`; weights stay on the run's device
//!   and are copied to the stage's at use (differentiably, so gradients come home).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, TensorId};
use candle_pipeline::{
    balance_by_cost, Call, Layer, Microbatches, Pipeline, Schedule, Sequential, Stage,
};
use candle_remat::Policy;

use crate::config::{DeviceSpec, Parallelism};
use crate::data::Batch;
use crate::model::{Ctx, Kernels, Link, Model, Params, Role, Rows};
use crate::objective::{CrossEntropy, HeadOutput, Objective};
use crate::{Error, Result};

/// A pipeline over the trainer's model, with its schedule.
pub struct PipelineRun {
    pipe: Pipeline,
    schedule: Schedule,
    microbatches: usize,
    rows: Arc<Mutex<RowsOfStep>>,
    /// The objective of the micro-batch in flight (the loss function runs it).
    objective: Arc<Mutex<Arc<dyn Objective>>>,
    /// The device of the last stage, where the loss function runs.
    last_device: Device,
}

/// The rows' context of the micro-batch in flight, and the row key of its first row: each
/// stage takes its microbatch's rows of it; whether it trains (dropout); and the reference
/// values of each pipeline microbatch's rows, by the id of its targets on the last stage's
/// device (what the loss function is handed).
#[derive(Default)]
struct RowsOfStep {
    first: usize,
    rows: Rows,
    train: bool,
    reference: HashMap<TensorId, Tensor>,
    /// Each microbatch's targets on the host (the batch's host copy), by the same ids.
    host_targets: HashMap<TensorId, Arc<[u32]>>,
}

/// A link as a pipeline layer on `device`: its parameters, and a forward that builds the
/// step's context from the [`Call`] (seed = the batch key, row = the microbatch's first row,
/// the rows' context = the microbatch's rows of the micro-batch's). The head is the last
/// layer of the last stage and passes its input through: the pipeline's loss function runs
/// it ([`Link::loss`]).
fn layer(
    link: Link,
    params: &Params,
    base: &Ctx,
    device: &Device,
    home: &Device,
    step_rows: &Arc<Mutex<RowsOfStep>>,
) -> Layer {
    let vars = params.vars_of(&link.weights());
    if link.role() == Role::Head {
        return Layer::new(vars, |x| Ok(x.clone()));
    }
    let (device, remote) = (device.clone(), !device.same_device(home));
    let (base, step_rows) = (base.clone(), step_rows.clone());
    Layer::with_call(vars, move |x, call: &Call| {
        let rows = {
            let s = step_rows.lock().unwrap_or_else(|e| e.into_inner());
            if s.rows.is_empty() && s.rows.tokens.is_none() {
                Rows::default()
            } else {
                s.rows.narrow(call.row - s.first, x.dim(0)?)?
            }
        };
        let train = step_rows.lock().unwrap_or_else(|e| e.into_inner()).train;
        let ctx = Ctx {
            seed: call.key,
            row: call.row,
            rows,
            train,
            ..base.clone()
        };
        if remote {
            // Copied at use, differentiably: the gradients flow back to the masters at home.
            let here = link.map(&|w| w.to_device(&device))?;
            here.forward(&x.to_device(&device)?, &ctx)
        } else {
            link.forward(x, &ctx)
        }
    })
}

/// Ranges of a stage's layers to recompute: the run's policy planned over the stage's blocks,
/// for one microbatch (a budget bounds one microbatch's activations in the stage; a schedule
/// keeps up to its in-flight count of microbatches at once, e.g. up to `stages` under 1F1B).
fn stage_recompute(
    links: &[Link],
    policy: Policy,
    costs_of: &dyn Fn(usize) -> candle_remat::ChainCosts,
) -> Result<Vec<std::ops::Range<usize>>> {
    let Some(first) = links.iter().position(Link::is_block) else {
        return Ok(Vec::new());
    };
    if policy == Policy::None {
        return Ok(Vec::new());
    }
    let blocks = links.iter().filter(|l| l.is_block()).count();
    let plan = policy
        .plan(&costs_of(blocks))
        .map_err(|e| Error::RematPlan {
            policy: policy.to_string(),
            where_: " in a pipeline stage",
            source: Box::new(e),
        })?;
    Ok(plan
        .segments
        .iter()
        .filter(|s| s.checkpointed)
        .map(|s| first + s.start..first + s.end)
        .collect())
}

/// What the executor ([`super::Executor`]) and its pipeline read of the run config
/// (`From<&TrainConfig>`): how a step computes and how it is spread. Defined here, below
/// the executor, which builds its pipeline from it.
#[derive(Clone, Debug)]
pub struct ExecutorSettings {
    /// The compute dtype (`dtype`).
    pub(crate) dtype: DType,
    /// The activation-checkpointing policy (`remat`).
    pub(crate) remat: Policy,
    /// Rows of a micro-batch.
    pub(crate) batch_size: usize,
    /// Tokens of a row.
    pub(crate) block_size: usize,
    /// Fused or reference kernels.
    pub(crate) kernels: Kernels,
    /// Whether the loss runs over chunks of the vocabulary.
    pub(crate) chunked_loss: bool,
    /// Pipeline stages, microbatches, schedule and devices, if any.
    pub(crate) parallelism: Parallelism,
    /// The run's device (a stage on it reuses it).
    pub(crate) device: DeviceSpec,
}

/// The devices of the pipeline's `stages` workers: `specs`, else the run's `device` for all
/// of them. The run's own device is reused, not opened again (a second `Device::new_cuda(0)`
/// is a different device to Candle, and its stage would copy weights at every use).
fn stage_devices(
    specs: &[DeviceSpec],
    config: &ExecutorSettings,
    device: &Device,
    stages: usize,
) -> Result<Vec<Device>> {
    if specs.is_empty() {
        return Ok(vec![device.clone(); stages]);
    }
    specs
        .iter()
        .map(|d| {
            if *d == config.device {
                Ok(device.clone())
            } else {
                d.open()
            }
        })
        .collect()
}

/// The links of each of `virtual_stages` stages, balanced by the parameters each link reads;
/// an error when there are fewer links than stages.
fn stage_ranges(links: &[Link], virtual_stages: usize) -> Result<Vec<std::ops::Range<usize>>> {
    if links.len() < virtual_stages {
        return Err(Error::Config(format!(
            "{} links (embed, {} blocks, head) cannot fill {virtual_stages} pipeline stages",
            links.len(),
            links.iter().filter(|l| l.is_block()).count()
        )));
    }
    let sizes: Vec<f64> = links
        .iter()
        .map(|l| l.weights().iter().map(|w| w.elem_count() as f64).sum())
        .collect();
    Ok(balance_by_cost(&sizes, virtual_stages)?)
}

impl PipelineRun {
    /// Builds the pipeline when `pipeline_stages > 1`.
    pub fn build(
        config: &ExecutorSettings,
        model: &dyn Model,
        params: &Params,
        device: &Device,
        dtype: DType,
    ) -> Result<Option<Self>> {
        let Parallelism::Pipeline {
            stages,
            microbatches,
            schedule: kind,
            devices,
            threads,
        } = config.parallelism.clone()
        else {
            return Ok(None);
        };
        let schedule = kind.build(stages, microbatches)?;
        let virtual_stages = stages * kind.virtual_stages();
        let devices = stage_devices(&devices.0, config, device, stages)?;
        let links = model.links();
        // Balance by the parameters each link reads, then build each stage on its device.
        let ranges = stage_ranges(&links, virtual_stages)?;
        let base = Ctx::train(0)
            .with_dtype(dtype)
            .with_kernels(config.kernels)
            .with_chunked_loss(config.chunked_loss);
        let rows = config.batch_size.div_ceil(microbatches);
        // The planner sees a stage's blocks: the first `n` of the model's (blocks cost the
        // same in every architecture the trainer has; a stage plans over its own count).
        let all = model
            .config()
            .chain_costs(rows, config.block_size, dtype, config.kernels);
        let costs_of = |n: usize| candle_remat::ChainCosts {
            blocks: all.blocks[..n.min(all.blocks.len())].to_vec(),
            ..all.clone()
        };
        let step_rows = Arc::new(Mutex::new(RowsOfStep::default()));
        let mut stage_list: Vec<Box<dyn Stage>> = Vec::with_capacity(virtual_stages);
        for (s, range) in ranges.iter().enumerate() {
            let dev = &devices[schedule.worker_of(s)];
            let stage_links = &links[range.clone()];
            let layers = stage_links
                .iter()
                .map(|l| layer(l.clone(), params, &base, dev, device, &step_rows))
                .collect();
            let recompute = stage_recompute(stage_links, config.remat, &costs_of)?;
            stage_list.push(Box::new(Sequential::new(layers).with_recompute(recompute)?));
        }
        let head = links[links.len() - 1].clone();
        let home = device.clone();
        let last_device = devices[schedule.worker_of(virtual_stages - 1)].clone();
        let loss_rows = step_rows.clone();
        let objective: Arc<Mutex<Arc<dyn Objective>>> =
            Arc::new(Mutex::new(Arc::new(CrossEntropy)));
        let step_objective = objective.clone();
        let mut pipe = Pipeline::new(stage_list, devices, move |h, targets| {
            let objective = step_objective
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let ctx = {
                let s = loss_rows.lock().unwrap_or_else(|e| e.into_inner());
                let reference = s.reference.get(&targets.id()).cloned();
                let ctx = Ctx {
                    train: s.train,
                    ..base.clone()
                }
                .with_reference(reference);
                match s.host_targets.get(&targets.id()) {
                    Some(values) => ctx.with_host_targets(targets, values.clone()),
                    None => ctx,
                }
            };
            if h.device().same_device(&home) {
                objective.loss(&HeadOutput::new(&head, h, targets, &ctx))
            } else {
                // Copied at use, differentiably (see `layer`).
                let here = head.map(&|w| w.to_device(h.device()))?;
                objective.loss(&HeadOutput::new(&here, h, targets, &ctx))
            }
        })?;
        if device.is_cpu() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let threads = match threads {
                0 => (cores / stages).max(1),
                n => n,
            };
            pipe = pipe.with_cpu_threads(threads)?;
        }
        Ok(Some(PipelineRun {
            pipe,
            schedule,
            microbatches,
            rows: step_rows,
            objective,
            last_device,
        }))
    }

    /// One forward and backward of a trainer micro-batch through the pipeline under
    /// `objective`, with dropout seeded by `ctx.seed` and keyed by rows from `ctx.row` on (a
    /// data-parallel shard's place in the global batch). Returns the loss (the objective's
    /// mean over the batch's units), the units (rounded down: counted targets for
    /// cross-entropy) and the gradients of `loss * weight`.
    pub fn forward_backward(
        &self,
        batch: &Batch,
        ctx: &Ctx,
        weight: f64,
        objective: &Arc<dyn Objective>,
    ) -> Result<(f32, usize, GradStore)> {
        let b = batch.x.dim(0)?;
        let y = batch.targets()?;
        // The rows' units in f32, as the counts were summed on the device (whole numbers for
        // cross-entropy: the same sums and shares).
        let counts: Vec<f32> = crate::objective::units_of(objective.as_ref(), batch)?
            .into_iter()
            .map(|u| u as f32)
            .collect();
        *self.objective.lock().unwrap_or_else(|e| e.into_inner()) = objective.clone();
        // With no unit at all the loss is 0 with zero gradients, as in the plain step (a
        // data-parallel shard may hold no counted target).
        let total: f32 = counts.iter().sum();
        let m = self.microbatches;
        let sizes = candle_pipeline::even_sizes(b, m)?;
        let (mut xs, mut ys, mut ws) = (Vec::new(), Vec::new(), Vec::new());
        let mut reference = HashMap::new();
        let (host, t) = (batch.host_targets(), batch.x.dim(1)?);
        let mut host_targets = HashMap::new();
        let mut start = 0;
        for rows in sizes {
            crate::objective::check_groups(objective.as_ref(), rows, "a pipeline microbatch")?;
            let count: f32 = counts[start..start + rows].iter().sum();
            xs.push(batch.x.narrow(0, start, rows)?);
            // on the last stage's device already, so that the loss function gets this tensor
            let targets = y.narrow(0, start, rows)?.to_device(&self.last_device)?;
            if let Some(r) = &ctx.reference {
                let r = r.narrow(0, start, rows)?.to_device(&self.last_device)?;
                reference.insert(targets.id(), r);
            }
            if let Some(h) = &host {
                host_targets.insert(targets.id(), h[start * t..(start + rows) * t].into());
            }
            ys.push(targets);
            let share = if total > 0.0 { count / total } else { 0.0 };
            ws.push(weight * f64::from(share));
            start += rows;
        }
        *self.rows.lock().unwrap_or_else(|e| e.into_inner()) = RowsOfStep {
            first: ctx.row,
            rows: batch.rows.clone(),
            train: ctx.train,
            reference,
            host_targets,
        };
        let mbs = Microbatches::with_weights(xs, ys, ws)?
            .with_key(ctx.seed)
            .with_first_row(ctx.row);
        let out = self.pipe.step(&self.schedule, &mbs)?;
        Ok(((out.loss / weight) as f32, total as usize, out.grads))
    }
}
