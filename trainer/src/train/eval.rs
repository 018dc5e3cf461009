//! Evaluation: mean losses over fixed batches, the task score, and text samples.

use std::sync::atomic::AtomicBool;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::Trainer;
use crate::data::Split;
use crate::sample::{generate_while, SamplingConfig};
use crate::Result;

/// Mean loss of the trainer's model over `eval_iters` batches of `split` drawn from `rng`
/// (see [`crate::pretrained::mean_loss`], which `trainer eval` shares).
pub fn estimate_loss(trainer: &Trainer, split: Split, rng: &mut ChaCha8Rng) -> Result<f32> {
    let never = AtomicBool::new(false);
    Ok(estimate_loss_until(trainer, split, rng, &never)?.unwrap_or(f32::NAN))
}

/// [`estimate_loss`], given up between batches once `stop` is set: `None`.
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
