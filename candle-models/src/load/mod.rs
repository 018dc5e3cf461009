//! One loading path for every command: `train --resume`, `train --init-from`, `eval`,
//! `sample`, `inspect` and `export` resolve what they are given with [`ModelDir::open`] and
//! read it with [`ModelDir::load_then`] (or its shorthands), so a check added there holds for
//! all of them.
//!
//! What can be loaded ([`resolve`]):
//!
//! - a directory with `config.json` and weights (`model.safetensors`, or the shards named by
//!   `model.safetensors.index.json`): a Hugging Face model directory, or a trainer checkpoint
//!   directory (it also holds `trainer_state.json` and `manifest.json`),
//! - a trainer run directory (its latest checkpoint, see [`resolve_checkpoint`]),
//! - a model id such as `openai-community/gpt2`, found in the local hub cache ([`crate::hub`];
//!   nothing is downloaded).
//!
//! Loading, in this order (the first problem is the error, naming the file and the key):
//!
//! 1. `config.json`, of any known architecture ([`crate::model::config_from_hf_json_file`]);
//! 2. for a trainer checkpoint given data, the data's fingerprint against the run's
//!    ([`candle_data::check_fingerprint`]), then `config.json` against the run's recorded
//!    state ([`RunState::check_model`]);
//! 3. the data's and the tokenizer's vocabularies against the model's embedding;
//! 4. memory: a training step of the run (given one), else the f32 weights, must fit, before
//!    anything of the model's size is allocated;
//! 5. the weights, single or sharded, memory-mapped and checked ([`WeightFiles::read`]);
//! 6. what the caller reads besides (resume: the optimiser state);
//! 7. a trainer checkpoint's `manifest.json` (`manifest::verify`), last, so that a
//!    corrupt file is named for what is wrong with it before the manifest says it changed.

pub(crate) mod finite;
pub(crate) mod fits;
mod four_bit;
pub(crate) mod layout;
pub mod manifest;
pub(crate) mod resolve;
mod run;
mod weights;

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;

pub use finite::check_tensors;
pub use fits::{check_fits, sized_floor};
pub use four_bit::FourBit;
pub use layout::{
    checkpoints_dir, Source, CONFIG_FILE, INDEX_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE,
};
pub use resolve::{resolve, resolve_checkpoint, resolve_in};
pub use run::{RunConfig, RunState};
pub use weights::{ShardIndex, Streamed, TensorHeader, WeightFiles};

use crate::model::{Model, ModelConfig, Params};
use crate::{Error, Result};
use candle_data::tokenizer::{TokenizerFile, TOKENIZER_FILE};
use candle_data::DataSource;
use candle_peft::format::ADAPTER_CONFIG_FILE;
use manifest::verify as verify_manifest;

/// `transformers`' generation settings file (`eos_token_id` may be a list there).
pub(crate) const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// A resolved model directory: where its weights are and, for a trainer checkpoint, the run
/// it belongs to; for adapters (a LoRA run's checkpoint, a PEFT adapter directory), the base
/// model's directory and the adapters'.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The directory holding `config.json` and the weights (the base model's, for adapters).
    pub dir: PathBuf,
    /// What loading reads of a trainer checkpoint's `trainer_state.json` (`None` for a bare
    /// Hugging Face model).
    pub run: Option<RunState>,
    /// The weight files: `model.safetensors` or the shards of its index.
    pub weights: WeightFiles,
    /// The directory of the adapters applied over the weights (`adapter_config.json` +
    /// `adapter_model.safetensors`), if any.
    pub adapter: Option<PathBuf>,
    /// Adapters whose file records another base than the one found are used anyway (with a
    /// warning naming both) instead of refused: the commands' `--other-base`.
    pub other_base: bool,
}

/// How a trainer checkpoint's data fingerprint is checked against the data given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FingerprintCheck {
    /// Not at all: the data is another run's (`--init-from`).
    Skip,
    /// The vocabulary must be the run's (the ids mean what they meant in training).
    Vocabulary,
    /// The vocabulary and the token stream must be the run's (resuming it, or evaluating it
    /// on its own corpus).
    Corpus,
}

/// Data a model is loaded for.
#[derive(Clone, Copy)]
pub struct DataCheck<'a> {
    /// The data source.
    pub source: &'a dyn DataSource,
    /// What of a trainer checkpoint's fingerprint must match.
    pub fingerprint: FingerprintCheck,
}

/// A vocabulary (a tokenizer) the model's embedding must cover.
#[derive(Clone, Copy, Debug)]
pub struct Vocabulary<'a> {
    /// What it is, for the error (`the tokenizer tok.json`).
    pub name: &'a str,
    /// Its number of token ids.
    pub ids: usize,
    /// Its vocabulary fingerprint ([`candle_data::Fingerprint::vocab`]): a trainer run that
    /// recorded another one is refused (its ids would decode to other text).
    pub fingerprint: Option<&'a str>,
    /// What to do instead, for the error.
    pub advice: &'a str,
}

/// What a command checks besides the weights (each `None`: not checked).
#[derive(Clone, Copy, Default)]
pub struct Checks<'a> {
    /// The run the model is loaded for: one training step of it must fit in memory (the
    /// trainer's estimate of its step). `None`: inference, the f32 weights must fit.
    pub train: Option<&'a TrainFits<'a>>,
    /// The data the model is loaded for.
    pub data: Option<DataCheck<'a>>,
    /// A tokenizer whose ids the model must embed.
    pub vocab: Option<Vocabulary<'a>>,
    /// The config the model is built with, from the one `config.json` holds (a run's dropout
    /// and special tokens over a pretrained model's); the same shapes.
    pub settings: Option<&'a Settings<'a>>,
    /// Adapters are kept apart ([`Loaded::adapter`], the base's weights in
    /// [`Loaded::params`]) instead of merged into the weights: resuming a LoRA run.
    pub unmerged: bool,
    /// What a base held in 4 bits is to the command (QLoRA; default: refused without
    /// adapters).
    pub four_bit: FourBit<'a>,
}

/// Refuses a training step of the model `config` on `device` that cannot fit in memory;
/// `saved_4bit` is `Some(double quantization)` for a base saved in 4 bits (see
/// [`Checks::train`]).
pub(crate) type TrainFits<'a> = dyn Fn(&dyn ModelConfig, &Device, Option<bool>) -> Result<()> + 'a;

/// A function from the config `config.json` holds to the one a model is built with.
pub(crate) type Settings<'a> = dyn Fn(&dyn ModelConfig) -> Result<Box<dyn ModelConfig>> + 'a;

/// A loaded model: its config and f32 parameters.
#[derive(Debug)]
pub struct Loaded {
    /// The config (after [`Checks::settings`]).
    pub config: Box<dyn ModelConfig>,
    /// The parameters, f32, by Hugging Face name (adapters merged in, unless
    /// [`Checks::unmerged`]).
    pub params: Params,
    /// The adapters, when loaded [`Checks::unmerged`].
    pub adapter: Option<candle_peft::Adapter>,
    /// The identity of the base the adapters were loaded over, or of a LoRA run's base
    /// ([`Checks::four_bit`] other than [`FourBit::Refuse`]); `None` otherwise.
    pub base: Option<crate::lora::BaseIdentity>,
    /// The base's linear layers held in 4 bits (a model saved so, or quantized on load), by
    /// module path; [`Loaded::params`] holds the other tensors, unless adapters were merged
    /// (then it holds them all, dequantized and merged).
    pub quantized: Option<crate::lora::Nf4Layers>,
}

impl Loaded {
    /// The model built over the parameters.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        crate::model::build(self.config.as_ref(), &self.params)
    }
}

impl ModelDir {
    /// Resolves `spec` (see [`resolve`]) and reads the checkpoint's trainer state, if any.
    pub fn open(spec: &str) -> Result<Self> {
        Self::at(resolve(spec)?)
    }

    /// [`ModelDir::open`], with adapters read over `base` when given (`--init-from`, as
    /// PEFT's `PeftModel.from_pretrained(base, adapter)`) instead of the base they name.
    pub fn open_over(spec: &str, base: Option<&str>) -> Result<Self> {
        Self::at_over(resolve(spec)?, base)
    }

    /// The model in directory `dir` (already resolved). Adapters (`adapter_config.json`)
    /// are read over their base: a LoRA run's `init_from`, else the adapter's
    /// `base_model_name_or_path` (found as PEFT finds it: see
    /// `resolve::resolve_adapter_base`).
    pub fn at(dir: PathBuf) -> Result<Self> {
        Self::at_over(dir, None)
    }

    /// [`ModelDir::at`], with adapters read over `base` when given (see
    /// [`ModelDir::open_over`]); a `base` for a directory without adapters is an error.
    pub fn at_over(dir: PathBuf, base: Option<&str>) -> Result<Self> {
        let state = dir.join(STATE_FILE);
        let run: Option<RunState> = match state.is_file() {
            true => Some(candle_data::io::read_json(&state)?),
            false => None,
        };
        if !dir.join(ADAPTER_CONFIG_FILE).is_file() {
            if let Some(base) = base {
                return Err(Error::checkpoint(
                    &dir,
                    format!(
                        "holds no adapters (no {ADAPTER_CONFIG_FILE}): --init-from {base} names \
                         the base model of adapters only"
                    ),
                ));
            }
            let weights = WeightFiles::locate(&dir)?;
            return Ok(ModelDir {
                dir,
                run,
                weights,
                adapter: None,
                other_base: false,
            });
        }
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let given = base.map(str::to_string);
        let (base, base_dir) = match given.or_else(|| run.as_ref()?.config.init_from.clone()) {
            Some(spec) => (spec.clone(), resolve(&spec)?),
            None => {
                let c = candle_peft::LoraConfig::load(&config_path)
                    .map_err(|e| Error::Config(e.to_string()))?;
                let spec = c.base_model_name_or_path.ok_or_else(|| {
                    Error::checkpoint(
                        &config_path,
                        "has no base_model_name_or_path: give the base model with --init-from",
                    )
                })?;
                let found = resolve::resolve_adapter_base(&dir, &spec)?;
                (spec, found)
            }
        };
        if base_dir.join(ADAPTER_CONFIG_FILE).is_file() {
            return Err(Error::checkpoint(
                &config_path,
                format!(
                    "its base `{base}` is itself an adapter: merge that one first (trainer \
                     export --merge)"
                ),
            ));
        }
        let weights = WeightFiles::locate(&base_dir)?;
        Ok(ModelDir {
            dir: base_dir,
            run,
            weights,
            adapter: Some(dir),
            other_base: false,
        })
    }

    /// The PEFT adapters in `adapter` (`adapter_config.json` + `adapter_model.safetensors`)
    /// over the base model `base` given here (a model directory, a trainer run or checkpoint,
    /// or a hub id: [`resolve`]), whatever base their config records: [`ModelDir::at_over`].
    /// Adapters the trainer wrote still check the base identity they record (see
    /// [`ModelDir::with_other_base`]).
    ///
    /// ```
    /// use candle_models::load::ModelDir;
    ///
    /// let dir = ModelDir::adapter_over("../trainer/tests/fixtures/lora/adapter_plain", "../trainer/tests/fixtures/lora/base")?;
    /// let model = dir.load_model(&candle_core::Device::Cpu)?; // the base with the adapters merged
    /// assert_eq!(model.config().architecture(), "llama");
    /// # Ok::<(), candle_models::Error>(())
    /// ```
    pub fn adapter_over(adapter: impl Into<PathBuf>, base: &str) -> Result<Self> {
        Self::at_over(adapter.into(), Some(base))
    }

    /// The same, using adapters over another base than the one they record when `other_base`
    /// (see [`ModelDir::other_base`]).
    pub fn with_other_base(self, other_base: bool) -> Self {
        ModelDir { other_base, ..self }
    }

    /// Adapters over another base: how the base is named (a LoRA run's `init_from`, else
    /// its directory).
    fn base_name(&self) -> String {
        self.run
            .as_ref()
            .and_then(|r| r.config.init_from.clone())
            .unwrap_or_else(|| self.dir.display().to_string())
    }

    /// The checkpoint's own directory: the adapters' for adapters, else [`ModelDir::dir`].
    pub fn checkpoint_dir(&self) -> &Path {
        self.adapter.as_deref().unwrap_or(&self.dir)
    }

    /// What the weights are, which decides what loading them accepts (a LoRA run's base is
    /// a pretrained model).
    pub fn source(&self) -> Source {
        match (&self.run, &self.adapter) {
            (Some(_), None) => Source::Checkpoint,
            _ => Source::Pretrained,
        }
    }

    /// Its `config.json`, of any known architecture.
    pub fn config(&self) -> Result<Box<dyn ModelConfig>> {
        crate::model::config_from_hf_json_file(&self.dir.join(CONFIG_FILE))
    }

    /// The model's config and weights on `device`, for inference (no other checks).
    pub fn load(&self, device: &Device) -> Result<(Box<dyn ModelConfig>, Params)> {
        let l = self.load_with(&Checks::default(), device)?;
        Ok((l.config, l.params))
    }

    /// The model on `device`, ready for inference.
    pub fn load_model(&self, device: &Device) -> Result<Box<dyn Model>> {
        self.load_with(&Checks::default(), device)?.build()
    }

    /// The model's config and its weights to read one tensor at a time ([`Streamed`]), for a
    /// reader that must not hold the whole model (GGUF export): the checks of
    /// [`ModelDir::load_with`] without data, tokenizer or memory (steps 1, 2, 5 and 7; the
    /// manifest is verified before, not after, the tensors are read). Refused for adapters,
    /// which are checked against their whole base.
    pub fn stream(&self) -> Result<(Box<dyn ModelConfig>, Streamed)> {
        if let Some(dir) = &self.adapter {
            return Err(Error::Config(format!(
                "{}: adapters are loaded with their whole base, not streamed",
                dir.display()
            )));
        }
        let config = self.config()?;
        self.check_four_bit(&Checks::default())?;
        if let Some(run) = &self.run {
            run.check_model(config.as_ref(), None, &self.dir)?;
        }
        let weights = self.weights.open(config.as_ref(), self.source())?;
        weights.check_copies(&Device::Cpu, |of| weights.tensor(of, &Device::Cpu))?;
        if let Some(run) = &self.run {
            verify_manifest(self.checkpoint_dir(), run.step)?;
        }
        Ok((config, weights))
    }

    /// Loads the model on `device` after `checks` (see the module's order).
    pub fn load_with(&self, checks: &Checks, device: &Device) -> Result<Loaded> {
        Ok(self.load_then(checks, device, |_| Ok::<_, Error>(()))?.0)
    }

    /// The loader: checks, weights, then `read` (what the caller reads of the checkpoint
    /// besides, e.g. the optimiser state), then a trainer checkpoint's manifest. See the
    /// module documentation for the order.
    pub fn load_then<T, E: From<Error>>(
        &self,
        checks: &Checks,
        device: &Device,
        read: impl FnOnce(&Loaded) -> std::result::Result<T, E>,
    ) -> std::result::Result<(Loaded, T), E> {
        let stored = self.config()?;
        let saved_4bit = self.check_four_bit(checks)?;
        let data = checks.data.map(|d| d.source);
        if let Some(run) = &self.run {
            self.check_run(run, checks, stored.as_ref())?;
        }
        let config = match checks.settings {
            Some(settings) => settings(stored.as_ref())?,
            None => stored,
        };
        let embedded = config.vocab_size();
        if let Some(d) = data.filter(|d| d.vocab_size() > embedded) {
            return Err(E::from(Error::Config(format!(
                "the data has {} token ids but the model in {} embeds only {embedded}",
                d.vocab_size(),
                self.dir.display()
            ))));
        }
        if let Some(v) = checks.vocab.filter(|v| v.ids > embedded) {
            return Err(E::from(Error::Config(format!(
                "{} has {} token ids but the model in {} embeds only {embedded}{}",
                v.name,
                v.ids,
                self.dir.display(),
                v.advice
            ))));
        }
        self.check_memory(checks, config.as_ref(), device, saved_4bit)?;
        let weights = self.read_base(checks, config.as_ref(), device, saved_4bit.is_some())?;
        let (mut params, quantized, base) = (weights.params, weights.quantized, weights.identity);
        let mut adapter = None;
        if let (Some(dir), Some(now)) = (&self.adapter, &base) {
            if let Some(recorded) = self.run.as_ref().and_then(|r| r.base.as_ref()) {
                recorded.check(now, &self.dir, &self.weights.files(), dir)?;
            }
            let a = crate::lora::read_adapter(dir, device)?;
            crate::lora::check_adapter_base(&a, now, self.other_base)?;
            match checks.unmerged {
                true => {
                    crate::lora::fit_over(config.as_ref(), &params, quantized.as_ref(), &a)?;
                    adapter = Some(a);
                }
                false => {
                    // A QLoRA run's adapters were trained over the 4-bit base: merged into
                    // its dequantized weights.
                    let quant = self.run.as_ref().and_then(|r| r.config.nf4_settings());
                    if let Some(layers) = &quantized {
                        params = layers.dequantized_into(&params)?;
                    } else if let Some(q) = quant {
                        params = crate::lora::dequantized_base(config.as_ref(), &params, &q)?;
                    }
                    params = crate::lora::merge(config.as_ref(), &params, &a)?
                }
            }
        }
        let loaded = Loaded {
            config,
            params,
            adapter,
            base,
            quantized,
        };
        let more = read(&loaded)?;
        if let Some(run) = &self.run {
            // A trainer checkpoint is one unit (see [`manifest`]).
            verify_manifest(self.checkpoint_dir(), run.step)?;
        }
        Ok((loaded, more))
    }

    /// A trainer checkpoint's checks (module docs, step 2): the data's fingerprint and the
    /// tokenizer's vocabulary against the run's, then `stored` against the run's recorded
    /// model.
    fn check_run(&self, run: &RunState, checks: &Checks, stored: &dyn ModelConfig) -> Result<()> {
        if let Some(d) = checks.data {
            let tokens = match d.fingerprint {
                FingerprintCheck::Skip => None,
                FingerprintCheck::Vocabulary => Some(false),
                FingerprintCheck::Corpus => Some(true),
            };
            if let Some(tokens) = tokens {
                candle_data::check_fingerprint(run.data.as_ref(), d.source, &self.dir, tokens)?;
            }
        }
        if let (Some(v), Some(saved)) = (checks.vocab, run.data.as_ref()) {
            if let Some(now) = v.fingerprint.filter(|now| *now != saved.vocab) {
                return Err(Error::Config(format!(
                    "{} is not the vocabulary the run {} was trained on (vocabulary \
                     fingerprint {now}, the run's {}): its ids would decode to other text; \
                     leave the tokenizer out to use the run's own",
                    v.name,
                    self.dir.display(),
                    saved.vocab
                )));
            }
        }
        let data = checks.data.map(|d| d.source);
        run.check_model(stored, data, &self.dir)
    }

    /// Memory (module docs, step 4): a training step of the run, given one (over a base saved
    /// in 4 bits, `Some(double quantization)`, as such), else the f32 weights on the CPU, must
    /// fit before anything of the model's size is allocated.
    fn check_memory(
        &self,
        checks: &Checks,
        config: &dyn ModelConfig,
        device: &Device,
        saved_4bit: Option<bool>,
    ) -> Result<()> {
        match checks.train {
            Some(fits) => fits(config, device, saved_4bit),
            None if device.is_cpu() => {
                // The f32 weights, refused before they are read (activations come on top).
                let what = format!(
                    "the model in {} ({})",
                    self.dir.display(),
                    config.describe()
                );
                // The sizes first, in O(1): counting the parameters lists them.
                let floor = fits::weights_floor(config);
                fits::check_fits(floor, &what, "use a machine with more memory")?;
                let need = 4 * config.num_params() as u64;
                fits::check_fits(need, &what, "use a machine with more memory")
            }
            None => Ok(()),
        }
    }

    /// The ids generation stops at: `eos_token_id` of `generation_config.json` (an id or a
    /// list, as instruction-tuned models list several), else of `config.json`, else the end
    /// token `config` knows (e.g. GPT-2's default); ids outside the vocabulary are dropped.
    pub fn eos_token_ids(&self, config: &dyn ModelConfig) -> Result<Vec<u32>> {
        for file in [GENERATION_CONFIG_FILE, CONFIG_FILE] {
            let path = self.dir.join(file);
            if !path.is_file() {
                continue;
            }
            let json: Value = candle_data::io::read_json(&path)?;
            let v = match json.get("eos_token_id") {
                None | Some(Value::Null) => continue,
                Some(v) => v,
            };
            let ids = token_ids(v).ok_or_else(|| {
                Error::checkpoint(
                    &path,
                    format!("`eos_token_id` must be a token id or a list of them, got {v}"),
                )
            })?;
            let vocab = config.vocab_size();
            return Ok(ids.into_iter().filter(|&i| (i as usize) < vocab).collect());
        }
        Ok(config.special_tokens().eos.into_iter().collect())
    }

    /// The `tokenizer.json` next to the weights, or an error naming where it was looked for.
    pub fn tokenizer(&self) -> Result<TokenizerFile> {
        let path = self.dir.join(TOKENIZER_FILE);
        if !path.is_file() {
            return Err(Error::checkpoint(
                &path,
                "no tokenizer.json next to the model: give one with --tokenizer-path",
            ));
        }
        TokenizerFile::open(&path)
    }
}

/// An id or a list of ids.
fn token_ids(v: &Value) -> Option<Vec<u32>> {
    let one = |x: &Value| x.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        Value::Array(a) => a.iter().map(one).collect(),
        x => one(x).map(|x| vec![x]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_id_lists() {
        let ids = |s: &str| token_ids(&serde_json::from_str(s).unwrap());
        assert_eq!(ids("7"), Some(vec![7]));
        assert_eq!(
            ids("[128001, 128008, 128009]"),
            Some(vec![128001, 128008, 128009])
        );
        assert_eq!(ids("[1, \"x\"]"), None);
        assert_eq!(ids("-1"), None);
    }
}
