//! How a micro-batch's forward and backward run, chosen once from the config.
//!
//! The [`Executor`] runs plainly, through a remat plan (`candle-remat`'s tape over the blocks),
//! or through a pipeline (`candle-pipeline`, which can itself recompute blocks inside its
//! stages). All three walk the model's one chain ([`Model::links`]): every link's forward,
//! then the objective's loss of the last link's outputs ([`Objective::loss`]). None knows the
//! architecture, nor the loss.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_remat::{Plan, Policy, Tape};

use super::pipeline::{ExecutorSettings, PipelineRun};
use crate::data::Batch;
use crate::model::{Ctx, Link, Loss, Model, ModelConfig, Params};
use crate::objective::{HeadOutput, Objective};
use crate::{Error, Result};

/// How a micro-batch's forward and backward run.
pub enum Executor {
    /// Candle's backward over the whole graph.
    Plain,
    /// The blocks go through an activation-checkpointing plan; backward recomputes them.
    Remat(Plan),
    /// Stages on threads or devices, microbatched by a schedule.
    Pipeline(Box<PipelineRun>),
}

impl Executor {
    /// The executor the settings ask for (computing in `config.dtype`).
    pub fn build(
        config: &ExecutorSettings,
        model: &dyn Model,
        params: &Params,
        dev: &Device,
    ) -> Result<Self> {
        let dtype = config.dtype;
        if let Some(pipe) = PipelineRun::build(config, model, params, dev, dtype)? {
            return Ok(Executor::Pipeline(Box::new(pipe)));
        }
        Ok(match remat_plan(config, model.config(), dtype)? {
            Some(plan) => {
                tracing::info!("activation checkpointing plan:\n{plan}");
                Executor::Remat(plan)
            }
            None => Executor::Plain,
        })
    }

    /// The activation-checkpointing plan of the whole chain, if any.
    pub fn plan(&self) -> Option<&Plan> {
        match self {
            Executor::Remat(plan) => Some(plan),
            _ => None,
        }
    }

    /// Forward and backward of one micro-batch under `objective`. Returns the loss (the
    /// objective's mean over the batch's units), the count of its counted targets and the
    /// gradients of `loss * weight` (the weight includes the loss scale). Reads the loss and
    /// the count back from the device; the training step uses
    /// `Executor::forward_backward_deferred`, which reads neither.
    ///
    /// `model` is the step's model in the compute dtype (the pipeline keeps its own stages,
    /// built from the master weights, which it casts at use). `ctx.rows` must be the batch's.
    pub fn forward_backward(
        &self,
        model: &dyn Model,
        batch: &Batch,
        ctx: &Ctx,
        weight: f64,
        objective: &Arc<dyn Objective>,
    ) -> Result<(f32, usize, GradStore)> {
        if let Executor::Pipeline(pipe) = self {
            return pipe.forward_backward(batch, ctx, weight, objective);
        }
        let (loss, grads) = self.chain_backward(model, batch, ctx, weight, objective.as_ref())?;
        let mean = crate::transfer::read_scalar(&loss.mean)?;
        Ok((mean, loss.count()?, grads))
    }

    /// [`Executor::forward_backward`] without reading anything back from the device (plain
    /// and remat: the loss stays a device scalar, detached from the graph, for the step to
    /// read once with the gradient norm). A pipeline reads its microbatches' losses itself.
    pub(crate) fn forward_backward_deferred(
        &self,
        model: &dyn Model,
        batch: &Batch,
        ctx: &Ctx,
        weight: f64,
        objective: &Arc<dyn Objective>,
    ) -> Result<(MicroLoss, GradStore)> {
        if let Executor::Pipeline(pipe) = self {
            let (mean, _, grads) = pipe.forward_backward(batch, ctx, weight, objective)?;
            return Ok((MicroLoss::Host(mean), grads));
        }
        let (loss, grads) = self.chain_backward(model, batch, ctx, weight, objective.as_ref())?;
        // Detached: the step keeps the value, not the micro-batch's activations.
        Ok((MicroLoss::Device(loss.mean.detach()), grads))
    }

    /// The loss of the chain and the gradients of `loss.mean * weight` (plain or remat).
    fn chain_backward(
        &self,
        model: &dyn Model,
        batch: &Batch,
        ctx: &Ctx,
        weight: f64,
        objective: &dyn Objective,
    ) -> Result<(Loss, GradStore)> {
        let plan = self.plan();
        let links = model.links();
        let targets = batch.targets()?;
        // the batch's host copy of the targets: the loss reads nothing back for them
        let ctx = match batch.host_targets() {
            Some(values) => ctx.clone().with_host_targets(&targets, values),
            None => ctx.clone(),
        };
        let tape = Tape::new(ctx.seed);
        let loss = run_chain(
            &links,
            &batch.x,
            &targets,
            &ctx,
            plan.map(|p| (&tape, p)),
            objective,
        )?;
        let objective = (&loss.mean * weight)?;
        let grads = match plan {
            Some(_) => tape.backward(&objective)?,
            None => objective.backward()?,
        };
        Ok((loss, grads))
    }
}

/// A micro-batch's mean loss, as [`Executor::forward_backward_deferred`] returns it.
#[derive(Clone, Debug)]
pub(crate) enum MicroLoss {
    /// A scalar on the device, not read yet (plain and remat).
    Device(Tensor),
    /// Already read back (a pipeline).
    Host(f32),
}

/// Runs a chain of links to `objective`'s loss of `targets` (in [`Loss::mean`]); with a remat
/// plan, the blocks (plan index `i` = the `i`-th block of the chain) go through it.
pub fn run_chain<'a>(
    links: &'a [Link],
    x: &Tensor,
    targets: &Tensor,
    ctx: &'a Ctx,
    remat: Option<(&Tape<'a>, &Plan)>,
    objective: &dyn Objective,
) -> Result<Loss> {
    let Some((head, body)) = links.split_last() else {
        return Err(Error::Config("a model needs at least one link".into()));
    };
    let first = body.iter().position(Link::is_block).unwrap_or(body.len());
    let end = body
        .iter()
        .rposition(Link::is_block)
        .map_or(first, |i| i + 1);
    let run = |h: Tensor, links: &[Link]| links.iter().try_fold(h, |h, l| l.forward(&h, ctx));
    let h = run(x.clone(), &body[..first])?;
    let blocks = &body[first..end];
    let h = match remat {
        Some((tape, plan)) => plan.forward(tape, &h, move |i, h| blocks[i].forward(h, ctx))?,
        None => run(h, blocks)?,
    };
    let h = run(h, &body[end..])?;
    let mean = objective.loss(&HeadOutput::new(head, &h, targets, ctx))?;
    Ok(Loss {
        mean,
        targets: targets.clone(),
    })
}

/// The checkpoint plan for this run, or `None` for plain backward.
///
/// Costs are counted at the run's context (`config.block_size`), which may be shorter than
/// the model's positions when fine-tuning a pretrained model.
pub fn remat_plan(
    config: &ExecutorSettings,
    model: &dyn ModelConfig,
    dtype: DType,
) -> Result<Option<Plan>> {
    let policy = config.remat;
    if policy == Policy::None {
        return Ok(None);
    }
    let costs = model.chain_costs(config.batch_size, config.block_size, dtype, config.kernels);
    let plan = policy.plan(&costs).map_err(|e| Error::RematPlan {
        policy: policy.to_string(),
        where_: "",
        source: Box::new(e),
    })?;
    Ok(Some(plan))
}
