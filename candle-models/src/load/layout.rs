//! The names of a model directory's files, and where weights come from: the vocabulary the
//! loading, export and hub modules share with the trainer's checkpoints (nothing here uses
//! them back), and where a trainer run keeps its checkpoints.

use std::path::{Path, PathBuf};

/// The weights file of a model or checkpoint directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// Hugging Face config file name.
pub const CONFIG_FILE: &str = "config.json";
/// Optimiser state file name (of a trainer checkpoint).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Trainer state file name (of a trainer checkpoint).
pub const STATE_FILE: &str = "trainer_state.json";

/// The index of a sharded model (`transformers`' `SAFE_WEIGHTS_INDEX_NAME`).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where weights come from, which decides what loading accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A trainer checkpoint: every tensor is a parameter, in f32, as the trainer writes them.
    Checkpoint,
    /// A pretrained model from elsewhere (a Hugging Face directory): other float dtypes are
    /// cast to f32 (reported), and the architecture's known extras (buffers, a tied copy of
    /// the embedding) are accepted (reported).
    Pretrained,
}

/// The directory holding a run's checkpoints.
pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}
