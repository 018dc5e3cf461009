//! Building a run's model (fresh or pretrained) and checking a resumed run against its
//! checkpoint.

use std::path::Path;

use candle_core::Device;

use super::memory;
use crate::config::TrainConfig;
use crate::data::DataSource;
use crate::model::{self, Model, ModelConfig, Params};
use crate::pretrained::{self, SpecialTokens};
use crate::{checkpoint, Error, Result};

/// Fresh weights, or the pretrained ones named by `init_from` (see
/// [`crate::pretrained::resolve`]: a model directory, a trainer checkpoint or run directory, or
/// a hub model id).
///
/// A pretrained model keeps all its positions (`wpe` rows, `n_positions`): the run's
/// `block_size` is only the length of its training batches and may be shorter (the trainer
/// checks it fits, and that the model embeds the data's vocabulary, for every model). The
/// special token ids are those of the run's vocabulary ([`pretrained::data_special_tokens`]).
pub fn build_model(
    config: &TrainConfig,
    data: &dyn DataSource,
    device: &Device,
) -> Result<(Box<dyn Model>, Params)> {
    let Some(from) = &config.init_from else {
        let tokens = pretrained::data_special_tokens(config, SpecialTokens::default())?;
        let fresh = config
            .model_config(data.vocab_size())
            .with_run_settings(config.dropout, tokens);
        memory::check_run_fits(config, fresh.as_ref(), device)?;
        return model::init(fresh.as_ref(), config.seed, device);
    };
    let dir = pretrained::resolve(from)?;
    let loaded = model::config_from_hf_json_file(&dir.join(checkpoint::CONFIG_FILE))?;
    let tokens = pretrained::data_special_tokens(config, loaded.special_tokens())?;
    let cfg = loaded.with_run_settings(config.dropout, tokens);
    memory::check_run_fits(config, cfg.as_ref(), device)?;
    let params = checkpoint::load_params(&dir.join(checkpoint::MODEL_FILE), cfg.as_ref(), device)?;
    let model = model::build(cfg.as_ref(), &params)?;
    Ok((model, params))
}

/// A resumed run may change how long it trains and how it reports, not what it trains.
pub fn check_resume_compatible(saved: &TrainConfig, new: &TrainConfig, dir: &Path) -> Result<()> {
    macro_rules! changed {
        ($($field:ident),+) => {
            [$((stringify!($field), saved.$field != new.$field)),+]
        };
    }
    let changed: Vec<&str> = changed!(
        n_layer,
        n_head,
        n_embd,
        block_size,
        bias,
        data,
        data_path,
        tokenizer_path,
        digits,
        val_fraction,
        seed,
        batch_size
    )
    .iter()
    .filter(|(_, changed)| *changed)
    .map(|(n, _)| *n)
    .collect();
    if changed.is_empty() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "cannot change {} when resuming from {} (they define the model, the data or the batch stream)",
        changed.join(", "),
        dir.display()
    )))
}

/// Checks that a checkpoint's `config.json` (`model`) agrees with its run config: the shape
/// the run trains, room for its context, and an embedding for every token id of the data.
pub fn check_model_matches(
    model: &dyn ModelConfig,
    config: &TrainConfig,
    data: &dyn DataSource,
    dir: &Path,
) -> Result<()> {
    let mut wrong = Vec::new();
    let shape = model.shape();
    for (name, in_model, in_run) in [
        ("n_layer", shape.n_layer, config.n_layer),
        ("n_head", shape.n_head, config.n_head),
        ("n_embd", shape.n_embd, config.n_embd),
    ] {
        if in_model != in_run {
            wrong.push(format!("{name} {in_model} (trainer_state.json: {in_run})"));
        }
    }
    if shape.bias != config.bias {
        wrong.push(format!(
            "bias {} (trainer_state.json: {})",
            shape.bias, config.bias
        ));
    }
    if model.max_positions() < config.block_size {
        wrong.push(format!(
            "n_positions {} < the run's block_size {}",
            model.max_positions(),
            config.block_size
        ));
    }
    if model.vocab_size() < data.vocab_size() {
        wrong.push(format!(
            "vocab_size {} < the data's {} token ids",
            model.vocab_size(),
            data.vocab_size()
        ));
    }
    if wrong.is_empty() {
        return Ok(());
    }
    Err(Error::checkpoint(
        dir.join(checkpoint::CONFIG_FILE),
        format!("disagrees with the run it belongs to: {}", wrong.join(", ")),
    ))
}
