//! Models that come from outside the current run: a Hugging Face model directory, a model id
//! in the local hub cache, or a trainer checkpoint or run directory.
//!
//! One resolver ([`resolve`]) serves `--init-from`, `trainer sample` and `trainer eval`, so all
//! three accept the same things:
//!
//! - a directory with `config.json` + `model.safetensors` (a Hugging Face model directory, or a
//!   trainer checkpoint directory),
//! - a trainer run directory (its latest checkpoint, see [`checkpoint::resolve`]),
//! - a model id such as `openai-community/gpt2`, found in the local hub cache ([`crate::hub`];
//!   nothing is downloaded).
//!
//! A bare model has no run config to say how text becomes tokens: its directory's
//! `tokenizer.json` ([`TokenizerFile`]) does. [`EvalRequest`] evaluates any of them on data
//! given by flags or by the run's config.

mod eval;
mod tokenizer;

use std::path::{Path, PathBuf};

use candle_core::Device;

pub use eval::{evaluate, mean_loss, task_score, EvalRequest};
pub use tokenizer::{
    word_level, SpecialTokens, TokenizerFile, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};

use crate::checkpoint::{self, TrainerState, CONFIG_FILE, MODEL_FILE, STATE_FILE};
use crate::config::TrainConfig;
use crate::model::{Model, ModelConfig, Params};
use crate::{hub, Error, Result};

/// The model directory `spec` names, looking hub ids up in the default cache (`HF_HOME`).
pub fn resolve(spec: &str) -> Result<PathBuf> {
    resolve_in(spec, &hub::default_cache())
}

/// The model directory `spec` names: a directory holding `config.json` and
/// `model.safetensors`, the latest checkpoint of a run directory, or the snapshot of a model id
/// in `cache`.
///
/// ```
/// let cache = hf_hub::Cache::new(std::env::temp_dir().join("no-such-hf-cache"));
/// let err = trainer::pretrained::resolve_in("no-org/no-model", &cache).unwrap_err();
/// assert!(err.to_string().contains("no-org/no-model"));
/// ```
pub fn resolve_in(spec: &str, cache: &hf_hub::Cache) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        if path.join(CONFIG_FILE).is_file() && path.join(MODEL_FILE).is_file() {
            return Ok(path.to_path_buf());
        }
        return checkpoint::resolve(path).map_err(|e| {
            Error::checkpoint(
                path,
                format!(
                    "not a model directory (config.json + model.safetensors), nor a trainer \
                     checkpoint or run directory ({e})"
                ),
            )
        });
    }
    if path.exists() {
        return Err(Error::checkpoint(
            path,
            "is a file; expected a model directory (config.json + model.safetensors), a trainer \
             checkpoint or run directory, or a Hugging Face model id",
        ));
    }
    if !looks_like_hub_id(spec) {
        return Err(Error::checkpoint(path, "no such directory"));
    }
    hub::snapshot_dir(cache, spec).map_err(|e| {
        Error::checkpoint(
            path,
            format!("no such directory, and not found as a Hugging Face model id: {e}"),
        )
    })
}

/// `name` or `org/name`: what a hub model id can be (a path like `./x`, `/x` or `a/b/c` cannot).
fn looks_like_hub_id(spec: &str) -> bool {
    let parts: Vec<&str> = spec.split('/').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// A resolved model directory and, for a trainer checkpoint, the run it belongs to.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The directory holding `config.json` and `model.safetensors`.
    pub dir: PathBuf,
    /// The trainer state of a trainer checkpoint (`None` for a bare Hugging Face model).
    pub run: Option<TrainerState>,
}

impl ModelDir {
    /// Resolves `spec` (see [`resolve`]) and reads the checkpoint's trainer state, if any.
    pub fn open(spec: &str) -> Result<Self> {
        Self::at(resolve(spec)?)
    }

    /// The model in directory `dir` (already resolved).
    pub fn at(dir: PathBuf) -> Result<Self> {
        let state = dir.join(STATE_FILE);
        let run = if state.is_file() {
            Some(checkpoint::io::read_json(&state)?)
        } else {
            None
        };
        Ok(ModelDir { dir, run })
    }

    /// The run config of a trainer checkpoint.
    pub fn run_config(&self) -> Option<&TrainConfig> {
        self.run.as_ref().map(|s| &s.config)
    }

    /// The model's config and weights on `device`.
    pub fn load(&self, device: &Device) -> Result<(Box<dyn ModelConfig>, Params)> {
        let config = crate::model::config_from_hf_json_file(&self.dir.join(CONFIG_FILE))?;
        if device.is_cpu() {
            // The f32 weights, refused before they are read (activations come on top).
            let what = format!(
                "the model in {} ({})",
                self.dir.display(),
                config.describe()
            );
            let need = 4 * config.num_params() as u64;
            crate::runtime::check_fits(need, &what, "use a machine with more memory")?;
        }
        let source = match self.run {
            Some(_) => checkpoint::Source::Checkpoint,
            None => checkpoint::Source::Pretrained,
        };
        let params =
            checkpoint::load_params(&self.dir.join(MODEL_FILE), config.as_ref(), device, source)?;
        if let Some(run) = &self.run {
            // A trainer checkpoint is one unit (see `checkpoint::manifest`).
            checkpoint::manifest::verify(&self.dir, run.step)?;
        }
        Ok((config, params))
    }

    /// The model on `device`, ready for inference.
    pub fn load_model(&self, device: &Device) -> Result<Box<dyn Model>> {
        let (config, params) = self.load(device)?;
        crate::model::build(config.as_ref(), &params)
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

/// The special tokens of the vocabulary `config` trains on: those of its `tokenizer.json` for
/// `tokenizer` data (each falling back to `fallback`, the pretrained model's), none for the
/// character, byte and addition vocabularies.
pub fn data_special_tokens(config: &TrainConfig, fallback: SpecialTokens) -> Result<SpecialTokens> {
    match (&config.tokenizer_path, config.data) {
        (Some(path), crate::data::DataKind::Tokenizer) => {
            let own = TokenizerFile::open(path)?.special_tokens();
            Ok(SpecialTokens {
                bos: own.bos.or(fallback.bos),
                eos: own.eos.or(fallback.eos),
            })
        }
        _ => Ok(SpecialTokens::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_and_paths() {
        for id in ["gpt2", "openai-community/gpt2", "org/name-v1.5_x"] {
            assert!(looks_like_hub_id(id), "{id}");
        }
        for p in ["./run", "/abs/run", "runs/a/b", "../x", "", "a//b", "a b"] {
            assert!(!looks_like_hub_id(p), "{p}");
        }
    }

    #[test]
    fn missing_things_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = hf_hub::Cache::new(tmp.path().join("hub"));
        let e = resolve_in("./nowhere", &cache).unwrap_err().to_string();
        assert!(
            e.contains("nowhere") && e.contains("no such directory"),
            "{e}"
        );
        let e = resolve_in("org/none", &cache).unwrap_err().to_string();
        assert!(e.contains("org/none") && e.contains("Hugging Face"), "{e}");
        let file = tmp.path().join("model.safetensors");
        std::fs::write(&file, b"x").unwrap();
        let spec = file.display().to_string();
        let e = resolve_in(&spec, &cache).unwrap_err().to_string();
        assert!(e.contains("is a file"), "{e}");
        let empty = tmp.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let e = resolve_in(&empty.display().to_string(), &cache).unwrap_err();
        assert!(e.to_string().contains("not a model directory"), "{e}");
    }
}
