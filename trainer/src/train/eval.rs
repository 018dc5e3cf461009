//! Evaluation: mean losses over fixed batches, the task score, and text samples.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::Trainer;
use crate::data::{Split, Task};
use crate::model::Model;
use crate::sample::{generate, greedy_batch, SamplingConfig};
use crate::Result;

/// Mean loss of the trainer's model over `eval_iters` batches of `split` drawn from `rng`
/// (see [`crate::pretrained::mean_loss`], which `trainer eval` shares).
pub fn estimate_loss(trainer: &Trainer, split: Split, rng: &mut ChaCha8Rng) -> Result<f32> {
    crate::pretrained::mean_loss(
        trainer.model.as_ref(),
        trainer.data.as_ref(),
        split,
        &trainer.config,
        rng,
        &trainer.device,
    )
}

/// Exact-match score of greedy decoding on `n` held-out problems of `task`, in [0, 1].
pub fn task_score(
    model: &dyn Model,
    task: &dyn Task,
    n: usize,
    device: &candle_core::Device,
) -> Result<f32> {
    let problems = task.eval_problems(n);
    if problems.is_empty() {
        return Ok(0.0);
    }
    let mut correct = 0usize;
    for chunk in problems.chunks(256) {
        let prompts: Vec<Vec<u32>> = chunk.iter().map(|(p, _)| p.clone()).collect();
        let answer_len = chunk[0].1.len();
        let out = greedy_batch(model, &prompts, answer_len, device)?;
        correct += out
            .iter()
            .zip(chunk)
            .filter(|(got, (_, want))| got == &want)
            .count();
    }
    Ok(correct as f32 / problems.len() as f32)
}

/// A text sample of `sample_tokens` tokens, prompted with the start of a validation batch.
pub(super) fn sample_text(trainer: &Trainer) -> Result<Option<String>> {
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
    let tokens = generate(
        trainer.model.as_ref(),
        &prompt,
        cfg.sample_tokens,
        SamplingConfig::default(),
        &mut rng,
        &trainer.device,
    )?;
    Ok(Some(trainer.data.decode(&tokens)?))
}
