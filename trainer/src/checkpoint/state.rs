//! The trainer state saved next to the weights: step, RNG position, best loss, config.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::data::Fingerprint;
use crate::io;
use crate::load::{ModelDir, STATE_FILE};
use crate::{Error, Result};

/// The exact position of a ChaCha8 generator (seed, stream, word position), so that sampling
/// continues bit-exactly after a resume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The 32-byte seed, hex-encoded.
    pub seed: String,
    /// The stream number.
    pub stream: u64,
    /// The word position, as a decimal string (it is a u128).
    pub word_pos: String,
}

impl RngState {
    /// Captures the state of `rng`.
    pub fn capture(rng: &ChaCha8Rng) -> Self {
        RngState {
            seed: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// Rebuilds the generator at the captured position.
    pub fn restore(&self) -> Result<ChaCha8Rng> {
        let bad = || Error::Config(format!("invalid RNG state {self:?}"));
        if self.seed.len() != 64 {
            return Err(bad());
        }
        let mut seed = [0u8; 32];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(self.word_pos.parse().map_err(|_| bad())?);
        Ok(rng)
    }
}

/// Everything besides weights and optimiser state needed to continue a run exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimiser steps completed.
    pub step: usize,
    /// Position of the training-batch sampler.
    pub rng: RngState,
    /// Tokens consumed so far.
    pub tokens_seen: u64,
    /// Best validation loss seen at an evaluation.
    pub best_val_loss: Option<f32>,
    /// Checkpoint directory name holding the best validation loss.
    pub best_checkpoint: Option<String>,
    /// Wall-clock seconds spent training so far (across resumes).
    pub elapsed_secs: f64,
    /// The run's config.
    pub config: TrainConfig,
    /// Identity of the data and vocabulary the run trains on (absent in checkpoints written
    /// before fingerprints existed).
    #[serde(default)]
    pub data: Option<Fingerprint>,
    /// Data-parallel ranks of the run (the global batch is `world_size · batch_size` rows).
    #[serde(default = "one")]
    pub world_size: usize,
    /// The frozen base model of a LoRA run (its checkpoints hold the adapters only), by
    /// identity: resuming or loading the adapters over another base is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<crate::lora::RecordedBase>,
    /// The files saved with this state, for `checkpoint::check_files_match`: set by
    /// [`crate::checkpoint::save`] (absent in checkpoints written before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<SavedFiles>,
}

/// What `trainer_state.json` records of the files saved with it, so that a weights or
/// optimiser file of another checkpoint is refused even under a manifest made to match.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedFiles {
    /// The optimiser's own update count (`step` in `optimizer.safetensors`): the trainer's
    /// step less the updates the loss scaler skipped.
    pub optimizer_step: usize,
    /// The digest of the weights file (`model.safetensors`, or a LoRA run's adapters).
    pub weights_digest: String,
}

fn one() -> usize {
    1
}

impl TrainerState {
    /// The whole state of the trainer checkpoint `model` is (its `trainer_state.json`, beside
    /// its weights or its adapters), or `None` for a model that is not one (the loader reads
    /// only its [`crate::load::RunState`]).
    pub fn of(model: &ModelDir) -> Result<Option<Self>> {
        if model.run.is_none() {
            return Ok(None);
        }
        Ok(Some(io::read_json(
            &model.checkpoint_dir().join(STATE_FILE),
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn rng_state_round_trips_mid_stream() {
        let mut rng = ChaCha8Rng::seed_from_u64(99);
        for _ in 0..1234 {
            rng.random::<u32>();
        }
        let saved = RngState::capture(&rng);
        let json = serde_json::to_string(&saved).unwrap();
        let mut restored = serde_json::from_str::<RngState>(&json)
            .unwrap()
            .restore()
            .unwrap();
        let a: Vec<u64> = (0..100).map(|_| rng.random()).collect();
        let b: Vec<u64> = (0..100).map(|_| restored.random()).collect();
        assert_eq!(a, b);
    }
}
