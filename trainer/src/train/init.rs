//! Building a run: device, data source and model (fresh or pretrained).

use std::path::Path;

use candle_core::Device;

use crate::config::TrainConfig;
use crate::data::{self, DataSource, DataSpec, Fingerprint};
use crate::model::{Gpt, GptConfig, Params};
use crate::pretrained::{self, SpecialTokens};
use crate::{checkpoint, Error, Result};

/// The data spec a run config describes.
pub fn data_spec(config: &TrainConfig) -> Result<DataSpec> {
    Ok(DataSpec {
        kind: config.data,
        path: config.data_path.clone(),
        tokenizer: config.tokenizer_path.clone(),
        val_fraction: config.val_fraction,
        cache_dir: config.cache_dir.clone(),
        digits: config.digits,
        seed: config.seed,
    })
}

/// Opens the run's data and checks it can serve windows of `block_size + 1` tokens.
pub fn open_data(config: &TrainConfig) -> Result<Box<dyn DataSource>> {
    let source = data::open(&data_spec(config)?)?;
    source.check_block_size(config.block_size)?;
    Ok(source)
}

/// Fresh weights, or the pretrained ones named by `init_from` (see
/// [`crate::pretrained::resolve`]: a model directory, a trainer checkpoint or run directory, or
/// a hub model id).
///
/// A pretrained model keeps all its positions (`wpe` rows, `n_positions`): the run's
/// `block_size` is only the length of its training batches and may be shorter. The special
/// token ids are those of the run's vocabulary ([`pretrained::data_special_tokens`]).
pub fn build_model(
    config: &TrainConfig,
    data: &dyn DataSource,
    device: &Device,
) -> Result<(Gpt, Params)> {
    let Some(from) = &config.init_from else {
        let tokens = pretrained::data_special_tokens(config, SpecialTokens::default())?;
        let gpt = GptConfig {
            bos_token_id: tokens.bos,
            eos_token_id: tokens.eos,
            ..config.gpt_config(data.vocab_size())
        };
        return Gpt::new(&gpt, config.seed, device);
    };
    let dir = pretrained::resolve(from)?;
    let (loaded, params) = checkpoint::load_model(&dir, device)?;
    if config.block_size > loaded.block_size {
        return Err(Error::Config(format!(
            "block_size {} exceeds the {} positions of the model loaded from {}",
            config.block_size,
            loaded.block_size,
            dir.display()
        )));
    }
    if data.vocab_size() > loaded.vocab_size {
        return Err(Error::Config(format!(
            "the data has {} token ids but the model loaded from {} embeds only {}",
            data.vocab_size(),
            dir.display(),
            loaded.vocab_size
        )));
    }
    let own = SpecialTokens {
        bos: loaded.bos_token_id,
        eos: loaded.eos_token_id,
    };
    let tokens = pretrained::data_special_tokens(config, own)?;
    let gpt = GptConfig {
        dropout: config.dropout,
        bos_token_id: tokens.bos,
        eos_token_id: tokens.eos,
        ..loaded
    };
    let model = Gpt::from_params(&gpt, &params)?;
    Ok((model, params))
}

/// A resumed run may change how long it trains and how it reports, not what it trains.
pub fn check_resume_compatible(saved: &TrainConfig, new: &TrainConfig, dir: &Path) -> Result<()> {
    let fixed: [(&str, bool); 12] = [
        ("n_layer", saved.n_layer == new.n_layer),
        ("n_head", saved.n_head == new.n_head),
        ("n_embd", saved.n_embd == new.n_embd),
        ("block_size", saved.block_size == new.block_size),
        ("bias", saved.bias == new.bias),
        ("data", saved.data == new.data),
        ("data_path", saved.data_path == new.data_path),
        ("tokenizer_path", saved.tokenizer_path == new.tokenizer_path),
        ("digits", saved.digits == new.digits),
        ("val_fraction", saved.val_fraction == new.val_fraction),
        ("seed", saved.seed == new.seed),
        ("batch_size", saved.batch_size == new.batch_size),
    ];
    let changed: Vec<&str> = fixed
        .iter()
        .filter(|(_, same)| !same)
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

/// Checks that a checkpoint's `config.json` (`model`) agrees with its run config: the shape
/// the run trains, room for its context, and an embedding for every token id of the data.
pub fn check_model_matches(
    model: &GptConfig,
    config: &TrainConfig,
    data: &dyn DataSource,
    dir: &Path,
) -> Result<()> {
    let mut wrong = Vec::new();
    for (name, in_model, in_run) in [
        ("n_layer", model.n_layer, config.n_layer),
        ("n_head", model.n_head, config.n_head),
        ("n_embd", model.n_embd, config.n_embd),
    ] {
        if in_model != in_run {
            wrong.push(format!("{name} {in_model} (trainer_state.json: {in_run})"));
        }
    }
    if model.bias != config.bias {
        wrong.push(format!(
            "bias {} (trainer_state.json: {})",
            model.bias, config.bias
        ));
    }
    if model.block_size < config.block_size {
        wrong.push(format!(
            "n_positions {} < the run's block_size {}",
            model.block_size, config.block_size
        ));
    }
    if model.vocab_size < data.vocab_size() {
        wrong.push(format!(
            "vocab_size {} < the data's {} token ids",
            model.vocab_size,
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
