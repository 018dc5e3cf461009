//! Models that come from outside the current run: a Hugging Face model directory, a model id
//! in the local hub cache, or a trainer checkpoint or run directory.
//!
//! They are resolved and loaded by [`crate::load`] ([`resolve`], [`ModelDir`], re-exported
//! here), which every command shares.
//!
//! A bare model has no run config to say how text becomes tokens: its directory's
//! `tokenizer.json` ([`TokenizerFile`]) does. [`EvalRequest`] evaluates any of them on data
//! given by flags or by the run's config.

mod eval;

pub use candle_data::tokenizer::{
    word_level, SpecialTokens, TokenizerFile, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
pub use eval::EvalRequest;
pub(crate) use eval::EvalSettings;
pub(crate) use eval::{mean_loss_until, task_score_until};

pub use crate::load::{resolve, resolve_in, ModelDir};

use std::path::Path;

use crate::data::DataKind;
use crate::Result;

/// The special tokens of the vocabulary a run trains on (its `data` and `tokenizer_path`):
/// those of its `tokenizer.json` for `tokenizer` data (each falling back to `fallback`, the
/// pretrained model's), none for the character, byte and addition vocabularies.
pub(crate) fn data_special_tokens(
    data: DataKind,
    tokenizer: Option<&Path>,
    fallback: SpecialTokens,
) -> Result<SpecialTokens> {
    match (tokenizer, data) {
        (Some(path), kind) if kind.uses_tokenizer() => {
            let own = TokenizerFile::open(path)?.special_tokens();
            Ok(SpecialTokens {
                bos: own.bos.or(fallback.bos),
                eos: own.eos.or(fallback.eos),
            })
        }
        _ => Ok(SpecialTokens::default()),
    }
}
