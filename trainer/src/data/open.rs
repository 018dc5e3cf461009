//! Opening a run's data, and checking that it is the data a checkpoint was trained on.

use std::path::Path;

use super::{DataSource, DataSpec, Fingerprint};
use crate::{Error, Result};

/// Opens a run's data (`TrainConfig::data_spec`) and checks it can serve windows of
/// `block_size + 1` tokens.
pub fn open_for_run(spec: &DataSpec, block_size: usize) -> Result<Box<dyn DataSource>> {
    let source = super::open(spec)?;
    source.check_block_size(block_size)?;
    Ok(source)
}

/// Checks that `data` is the data a checkpoint in `dir` was trained on (`saved`): the same
/// vocabulary always, and the same token stream too when `tokens` is set (resuming). A changed
/// vocabulary would silently shift token ids; a changed corpus would break exact resume.
pub fn check_fingerprint(
    saved: Option<&Fingerprint>,
    data: &dyn DataSource,
    dir: &Path,
    tokens: bool,
) -> Result<()> {
    let Some(saved) = saved else {
        tracing::warn!(
            "{} records no data fingerprint (an older checkpoint): cannot check that the data \
             and vocabulary are unchanged",
            dir.display()
        );
        return Ok(());
    };
    let now = data.fingerprint();
    let what = if saved.vocab != now.vocab {
        "vocabulary"
    } else if tokens && saved.tokens != now.tokens {
        "corpus (token stream)"
    } else {
        return Ok(());
    };
    Err(Error::data(
        data.describe().split(':').next().unwrap_or_default(),
        format!(
            "the {what} differs from the one the checkpoint {} was trained on (fingerprint \
             tokens {} vocab {} then, tokens {} vocab {} now); restore the original data, or \
             start a new run from these weights with --init-from",
            dir.display(),
            saved.tokens,
            saved.vocab,
            now.tokens,
            now.vocab
        ),
    ))
}
