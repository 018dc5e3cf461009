//! [`Trainer::builder`]: a run from its parts (data, model, optimiser, tuning, run directory
//! and hyper-parameters), each optional; what is not given comes from the [`TrainConfig`].
//! The model a run's config asks for is built here too: fresh or pretrained (`build_model`),
//! or resumed from a checkpoint (`resume_model`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use candle_peft::LoraConfig;

use super::{memory, Trainer};
use crate::config::{Precision, TrainConfig};
use crate::data::BatchIter;
use crate::data::{DataSource, IntoBatch};
use crate::lora::{self, Tuning};
use crate::model::{self, Model, ModelConfig, Params};
use crate::objective::Objective;
use crate::optim::Optimizer;
use crate::pretrained::{self, SpecialTokens};
use crate::{load, Error, Result};

/// Builds an optimiser over a run's parameters (see [`TrainerBuilder::optimizer`]).
pub(crate) type OptimizerFn = Box<dyn FnOnce(&TrainConfig, &Params) -> Result<Box<dyn Optimizer>>>;

enum Data {
    Source(Box<dyn DataSource>),
    Batches(Box<dyn FnOnce(usize) -> BatchIter>),
}

/// The parts of a new [`Trainer`] run (from [`Trainer::builder`]).
///
/// Every part is optional: the data ([`TrainerBuilder::data`], or a program's own iterator of
/// batches by [`TrainerBuilder::batches`]; default: the config's data), the model
/// ([`TrainerBuilder::model`], or [`TrainerBuilder::init_from`] a pretrained one; default: the
/// config's, fresh or `init_from`), the tuning ([`TrainerBuilder::lora`]; default: every
/// weight trains), the optimiser ([`TrainerBuilder::optimizer`]; default:
/// [`crate::optim::build`], the config's `optimizer`), the objective ([`TrainerBuilder::objective`];
/// default: [`crate::objective::build`], the config's next-token cross-entropy), the hyper-parameters (a [`TrainConfig`] or the
/// setters) and the run directory ([`TrainerBuilder::run_dir`]; default: none, and then the run
/// writes nothing: no `run.toml`, metrics, loss curve or checkpoints).
///
/// ```
/// use trainer::train::Trainer;
///
/// // Two steps of a small GPT on the embedded addition task, writing nothing.
/// let mut t = Trainer::builder()
///     .configure(|c| (c.n_layer, c.n_head, c.n_embd) = (1, 2, 32))
///     .max_iters(2)
///     .batch(4, 16)
///     .build()?;
/// let summary = t.run(&mut (), &Default::default())?;
/// assert_eq!(summary.step, 2);
/// assert!(summary.checkpoint.is_none());
/// # Ok::<(), trainer::Error>(())
/// ```
pub struct TrainerBuilder {
    config: TrainConfig,
    data: Option<Data>,
    model: Option<(Box<dyn Model>, Params)>,
    optimizer: Option<OptimizerFn>,
    objective: Option<Arc<dyn Objective>>,
    run_dir: Option<PathBuf>,
    overwrite: bool,
}

impl Trainer {
    /// A builder of a new run over the default [`TrainConfig`] (see [`TrainerBuilder`]).
    pub fn builder() -> TrainerBuilder {
        TrainerBuilder {
            config: TrainConfig::default(),
            data: None,
            model: None,
            optimizer: None,
            objective: None,
            run_dir: None,
            overwrite: false,
        }
    }
}

impl TrainerBuilder {
    /// Every hyper-parameter from `config` (replacing what was set before). Its `out_dir` is
    /// not a run directory unless given to [`TrainerBuilder::run_dir`].
    pub fn config(mut self, config: TrainConfig) -> Self {
        self.config = config;
        self
    }

    /// Changes the config's fields in place (any field the setters do not cover).
    pub fn configure(mut self, change: impl FnOnce(&mut TrainConfig)) -> Self {
        change(&mut self.config);
        self
    }

    /// The peak learning rate.
    pub fn lr(self, lr: f64) -> Self {
        self.configure(|c| c.lr = lr)
    }

    /// Optimiser steps to train (the learning-rate schedule decays over them unless
    /// `lr_decay_iters` is set).
    pub fn max_iters(self, steps: usize) -> Self {
        self.configure(|c| c.max_iters = steps)
    }

    /// Rows per micro-batch and tokens per row.
    pub fn batch(self, batch_size: usize, block_size: usize) -> Self {
        self.configure(|c| {
            c.batch_size = batch_size;
            c.block_size = block_size;
        })
    }

    /// The compute precision (f32 master weights whatever it is).
    pub fn precision(self, dtype: Precision) -> Self {
        self.configure(|c| c.dtype = dtype)
    }

    /// The data: any [`DataSource`].
    pub fn data(mut self, source: impl DataSource + 'static) -> Self {
        self.data = Some(Data::Source(Box::new(source)));
        self
    }

    /// The data: the program's own iterator of batches over token ids `< vocab_size`, each a
    /// [`crate::data::Batch`] or a pair of input and target id vectors ([`IntoBatch`]) of
    /// `batch_size x block_size` tokens. Step `s` trains on items `s * grad_accum ..` in order.
    /// An iterator that ends before the run does is an error; there is no held-out data, so
    /// the run does not evaluate (no eval losses, samples or task scores).
    pub fn batches<T: IntoBatch + 'static>(
        mut self,
        vocab_size: usize,
        batches: impl Iterator<Item = T> + Send + 'static,
    ) -> Self {
        self.data = Some(Data::Batches(Box::new(move |keep| {
            BatchIter::new(vocab_size, batches, keep)
        })));
        self
    }

    /// The model: one the program built, over its parameters (any [`Model`]; its architecture
    /// must be registered ([`crate::model::register`]) for its checkpoints to load). Every
    /// parameter trains.
    pub fn model(mut self, model: Box<dyn Model>, params: Params) -> Self {
        self.model = Some((model, params));
        self
    }

    /// The model: pretrained weights (a model directory, a trainer run or checkpoint, or a
    /// hub id; see [`crate::pretrained::resolve`]).
    pub fn init_from(self, from: impl AsRef<Path>) -> Self {
        let from = from.as_ref().to_string_lossy().into_owned();
        self.configure(|c| c.init_from = Some(from))
    }

    /// Tuning: LoRA adapters over the frozen pretrained model (PEFT's `LoraConfig`: rank,
    /// alpha, dropout, targets, rsLoRA, modules to save; its base is
    /// [`TrainerBuilder::init_from`]'s).
    pub fn lora(self, lora: LoraConfig) -> Self {
        self.configure(|c| adopt_lora(c, lora))
    }

    /// The optimiser, built over the run's parameters (the adapters' in a LoRA run) once they
    /// exist; [`Trainer::resume_with`] continues such a run.
    pub fn optimizer(
        mut self,
        build: impl FnOnce(&TrainConfig, &Params) -> Result<Box<dyn Optimizer>> + 'static,
    ) -> Self {
        self.optimizer = Some(Box::new(build));
        self
    }

    /// The objective: the loss of the head's outputs, and how batches are weighed (see
    /// [`crate::objective`]). A program's own objective is not recorded in `run.toml`: a
    /// resumed run gets the config's unless given it again.
    pub fn objective(mut self, objective: impl Objective + 'static) -> Self {
        self.objective = Some(Arc::new(objective));
        self
    }

    /// The run directory: `run.toml`, `metrics.jsonl`, the loss curve and checkpoints go there
    /// (a fresh run refuses a directory that holds one unless [`TrainerBuilder::overwrite`]).
    /// Without one the run writes nothing, and [`Trainer::save_checkpoint`] is an error.
    pub fn run_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.run_dir = Some(dir.into());
        self
    }

    /// Lets the run replace the run already in its run directory.
    pub fn overwrite(mut self, yes: bool) -> Self {
        self.overwrite = yes;
        self
    }

    /// Checks the parts against each other and builds the run: the config validated, the
    /// device and the data opened, the model built (and its memory checked), the optimiser.
    pub fn build(self) -> Result<Trainer> {
        let mut config = self.config;
        let writes = self.run_dir.is_some();
        if let Some(dir) = self.run_dir {
            config.out_dir = dir;
        }
        config.absolute_paths()?;
        if self.model.is_none() {
            tokenizer_from_init(&mut config)?;
            adopt_adapter_config(&mut config)?;
        }
        config.validate()?;
        let device = config.open_device()?;
        let (data, evaluates): (Box<dyn DataSource>, bool) = match self.data {
            None => (config.open_data()?, true),
            Some(Data::Source(source)) => {
                source.check_block_size(config.block_size)?;
                (source, true)
            }
            Some(Data::Batches(make)) => (Box::new(make(config.grad_accum)), false),
        };
        let (model, params, tuning) = match self.model {
            Some((model, params)) => {
                // The caller allocated the model already; `init` checks before it does.
                memory::check_run_fits(&(&config).into(), model.config(), &device)?;
                (model, params, Tuning::Full)
            }
            None => build_model(&config, data.as_ref(), &device)?,
        };
        let optimizer = self.optimizer.unwrap_or(Box::new(run_optimizer));
        let mut trainer = Trainer::start(config, device, data, model, params, tuning, optimizer)?;
        trainer.writes = writes;
        trainer.evaluates = evaluates;
        if let Some(objective) = self.objective {
            trainer.objective = objective;
        }
        Ok(trainer.overwrite(self.overwrite))
    }
}

/// The optimiser a run's config names, over `params` ([`crate::optim::build`]: the config's
/// `optimizer` with its options): what a trainer takes unless given another.
pub(crate) fn run_optimizer(config: &TrainConfig, params: &Params) -> Result<Box<dyn Optimizer>> {
    crate::optim::build(config, params)
}

/// Tokenizer and SFT data without a `tokenizer_path` take the `tokenizer.json` of the
/// `init_from` model, when it has one (recorded in the config, so the run's data stays
/// the same on resume).
fn tokenizer_from_init(config: &mut TrainConfig) -> Result<()> {
    if !config.data.uses_tokenizer() || config.tokenizer_path.is_some() {
        return Ok(());
    }
    if let Some(spec) = &config.init_from {
        let path = crate::pretrained::resolve(spec)?.join("tokenizer.json");
        if path.is_file() {
            config.tokenizer_path = Some(path);
        }
    }
    Ok(())
}

/// Writes a PEFT adapter's settings into the run's config (the adapter's config replaces the
/// `lora_*` settings, so that the run records what it trains), when `adapter` is set.
fn adopt_adapter_config(config: &mut TrainConfig) -> Result<()> {
    let Some(dir) = &config.adapter else {
        return Ok(());
    };
    let c = LoraConfig::load(&dir.join(candle_peft::format::ADAPTER_CONFIG_FILE))
        .map_err(|e| Error::Config(e.to_string()))?;
    adopt_lora(config, c);
    Ok(())
}

/// Writes the LoRA settings of `lora` into the run's `lora_*` fields.
fn adopt_lora(config: &mut TrainConfig, lora: LoraConfig) {
    config.lora_r = lora.r;
    config.lora_alpha = lora.lora_alpha;
    config.lora_dropout = lora.lora_dropout;
    config.lora_targets = lora.target_modules;
    config.rslora = lora.use_rslora;
    config.modules_to_save = crate::config::ModuleList(lora.modules_to_save);
}

/// Fresh weights, or the pretrained ones named by `init_from` (see
/// [`crate::pretrained::resolve`]: a model directory, a trainer checkpoint or run directory, or
/// a hub model id).
///
/// A pretrained model keeps all its positions (`wpe` rows, `n_positions`): the run's
/// `block_size` is only the length of its training batches and may be shorter (the trainer
/// checks it fits, and that the model embeds the data's vocabulary, for every model). The
/// special token ids are those of the run's vocabulary (`pretrained::data_special_tokens`).
///
/// A LoRA run (`lora_r > 0`) freezes that model and trains adapters on it, fresh (PEFT's
/// initialisation) or from the PEFT adapter `adapter`: the parameters returned are the
/// adapters' (and the modules to save).
pub(crate) fn build_model(
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
        memory::check_run_fits(&config.into(), fresh.as_ref(), device)?;
        let (model, params) = model::init(fresh.as_ref(), config.seed, device)?;
        return Ok((model, params, Tuning::Full));
    };
    // The one loading path (`crate::load`): the source's own run check when it is a trainer
    // checkpoint, the data's vocabulary, this run's memory before allocating, the weights,
    // the manifest.
    let source = pretrained::ModelDir::open(from)?;
    let settings =
        |loaded: &dyn model::ModelConfig| -> candle_models::Result<Box<dyn model::ModelConfig>> {
            let tokens = pretrained::data_special_tokens(
                config.data,
                config.tokenizer_path.as_deref(),
                loaded.special_tokens(),
            )?;
            Ok(loaded.with_run_settings(config.dropout, tokens))
        };
    let quant = config.nf4_settings();
    let four_bit = four_bit(lora.is_some(), quant.as_ref())?;
    let step = memory::MemorySettings::from(config);
    let fits = |m: &dyn ModelConfig, d: &Device, q: Option<bool>| {
        memory::check_loaded_fits(&step, m, d, q).map_err(Into::into)
    };
    let checks = load::Checks {
        train: Some(&fits),
        data: Some(load::DataCheck {
            source: data,
            fingerprint: load::FingerprintCheck::Skip,
        }),
        vocab: None,
        settings: Some(&settings),
        unmerged: false,
        four_bit,
    };
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
    let base = match loaded.base.clone() {
        Some(id) => lora::BaseIdentity {
            model: from.clone(),
            ..id
        },
        None => lora::BaseIdentity::of(from, loaded.config.as_ref(), &loaded.params)?,
    };
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
        computing(config, loaded.quantized.as_ref()).as_ref(),
        config.seed,
    )
    .map_err(Error::from)
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
            computing(config, loaded.quantized.as_ref()).as_ref(),
            config.seed,
        )
        .map_err(Error::from),
        (Some(_), ..) => Err(Error::checkpoint(
            dir,
            "holds adapters but trainer_state.json records no base model",
        )),
    }
}

/// What a run (LoRA or not, quantizing its base on load as `quant` says or not) takes of a
/// base held in 4 bits.
fn four_bit(lora: bool, quant: Option<&lora::Nf4Settings>) -> Result<load::FourBit<'_>> {
    match (lora, quant) {
        (false, Some(_)) => Err(Error::Config(
            "--base-quant nf4 holds the frozen base of a LoRA run in 4 bits: give --lora-r (or \
             --adapter)"
                .into(),
        )),
        (false, None) => Ok(load::FourBit::Refuse),
        (true, None) => Ok(load::FourBit::Keep),
        (true, Some(q)) => Ok(load::FourBit::Quantize(q)),
    }
}

/// A run's 4-bit layers computing in its `--base-compute-dtype` (default: a saved model's
/// `bnb_4bit_compute_dtype`, else `--base-dtype`).
fn computing(config: &TrainConfig, layers: Option<&lora::Nf4Layers>) -> Option<lora::Nf4Layers> {
    let base_dtype = config.base_dtype.unwrap_or(config.dtype).dtype();
    layers.map(|l| lora::Nf4Layers {
        compute_dtype: Some(
            (config.base_compute_dtype.map(|p| p.dtype()))
                .or(l.compute_dtype)
                .unwrap_or(base_dtype),
        ),
        ..l.clone()
    })
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
