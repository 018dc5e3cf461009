//! Checkpoints that resume bit-exactly, written atomically.
//!
//! A run directory looks like this:
//!
//! ```text
//! runs/addition/
//!   run.toml                      the run's config
//!   metrics.jsonl                 one JSON object per step and per evaluation
//!   loss.svg                      train/val loss curve, refreshed at each evaluation
//!   checkpoints/
//!     latest                      name of the newest complete checkpoint
//!     step-0001000/
//!       model.safetensors         weights under Hugging Face GPT-2 names
//!       config.json               Hugging Face GPT-2 config
//!       optimizer.safetensors     optimiser state by name (AdamW: moments); step count in the metadata
//!       trainer_state.json        step, RNG state, best val loss, run config
//! ```
//!
//! A checkpoint is first written to a hidden temporary directory (every file fsynced), which is
//! then renamed into place; `latest` is replaced atomically afterwards. A killed run therefore
//! leaves the previous checkpoint intact, and a half-written one is never picked up.

pub use crate::io;
mod state;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

pub use crate::load::manifest;
pub use crate::load::resolve_checkpoint as resolve;
pub use crate::load::{
    checkpoints_dir, Source, CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE,
};
pub use state::{RngState, SavedFiles, TrainerState};

use crate::lora::Tuning;
use crate::model::{ModelConfig, Params};
use crate::optim::{Optimizer, OptimizerState};
use crate::{Error, Result};

/// What a checkpoint's weights are.
#[derive(Clone, Copy, Debug)]
pub enum ModelFiles<'a> {
    /// The whole model: `config.json` + `model.safetensors`.
    Full(&'a dyn ModelConfig),
    /// LoRA adapters (and modules to save) over a frozen base recorded in the state:
    /// PEFT's `adapter_config.json` + `adapter_model.safetensors`, which records the base too
    /// ([`crate::lora::BASE_METADATA_KEY`]).
    Lora(&'a candle_peft::LoraConfig, &'a crate::lora::BaseIdentity),
}

impl<'a> ModelFiles<'a> {
    /// What a checkpoint of a run tuned as `tuning` writes for the model `config` (the
    /// adapter config records the base as PEFT does, `base_model_name_or_path`).
    pub fn of(tuning: &'a Tuning, config: &'a dyn ModelConfig) -> Self {
        match tuning {
            Tuning::Full => ModelFiles::Full(config),
            Tuning::Lora { config, base, .. } => ModelFiles::Lora(config, base),
        }
    }

    /// The weights file.
    pub fn weights_file(&self) -> &'static str {
        match self {
            ModelFiles::Full(_) => MODEL_FILE,
            ModelFiles::Lora(..) => candle_peft::format::ADAPTER_WEIGHTS_FILE,
        }
    }

    /// Writes the weights `params` (and their config) into `dir`.
    pub fn write(&self, dir: &Path, params: &Params) -> Result<()> {
        match self {
            ModelFiles::Full(config) => save_model(dir, *config, params),
            ModelFiles::Lora(config, base) => {
                let tensors: Vec<(String, Tensor)> = params
                    .iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                    .collect();
                candle_peft::format::save(dir, config, &tensors, &base.to_metadata())
                    .map_err(|e| Error::checkpoint(dir, e.to_string()))
            }
        }
    }
}

/// Writes one file of a checkpoint, given the path to write.
pub type WriteFile<'a> = dyn Fn(&Path) -> Result<()> + 'a;

/// Saves a complete checkpoint for `state.step` under `run_dir/checkpoints/`, atomically,
/// points `latest` at it and returns its directory. `extra` writes more files into the
/// checkpoint before it is renamed into place: each by its name, given the path to write.
///
/// Every file is written through `named`: a failed write (a full disk, say) is an error
/// naming the file, whoever wrote it.
pub fn save(
    run_dir: &Path,
    files: ModelFiles,
    params: &Params,
    optimizer: &OptimizerState,
    state: &TrainerState,
    extra: &[(&str, &WriteFile)],
) -> Result<PathBuf> {
    let ckpts = checkpoints_dir(run_dir);
    let name = format!("step-{:07}", state.step);
    // A diverged run must not replace the last good checkpoint with garbage.
    let (opt_tensors, opt_step) = (&optimizer.tensors, optimizer.step_count);
    let target = ckpts.join(&name);
    let refuse = |e: candle_models::Error| {
        Error::checkpoint(
            &target,
            format!("not saved, the previous checkpoint stays `latest`: {e}"),
        )
    };
    crate::load::check_tensors(
        &target.join(files.weights_file()),
        "weight",
        params.iter().map(|(n, v)| (n.as_str(), v.as_tensor())),
    )
    .map_err(refuse)?;
    crate::load::check_tensors(
        &target.join(OPTIMIZER_FILE),
        "optimiser",
        opt_tensors.iter().map(|(n, t)| (n.as_str(), t)),
    )
    .map_err(refuse)?;
    io::create_dir_all(&ckpts)?;
    let final_dir = ckpts.join(&name);
    let tmp = ckpts.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = (|| -> Result<()> {
        let file = |name: &str| target.join(name);
        let weights = files.weights_file();
        named(&file(weights), files.write(&tmp, params))?;
        // One metadata entry only: safetensors writes them in HashMap order.
        let meta = HashMap::from([("step".to_string(), opt_step.to_string())]);
        named(
            &file(OPTIMIZER_FILE),
            io::save_safetensors(&tmp.join(OPTIMIZER_FILE), opt_tensors, Some(meta))
                .map_err(Error::from),
        )?;
        let state = TrainerState {
            files: Some(SavedFiles {
                optimizer_step: opt_step,
                weights_digest: manifest::digest(&tmp.join(weights))?,
            }),
            ..state.clone()
        };
        named(
            &file(STATE_FILE),
            io::write_json(&tmp.join(STATE_FILE), &state).map_err(Error::from),
        )?;
        for (name, write) in extra {
            named(&file(name), write(&tmp.join(name)))?;
        }
        named(
            &file(manifest::MANIFEST_FILE),
            manifest::write(&tmp, state.step).map_err(Error::from),
        )?;
        io::sync_dir(&tmp).map_err(|e| Error::io(&tmp, e))
    })();
    if let Err(e) = written {
        // A failed write (a full disk, say) leaves nothing behind: the error names the file
        // being written.
        let _ = fs::remove_dir_all(&tmp);
        return Err(refuse(e.into()));
    }
    if final_dir.exists() {
        // Re-saving the same step (e.g. after a resume): move the old one aside first, so
        // that a complete checkpoint exists at every moment.
        let old = ckpts.join(format!(".old-{name}-{}", std::process::id()));
        fs::rename(&final_dir, &old).map_err(|e| Error::io(&final_dir, e))?;
        fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
    }
    io::sync_dir(&ckpts).map_err(|e| Error::io(&ckpts, e))?;
    io::write_atomic(&ckpts.join("latest"), name.as_bytes())?;
    Ok(final_dir)
}

/// `written`, its error naming the file at `path` (the checkpoint's file, not its temporary
/// copy) unless it already names that file.
fn named(path: &Path, written: Result<()>) -> Result<()> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    written.map_err(|e| match e.to_string().contains(name.as_ref()) {
        true => e,
        false => Error::checkpoint(path, format!("cannot write: {e}")),
    })
}

/// Writes `model.safetensors` (HF names, f32) and `config.json` into `dir`.
pub fn save_model(dir: &Path, config: &dyn ModelConfig, params: &Params) -> Result<()> {
    let tensors: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    io::save_safetensors(&dir.join(MODEL_FILE), &tensors, Some(meta))?;
    let json = serde_json::to_string_pretty(&config.to_hf_json())
        .map_err(|e| Error::checkpoint(dir, e.to_string()))?;
    Ok(io::write_atomic(&dir.join(CONFIG_FILE), json.as_bytes())?)
}

/// Loads a model directory (`config.json` and `model.safetensors` or the shards of
/// `model.safetensors.index.json`, as written by this crate or by Hugging Face `transformers`)
/// onto `device`, for any known architecture ([`crate::model::config_from_hf_json_file`]), as
/// a pretrained model ([`Source::Pretrained`]). Commands load through [`crate::load`], which
/// also checks a trainer checkpoint against its run and its manifest.
///
/// What the architecture says of each tensor holds ([`ModelConfig::checkpoint_tensor`]:
/// GPT-2's causal-mask buffers are skipped, a separate `lm_head.weight` must equal the tied
/// embedding), and f16/bf16 weights are widened to f32. Missing, extra or mis-shaped tensors
/// are an error naming the file.
pub fn load_model(dir: &Path, device: &Device) -> Result<(Box<dyn ModelConfig>, Params)> {
    let config = crate::model::config_from_hf_json_file(&dir.join(CONFIG_FILE))?;
    let params =
        crate::load::WeightFiles::locate(dir)?.read(config.as_ref(), device, Source::Pretrained)?;
    Ok((config, params))
}

/// Checks that the weights and optimiser files of checkpoint `dir` are the ones saved with
/// its trainer `state` (what [`SavedFiles`] records): a file of another checkpoint, copied in
/// under a manifest made to match, is refused naming both files and the steps. A checkpoint
/// written before the record still has the optimiser's update count checked: never above
/// the trainer's step.
pub(crate) fn check_files_match(
    dir: &Path,
    state: &TrainerState,
    weights_file: &str,
) -> Result<()> {
    let state_file = dir.join(STATE_FILE);
    let opt_path = dir.join(OPTIMIZER_FILE);
    let meta = io::read_safetensors_metadata(&opt_path)?;
    let updates = meta
        .get("step")
        .and_then(|s| s.parse::<usize>().ok())
        .ok_or_else(|| Error::checkpoint(&opt_path, "metadata has no valid `step`"))?;
    let (want, what) = match &state.files {
        Some(f) => (f.optimizer_step, "records"),
        None => (state.step.min(updates), "allows at most"),
    };
    if updates != want {
        return Err(Error::checkpoint(
            &opt_path,
            format!(
                "holds the optimiser state after {updates} updates, but {} (step {}) {what} \
                 {want}: the files come from different checkpoints; nothing was resumed",
                state_file.display(),
                state.step
            ),
        ));
    }
    if let Some(f) = &state.files {
        let path = dir.join(weights_file);
        if manifest::digest(&path)? != f.weights_digest {
            return Err(Error::checkpoint(
                &path,
                format!(
                    "is not the file saved with {} (step {}): the files come from different \
                     checkpoints; nothing was resumed",
                    state_file.display(),
                    state.step
                ),
            ));
        }
    }
    Ok(())
}

/// Loads the optimiser state of checkpoint `dir` into `optimizer`.
pub(crate) fn load_optimizer(
    dir: &Path,
    optimizer: &mut dyn Optimizer,
    device: &Device,
) -> Result<()> {
    let path = dir.join(OPTIMIZER_FILE);
    let loaded = io::load_safetensors(&path, device)?;
    crate::load::check_tensors(
        &path,
        "optimiser",
        loaded.tensors.iter().map(|(n, t)| (n.as_str(), t)),
    )?;
    let step = loaded
        .metadata
        .get("step")
        .and_then(|s| s.parse::<usize>().ok())
        .ok_or_else(|| Error::checkpoint(&path, "metadata has no valid `step`"))?;
    optimizer.load_state(&loaded.tensors, step).map_err(|e| {
        let msg = match e {
            Error::Data(candle_data::Error::Checkpoint { msg, .. }) => msg,
            e => e.to_string(),
        };
        Error::checkpoint(&path, format!("{} state: {msg}", optimizer.name()))
    })
}

/// Deletes old checkpoints, keeping the newest `keep_last` and those named in `keep` (the best
/// one and the one just written, which after resuming from an older checkpoint may not be the
/// newest by name).
pub(crate) fn prune(run_dir: &Path, keep_last: usize, keep: &[&str]) -> Result<()> {
    let ckpts = checkpoints_dir(run_dir);
    let mut names: Vec<String> = fs::read_dir(&ckpts)
        .map_err(|e| Error::io(&ckpts, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    let n = names.len();
    for (i, name) in names.iter().enumerate() {
        let newest = i + keep_last.max(1) >= n;
        if newest || keep.contains(&name.as_str()) {
            continue;
        }
        let dir = ckpts.join(name);
        fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    }
    Ok(())
}
