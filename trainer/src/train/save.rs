//! Checkpoints of a run: the trainer state, writing (rank 0, with ZeRO-1's state gathered)
//! and pruning.

use std::path::{Path, PathBuf};

use super::{Trainer, AMP_FILE};
use crate::checkpoint::{self, RngState, TrainerState};
use crate::metrics::EvalStats;
use crate::optim::OptimizerState;
use crate::Result;

impl Trainer {
    /// The state saved with a checkpoint.
    pub fn state(&self) -> TrainerState {
        TrainerState {
            step: self.step,
            rng: RngState::capture(&self.rng),
            tokens_seen: self.tokens_seen,
            best_val_loss: self.best_val_loss,
            best_checkpoint: self.best_checkpoint.clone(),
            elapsed_secs: self.elapsed_secs,
            config: self.config.clone(),
            data: Some(self.data.fingerprint()),
            world_size: self.dp.world_size(),
            base: self.tuning.recorded_base(),
            files: None, // recorded by `checkpoint::save`
        }
    }

    /// Writes a checkpoint of the current step into the run directory and prunes old ones.
    ///
    /// With data parallelism only rank 0 writes; the other ranks return the directory rank 0
    /// writes. A run without a run directory ([`Trainer::builder`] without `run_dir`) has
    /// nowhere to write: an error.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        self.check_writes()?;
        // With ZeRO-1, the whole optimiser state is gathered (every rank takes part).
        let gathered = if self.shards.is_sharded() {
            let comm = self.dp.comm();
            Some(
                self.shards
                    .gather_optimizer(comm, self.optimizer.as_ref())?,
            )
        } else {
            None
        };
        if !self.dp.is_main() {
            let dir = checkpoint::checkpoints_dir(&self.config.out_dir)
                .join(format!("step-{:07}", self.step));
            self.last_checkpoint = Some(dir.clone());
            return Ok(dir);
        }
        let held = self.run_dir.is_some();
        self.claim_run_dir()?;
        let saved = self.save_claimed(gathered);
        if !held {
            self.run_dir = None;
        }
        saved
    }

    fn save_claimed(&mut self, gathered: Option<OptimizerState>) -> Result<PathBuf> {
        let amp = &self.amp;
        let optimizer = gathered.unwrap_or_else(|| OptimizerState::of(self.optimizer.as_ref()));
        let dir = checkpoint::save(
            &self.config.out_dir,
            checkpoint::ModelFiles::of(&self.tuning, self.model.config()),
            &self.params,
            &optimizer,
            &self.state(),
            &[(AMP_FILE, &|path: &Path| -> Result<()> {
                amp.save_state(path)?;
                Ok(())
            })],
        )?;
        let saved = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let keep: Vec<&str> = [Some(saved.as_str()), self.best_checkpoint.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        checkpoint::prune(&self.config.out_dir, self.config.keep_last, &keep)?;
        self.last_checkpoint = Some(dir.clone());
        Ok(dir)
    }

    /// Tracks the best validation loss; called for evaluations that are checkpointed.
    pub(super) fn record_eval(&mut self, eval: &EvalStats) {
        if self.best_val_loss.is_none_or(|b| eval.val_loss < b) {
            self.best_val_loss = Some(eval.val_loss);
            self.best_checkpoint = Some(format!("step-{:07}", self.step));
        }
    }
}
