//! Evaluation: mean losses over fixed batches, the objective's held-out values, the task
//! score, and text samples.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::DType;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::Trainer;
use crate::data::Split;
use crate::model::{run_links, Ctx};
use crate::objective::HeadOutput;
use crate::sample::{generate_while, SamplingConfig};
use crate::{Error, Result};

/// Mean loss of the trainer's model over `eval_iters` batches of `split` drawn from `rng`
/// (see `crate::pretrained::mean_loss`, which `trainer eval` shares), given up between
/// batches once `stop` is set: `None`.
pub(super) fn estimate_loss_until(
    trainer: &Trainer,
    split: Split,
    rng: &mut ChaCha8Rng,
    stop: &AtomicBool,
) -> Result<Option<f32>> {
    crate::pretrained::mean_loss_until(
        trainer.model.as_ref(),
        trainer.data.as_ref(),
        split,
        &(&trainer.config).into(),
        rng,
        &trainer.device,
        stop,
    )
}

/// The run's objective on `eval_iters` validation batches (drawn by a generator of their own,
/// the same at every evaluation), when it is not the cross-entropy the eval losses already
/// are: its mean loss as `<objective>_loss` and its own metrics over the batches' rows (DPO:
/// the loss and TRL's six metrics of held-out pairs, against the same reference as in
/// training), in the run's compute dtype without dropout. Empty for cross-entropy; `None`
/// once `stop` is set (checked between batches).
pub(super) fn objective_until(
    trainer: &Trainer,
    stop: &AtomicBool,
) -> Result<Option<BTreeMap<String, f64>>> {
    let (cfg, objective) = (&trainer.config, trainer.objective.as_ref());
    let mut out = BTreeMap::new();
    if objective.name() == "cross-entropy" || cfg.eval_iters == 0 {
        return Ok(Some(out));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x0B1E_C7E7);
    let links = trainer.model.links();
    let Some((head, body)) = links.split_last() else {
        return Err(Error::Config("a model needs at least one link".into()));
    };
    objective.take_metrics()?; // nothing pending between steps; dropped if so
    let mut total = 0f64;
    for _ in 0..cfg.eval_iters {
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let batch = trainer.data.batch(
            Split::Val,
            cfg.batch_size,
            cfg.block_size,
            &mut rng,
            &trainer.device,
        )?;
        let ctx = Ctx::eval()
            .with_dtype(trainer.dtype)
            .with_kernels(cfg.kernels)
            .with_chunked_loss(cfg.chunked_loss)
            .with_rows(batch.rows.clone());
        let ctx = trainer.with_reference(&batch, ctx)?;
        let hidden = run_links(body, &batch.x, &ctx)?.detach();
        let targets = batch.targets()?;
        let loss = objective.loss(&HeadOutput::new(head, &hidden, &targets, &ctx))?;
        total += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    }
    out.insert(
        format!("{}_loss", objective.name()),
        total / cfg.eval_iters as f64,
    );
    out.extend(objective.take_metrics()?);
    Ok(Some(out))
}

/// A text sample of `sample_tokens` tokens, prompted with the start of a validation batch;
/// `None` once `stop` is set (checked between tokens).
pub(super) fn sample_text(trainer: &Trainer, stop: &AtomicBool) -> Result<Option<String>> {
    let cfg = &trainer.config;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x5A3B);
    let batch = trainer.data.batch(
        Split::Val,
        1,
        cfg.block_size.min(8),
        &mut rng,
        &trainer.device,
    )?;
    let prompt: Vec<u32> = batch.x.flatten_all()?.to_vec1()?;
    let Some(tokens) = generate_while(
        trainer.model.as_ref(),
        &prompt,
        cfg.sample_tokens,
        SamplingConfig::default(),
        &mut rng,
        &trainer.device,
        stop,
    )?
    else {
        return Ok(None);
    };
    Ok(Some(trainer.data.decode(&tokens)?))
}
