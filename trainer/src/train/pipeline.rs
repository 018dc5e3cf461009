//! Pipeline-parallel steps with `candle-pipeline`: the GPT chain `embed -> blocks -> head` is
//! cut into stages that run on their own threads, and each micro-batch of the trainer is split
//! again into pipeline microbatches.
//!
//! The loss stays the trainer's masked token mean: pipeline microbatch `k` is weighted by its
//! share of the counted target tokens, so the accumulated `GradStore` equals the full-batch one
//! (up to f32 summation order). The targets and the loss mask travel together to the last
//! stage as one f32 tensor `[b, T, 2]` (token id, mask), since the pipeline hands its loss
//! function one target tensor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_pipeline::{split_by_params, Layer, Microbatches, Pipeline, Schedule};

use crate::config::TrainConfig;
use crate::model::{Ctx, Gpt, Params};
use crate::{Error, Result};

/// A pipeline over the trainer's model, with its schedule.
pub struct PipelineRun {
    pipe: Pipeline,
    schedule: Schedule,
    microbatches: usize,
    seed: Arc<AtomicU64>,
}

fn vars_where(params: &Params, pred: impl Fn(&str) -> bool) -> Vec<candle_core::Var> {
    params
        .iter()
        .filter(|(n, _)| pred(n))
        .map(|(_, v)| v.clone())
        .collect()
}

impl PipelineRun {
    /// Builds the pipeline when `pipeline_stages > 1`.
    pub fn build(
        config: &TrainConfig,
        model: &Gpt,
        params: &Params,
        device: &Device,
        dtype: DType,
    ) -> Result<Option<Self>> {
        let stages = config.pipeline_stages;
        if stages <= 1 {
            return Ok(None);
        }
        if config.dropout > 0.0 {
            return Err(Error::Config(
                "pipeline_stages > 1 needs dropout = 0 (stage closures cannot tell microbatches \
                 apart to draw distinct dropout masks)"
                    .into(),
            ));
        }
        if config.remat != candle_remat::Policy::None {
            return Err(Error::Config(
                "remat inside pipeline stages is not supported by the trainer yet: the \
                 pipeline runs its own backward, which a candle-remat tape cannot join"
                    .into(),
            ));
        }
        let schedule = config.schedule.build(stages, config.microbatches)?;
        let v = config.schedule.virtual_stages();
        let seed = Arc::new(AtomicU64::new(0));
        let kernels = config.kernels;
        let ctx_of = move |seed: &Arc<AtomicU64>| Ctx {
            train: true,
            seed: seed.load(Ordering::SeqCst),
            dtype,
            kernels,
        };
        let mut layers = Vec::with_capacity(model.blocks.len() + 2);
        {
            let (embed, s) = (model.embed.clone(), seed.clone());
            layers.push(Layer::new(
                vars_where(params, |n| n.contains(".wte.") || n.contains(".wpe.")),
                move |ids| embed.forward(ids, &ctx_of(&s)),
            ));
        }
        for (i, block) in model.blocks.iter().enumerate() {
            let (block, s) = (block.clone(), seed.clone());
            let prefix = format!("transformer.h.{i}.");
            layers.push(Layer::new(
                vars_where(params, |n| n.starts_with(&prefix)),
                move |x| block.forward(x, &ctx_of(&s)),
            ));
        }
        {
            // The head is tied to wte, so it lists wte too: both uses contribute gradients.
            let (head, s) = (model.head.clone(), seed.clone());
            layers.push(Layer::new(
                vars_where(params, |n| n.contains(".ln_f.") || n.contains(".wte.")),
                move |x| head.forward(x, &ctx_of(&s)),
            ));
        }
        let virtual_stages = stages * v;
        if layers.len() < virtual_stages {
            return Err(Error::Config(format!(
                "{} layers (embed, {} blocks, head) cannot fill {virtual_stages} pipeline stages",
                layers.len(),
                model.blocks.len()
            )));
        }
        let stage_list = split_by_params(layers, virtual_stages)?;
        let mut pipe = Pipeline::new(
            stage_list,
            vec![device.clone(); stages],
            move |logits, t| {
                let y = t.i((.., .., 0))?.to_dtype(DType::U32)?;
                let mask = t.i((.., .., 1))?;
                kernels.cross_entropy(logits, &y, Some(&mask))
            },
        )?;
        if device.is_cpu() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let threads = match config.pipeline_threads {
                0 => (cores / stages).max(1),
                n => n,
            };
            pipe = pipe.with_cpu_threads(threads)?;
        }
        Ok(Some(PipelineRun {
            pipe,
            schedule,
            microbatches: config.microbatches,
            seed,
        }))
    }

    /// One forward and backward of a trainer micro-batch through the pipeline. Returns the
    /// (unscaled) loss and the gradients of `loss * weight`.
    pub fn forward_backward(
        &self,
        x: &Tensor,
        y: &Tensor,
        mask: Option<&Tensor>,
        seed: u64,
        weight: f64,
    ) -> Result<(f32, GradStore)> {
        self.seed.store(seed, Ordering::SeqCst);
        let (b, t) = x.dims2()?;
        let mask = match mask {
            Some(m) => m.to_dtype(DType::F32)?,
            None => Tensor::ones((b, t), DType::F32, x.device())?,
        };
        let targets = Tensor::stack(&[&y.to_dtype(DType::F32)?, &mask], 2)?;
        let counts: Vec<f32> = mask.sum(1)?.to_vec1()?;
        let total: f32 = counts.iter().sum();
        if total <= 0.0 {
            return Err(Error::Config(
                "a batch has no target token to learn from".into(),
            ));
        }
        let m = self.microbatches;
        if b < m {
            return Err(Error::Config(format!(
                "a batch of {b} rows cannot be split into {m} microbatches"
            )));
        }
        let (mut xs, mut ts, mut ws) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for k in 0..m {
            let rows = b / m + usize::from(k < b % m);
            let count: f32 = counts[start..start + rows].iter().sum();
            xs.push(x.narrow(0, start, rows)?);
            ts.push(targets.narrow(0, start, rows)?);
            ws.push(weight * (count / total) as f64);
            start += rows;
        }
        let mbs = Microbatches::with_weights(xs, ts, ws)?;
        let out = self.pipe.step(&self.schedule, &mbs)?;
        Ok(((out.loss / weight) as f32, out.grads))
    }
}
