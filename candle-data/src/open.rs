//! Opening a run's data, and checking that it is the data a checkpoint was trained on.

use std::path::Path;

use super::shards::format::{Manifest, MANIFEST_FILE};
use super::{sft, Addition, ChatTask, DataKind, SftSource, TextSource};
use super::{DataSource, DataSpec, Fingerprint, ShardOptions, ShardSource};
use crate::{Error, Result};

/// Builds the data source described by `spec`.
///
/// Text sources read (or load from the cache) and tokenise the whole file here; errors name the
/// file and the problem (missing, empty, invalid UTF-8 for `char`/`tokenizer`, bad
/// `tokenizer.json`...). The block size is not known yet: call
/// [`DataSource::check_block_size`] once it is.
pub fn open(spec: &DataSpec) -> Result<Box<dyn DataSource>> {
    spec.validate()?;
    match spec.kind {
        DataKind::Addition => Ok(Box::new(Addition::new(
            spec.digits,
            spec.val_fraction,
            spec.seed,
        )?)),
        DataKind::Char | DataKind::Byte | DataKind::Tokenizer => {
            Ok(Box::new(TextSource::open(spec)?))
        }
        DataKind::Sft => Ok(Box::new(SftSource::open(spec)?)),
        DataKind::Preference => Ok(Box::new(sft::PreferenceSource::open(spec)?)),
        DataKind::ChatTask => Ok(Box::new(ChatTask::open(spec)?)),
        DataKind::Shards => {
            let dir = spec.path.as_deref().unwrap_or(std::path::Path::new(""));
            if dir.join(MANIFEST_FILE).is_file() && Manifest::read(dir)?.pairs {
                return Ok(Box::new(sft::PreferenceSource::open_shards(spec)?));
            }
            let options = ShardOptions {
                order: spec.order,
                doc_mask: spec.doc_mask,
                tokenizer: spec.tokenizer.clone(),
            };
            Ok(Box::new(ShardSource::open(dir, options)?))
        }
    }
}

/// Opens a run's data (`TrainConfig::data_spec`) and checks it can serve windows of
/// `block_size + 1` tokens.
pub fn open_for_run(spec: &DataSpec, block_size: usize) -> Result<Box<dyn DataSource>> {
    let source = open(spec)?;
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
