//! The paths a run reads, recorded absolute.

use std::path::{Path, PathBuf};

use super::TrainConfig;
use crate::{Error, Result};

impl TrainConfig {
    /// Makes every path the run reads absolute (canonical where it exists: `data_path`,
    /// `tokenizer_path`, `cache_dir`, `model_json`, `adapter`, and `init_from` when it names a
    /// local directory rather than a hub id), so that the saved config (`run.toml`,
    /// `trainer_state.json`) still finds them when the run is resumed or loaded from another
    /// working directory.
    pub(crate) fn absolute_paths(&mut self) -> Result<()> {
        let absolute = |p: &Path| -> Result<PathBuf> {
            std::fs::canonicalize(p)
                .or_else(|_| std::path::absolute(p))
                .map_err(|e| Error::io(p, e))
        };
        for path in [
            &mut self.data_path,
            &mut self.tokenizer_path,
            &mut self.cache_dir,
            &mut self.model_json,
            &mut self.adapter,
        ]
        .into_iter()
        .flatten()
        {
            *path = absolute(path)?;
        }
        if let Some(from) = &mut self.init_from {
            let local = Path::new(from.as_str());
            if local.exists() {
                *from = absolute(local)?.to_string_lossy().into_owned();
            }
        }
        Ok(())
    }
}
