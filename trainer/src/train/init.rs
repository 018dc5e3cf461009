//! Building a run's model (fresh or pretrained) and checking a resumed run against its
//! checkpoint.

use std::path::Path;

use candle_core::Device;
use candle_peft::LoraConfig;

use super::memory;
use crate::config::{OnResume, TrainConfig};
use crate::data::DataSource;
use crate::lora::{self, Tuning};
use crate::model::{self, Model, Params};
use crate::pretrained::{self, SpecialTokens};
use crate::{load, Error, Result};

/// Fresh weights, or the pretrained ones named by `init_from` (see
/// [`crate::pretrained::resolve`]: a model directory, a trainer checkpoint or run directory, or
/// a hub model id).
///
/// A pretrained model keeps all its positions (`wpe` rows, `n_positions`): the run's
/// `block_size` is only the length of its training batches and may be shorter (the trainer
/// checks it fits, and that the model embeds the data's vocabulary, for every model). The
/// special token ids are those of the run's vocabulary ([`pretrained::data_special_tokens`]).
///
/// A LoRA run (`lora_r > 0`) freezes that model and trains adapters on it, fresh (PEFT's
/// initialisation) or from the PEFT adapter `adapter`: the parameters returned are the
/// adapters' (and the modules to save).
pub fn build_model(
    config: &TrainConfig,
    data: &dyn DataSource,
    device: &Device,
) -> Result<(Box<dyn Model>, Params, Tuning)> {
    let lora = run_lora_config(config);
    let Some(from) = &config.init_from else {
        if lora.is_some() {
            return Err(Error::Config(
                "LoRA (lora_r > 0 or --adapter) trains adapters on a pretrained model: give it \
                 with --init-from"
                    .into(),
            ));
        }
        let tokens = pretrained::data_special_tokens(
            config.data,
            config.tokenizer_path.as_deref(),
            SpecialTokens::default(),
        )?;
        let fresh = config
            .model_config(data.vocab_size())?
            .with_run_settings(config.dropout, tokens);
        memory::check_run_fits(config, fresh.as_ref(), device)?;
        let (model, params) = model::init(fresh.as_ref(), config.seed, device)?;
        return Ok((model, params, Tuning::Full));
    };
    // The one loading path (`crate::load`): the source's own run check when it is a trainer
    // checkpoint, the data's vocabulary, this run's memory before allocating, the weights,
    // the manifest.
    let source = pretrained::ModelDir::open(from)?;
    let settings = |loaded: &dyn model::ModelConfig| -> Result<Box<dyn model::ModelConfig>> {
        let tokens = pretrained::data_special_tokens(
            config.data,
            config.tokenizer_path.as_deref(),
            loaded.special_tokens(),
        )?;
        Ok(loaded.with_run_settings(config.dropout, tokens))
    };
    let checks = load::Checks {
        train: Some(config),
        data: Some(load::DataCheck {
            source: data,
            fingerprint: load::FingerprintCheck::Skip,
        }),
        vocab: None,
        settings: Some(&settings),
        unmerged: false,
    };
    let quant = config.nf4_settings();
    if quant.is_some() && lora.is_none() {
        return Err(Error::Config(
            "--base-quant nf4 holds the frozen base of a LoRA run in 4 bits: give --lora-r (or \
             --adapter)"
                .into(),
        ));
    }
    let Some(lora) = lora else {
        let loaded = source.load_with(&checks, device)?;
        let model = loaded.build()?;
        return Ok((model, loaded.params, Tuning::Full));
    };
    if source.adapter.is_some() {
        return Err(Error::Config(format!(
            "--init-from {from} holds adapters: LoRA needs a plain base model (merge them first \
             with `trainer export --merge`, or resume that run)"
        )));
    }
    let loaded = source.load_with(&checks, device)?;
    let base = lora::BaseIdentity::of(from, loaded.config.as_ref(), &loaded.params)?;
    let adapter = match &config.adapter {
        Some(dir) => {
            let a = lora::read_adapter(dir, device)?;
            lora::check_adapter_base(&a, &base, config.other_base)?;
            Some(a)
        }
        None => None,
    };
    let base_dtype = config.base_dtype.unwrap_or(config.dtype).dtype();
    Tuning::lora_over(
        loaded.config.as_ref(),
        &loaded.params,
        &lora,
        adapter.as_ref(),
        base,
        base_dtype,
        quant.as_ref(),
        config.seed,
    )
}

/// A resumed run may change how long it trains, how it executes and how it reports, not what it
/// trains: every field the config classifies as [`OnResume::fixed`] (see
/// [`TrainConfig::FIELDS`]) must keep its saved value. A change is refused naming each such
/// field with its saved and its new value, and the checkpoint `dir`; the caller checks this
/// before it loads or writes anything.
pub fn check_resume_compatible(saved: &TrainConfig, new: &TrainConfig, dir: &Path) -> Result<()> {
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

/// The model a checkpoint `dir` of a run with `config` resumes, as the loader `loaded` it
/// (the base checked against the one the run recorded, `recorded_base`): the whole model
/// when it holds no adapters; else its adapters over the base (on which the run goes on
/// recording the base as found now: an old run's file digests become the semantic
/// identity), their config as the checkpoint's `adapter_config.json` says.
pub(crate) fn resume_model(
    loaded: &load::Loaded,
    recorded_base: bool,
    config: &TrainConfig,
    dir: &Path,
) -> Result<(Box<dyn Model>, Params, Tuning)> {
    match (&loaded.adapter, &loaded.base, recorded_base) {
        (None, ..) => Ok((loaded.build()?, loaded.params.clone(), Tuning::Full)),
        (Some(a), Some(base), true) => Tuning::lora_over(
            loaded.config.as_ref(),
            &loaded.params,
            &a.config,
            Some(a),
            base.clone(),
            config.base_dtype.unwrap_or(config.dtype).dtype(),
            config.nf4_settings().as_ref(),
            config.seed,
        ),
        (Some(_), ..) => Err(Error::checkpoint(
            dir,
            "holds adapters but trainer_state.json records no base model",
        )),
    }
}

/// The LoRA config of a run (`lora_r > 0`), or `None` for full fine-tuning.
fn run_lora_config(config: &TrainConfig) -> Option<LoraConfig> {
    (config.lora_r > 0).then(|| {
        LoraConfig::new(config.lora_r, config.lora_alpha)
            .with_targets(config.lora_targets.clone())
            .with_rslora(config.rslora)
            .with_dropout(config.lora_dropout)
            .with_modules_to_save(config.modules_to_save.0.clone())
            .with_base(config.init_from.clone())
    })
}
