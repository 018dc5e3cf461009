//! Building a run: device, data source and model (fresh or pretrained).

use std::path::Path;

use candle_core::{Device, Var};

use crate::config::TrainConfig;
use crate::data::{self, DataKind, DataSource, DataSpec, Fingerprint};
use crate::model::{Gpt, GptConfig, Params};
use crate::{checkpoint, hub, Error, Result};

/// Parses `cpu`, `cuda`, `cuda:N` or `metal` (GPU devices need the crate's matching feature).
pub fn parse_device(name: &str) -> Result<Device> {
    let dev = match name {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        "metal" => Device::new_metal(0)?,
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Device::new_cuda(i)?,
            _ => {
                return Err(Error::Config(format!(
                    "device must be cpu, cuda, cuda:N or metal, not `{other}`"
                )))
            }
        },
    };
    Ok(dev)
}

/// The data spec a run config describes.
pub fn data_spec(config: &TrainConfig) -> Result<DataSpec> {
    let kind = match config.data.as_str() {
        "addition" => DataKind::Addition,
        "char" => DataKind::Char,
        "byte" => DataKind::Byte,
        "tokenizer" => DataKind::Tokenizer,
        other => return Err(Error::Config(format!("unknown data kind `{other}`"))),
    };
    Ok(DataSpec {
        kind,
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

/// Fresh weights, or the pretrained ones named by `init_from` (cropped to `block_size`).
pub fn build_model(
    config: &TrainConfig,
    data: &dyn DataSource,
    device: &Device,
) -> Result<(Gpt, Params)> {
    let Some(from) = &config.init_from else {
        let gpt = config.gpt_config(data.vocab_size());
        return Gpt::new(&gpt, config.seed, device);
    };
    let dir = if Path::new(from).is_dir() {
        Path::new(from).to_path_buf()
    } else {
        hub::snapshot_dir(&hub::default_cache(), from)?
    };
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
    let gpt = GptConfig {
        block_size: config.block_size,
        dropout: config.dropout,
        ..loaded
    };
    let params = crop_positions(params, config.block_size)?;
    let model = Gpt::from_params(&gpt, &params)?;
    Ok((model, params))
}

/// Keeps the first `block_size` rows of the position embedding (nanoGPT's `crop_block_size`).
fn crop_positions(params: Params, block_size: usize) -> Result<Params> {
    let name = "transformer.wpe.weight";
    let wpe = params.tensor(name)?;
    if wpe.dim(0)? == block_size {
        return Ok(params);
    }
    let cropped = Var::from_tensor(&wpe.narrow(0, 0, block_size)?)?;
    Ok(Params::from_vars(params.iter().map(|(n, v)| {
        let v = if n == name {
            cropped.clone()
        } else {
            v.clone()
        };
        (n.clone(), v)
    })))
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
