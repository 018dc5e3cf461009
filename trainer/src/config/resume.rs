//! What a resumed run may change of its saved config.

use std::path::Path;

use super::{OnResume, TrainConfig};
use crate::{Error, Result};

/// A resumed run may change how long it trains, how it executes and how it reports, not what it
/// trains: every field the config classifies as [`OnResume::fixed`] (see
/// [`TrainConfig::FIELDS`]) must keep its saved value. A change is refused naming each such
/// field with its saved and its new value, and the checkpoint `dir`; the caller checks this
/// before it loads or writes anything.
pub(crate) fn check_resume_compatible(
    saved: &TrainConfig,
    new: &TrainConfig,
    dir: &Path,
) -> Result<()> {
    let refused: Vec<String> = saved
        .changed_fields(new)
        .into_iter()
        .filter(|c| c.class == OnResume::fixed)
        .map(|c| format!("{} ({} -> {})", c.name, c.old, c.new))
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "cannot change {} when resuming from {}: these are fixed by the run (they define the \
         model, its initialisation, the data or the batch stream); nothing was changed. Resume \
         without them, or start a new run (--init-from the run to start from its weights)",
        refused.join(", "),
        dir.display()
    )))
}
