//! One training step's math, chosen once from the config.
//!
//! The [`Executor`] runs the forward and backward of a micro-batch: plainly, through a remat
//! plan (`candle-remat`'s tape over the blocks), or through a pipeline (`candle-pipeline`,
//! which can itself recompute blocks inside its stages). All three walk the model's one chain,
//! [`Gpt::links`]. The update that follows is the same for every precision: `candle-amp`'s
//! overflow-checked step, whose scaler is a no-op in f32 (see [`super::Trainer::train_step`]).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_remat::{Plan, Tape};

use super::compose;
use super::pipeline::PipelineRun;
use crate::config::TrainConfig;
use crate::data::Batch;
use crate::model::{Ctx, Gpt, Link, Params};
use crate::Result;

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
    /// The executor the config asks for.
    pub fn build(
        config: &TrainConfig,
        model: &Gpt,
        params: &Params,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        if let Some(pipe) = PipelineRun::build(config, model, params, device, dtype)? {
            return Ok(Executor::Pipeline(Box::new(pipe)));
        }
        Ok(match compose::remat_plan(config, &model.config, dtype)? {
            Some(plan) => Executor::Remat(plan),
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

    /// Forward and backward of one micro-batch. Returns the loss and the gradients of
    /// `loss * weight` (the weight includes the loss scale).
    ///
    /// `model` is the step's model in the compute dtype (the pipeline keeps its own stages,
    /// built from the master weights, which it casts at use).
    pub fn forward_backward(
        &self,
        model: &Gpt,
        batch: &Batch,
        ctx: &Ctx,
        weight: f64,
    ) -> Result<(f32, GradStore)> {
        let plan = match self {
            Executor::Pipeline(pipe) => return pipe.forward_backward(batch, ctx, weight),
            Executor::Remat(plan) => Some(plan),
            Executor::Plain => None,
        };
        let links = model.links();
        let tape = Tape::new(ctx.seed);
        let logits = run_chain(&links, &batch.x, ctx, plan.map(|p| (&tape, p)))?;
        let loss = ctx
            .kernels
            .cross_entropy(&logits, &batch.y, batch.mask.as_ref())?;
        let value = loss.to_scalar::<f32>()?;
        let objective = (loss * weight)?;
        let grads = match plan {
            Some(_) => tape.backward(&objective)?,
            None => objective.backward()?,
        };
        Ok((value, grads))
    }
}

/// Runs a chain of links; with a remat plan, the blocks (plan index `i` = the `i`-th block of
/// the chain) go through it.
pub fn run_chain<'a>(
    links: &'a [Link],
    x: &Tensor,
    ctx: &'a Ctx,
    remat: Option<(&Tape<'a>, &Plan)>,
) -> Result<Tensor> {
    let first = links.iter().position(Link::is_block).unwrap_or(links.len());
    let end = links
        .iter()
        .rposition(Link::is_block)
        .map_or(first, |i| i + 1);
    let run = |h: Tensor, links: &[Link]| links.iter().try_fold(h, |h, l| l.forward(&h, ctx));
    let h = run(x.clone(), &links[..first])?;
    let blocks = &links[first..end];
    let h = match remat {
        Some((tape, plan)) => plan.forward(tape, &h, move |i, h| blocks[i].forward(h, ctx))?,
        None => run(h, blocks)?,
    };
    Ok(run(h, &links[end..])?)
}
