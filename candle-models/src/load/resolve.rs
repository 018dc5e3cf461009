//! What a model name given to a command means: a model directory, a trainer checkpoint or run
//! directory, or a model id in the local hub cache; and the base model an adapter names.

use std::fs;
use std::path::{Path, PathBuf};

use candle_peft::format::{self, ADAPTER_CONFIG_FILE};

use super::layout::{checkpoints_dir, CONFIG_FILE, INDEX_FILE, STATE_FILE};
use super::WeightFiles;
use crate::{hub, Error, Result};

/// The model directory `spec` names, looking hub ids up in the default cache
/// ([`hub::cache_dir`]).
pub fn resolve(spec: &str) -> Result<PathBuf> {
    resolve_in(spec, &hub::default_cache())
}

/// The model directory `spec` names: a directory holding `config.json` and weights, the
/// latest checkpoint of a run directory, or the snapshot of a model id in `cache`.
///
/// ```
/// let cache = hf_hub::Cache::new(std::env::temp_dir().join("no-such-hf-cache"));
/// let err = candle_models::load::resolve_in("no-org/no-model", &cache).unwrap_err();
/// assert!(err.to_string().contains("no-org/no-model"));
/// ```
pub fn resolve_in(spec: &str, cache: &hf_hub::Cache) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        let adapter = path.join(ADAPTER_CONFIG_FILE).is_file();
        if adapter || path.join(CONFIG_FILE).is_file() && WeightFiles::present_in(path) {
            return Ok(path.to_path_buf());
        }
        return resolve_checkpoint(path).map_err(|e| {
            Error::checkpoint(
                path,
                format!(
                    "not a model directory (config.json + model.safetensors or {INDEX_FILE}), \
                     nor a trainer checkpoint or run directory ({e})"
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

/// The directory of the base model that the adapter in `adapter_dir` names by
/// `base_model_name_or_path` = `spec`, found as PEFT finds it: `AutoPeftModelForCausalLM`
/// hands the value unchanged to transformers' `from_pretrained`, which takes it as a directory
/// when there is one at that path (an absolute path, or one relative to the process's working
/// directory, not to the adapter's), else as a hub model id (here: in the local cache). Adapters
/// whose relative base only exists beside them (PEFT would not find it) are read over it too,
/// with a warning. Otherwise the error names the key, the working directory and `--init-from`.
pub fn resolve_adapter_base(adapter_dir: &Path, spec: &str) -> Result<PathBuf> {
    let config = adapter_dir.join(format::ADAPTER_CONFIG_FILE);
    let as_given = Path::new(spec);
    if as_given.is_dir() {
        return resolve(spec);
    }
    let hub_error = match looks_like_hub_id(spec) {
        true => match resolve(spec) {
            Ok(dir) => return Ok(dir),
            Err(e) => format!(" ({e})"),
        },
        false => String::new(),
    };
    let beside = adapter_dir.join(spec);
    if !as_given.is_absolute() && beside.is_dir() {
        tracing::warn!(
            "{}: base_model_name_or_path `{spec}` is read relative to the adapter's directory \
             ({}); PEFT and transformers read it relative to the working directory",
            config.display(),
            beside.display()
        );
        return resolve(&beside.display().to_string());
    }
    let cwd = std::env::current_dir()
        .map(|d| d.display().to_string())
        .unwrap_or_else(|_| "?".into());
    Err(Error::checkpoint(
        &config,
        format!(
            "base_model_name_or_path `{spec}` names no base model: no such directory relative to \
             the working directory {cwd} (where PEFT, through transformers' from_pretrained, \
             looks) nor to the adapter's directory, and no such model id in the local Hugging \
             Face cache {}{hub_error}: give the base model with --init-from MODEL",
            crate::hub::cache_dir().display()
        ),
    ))
}

/// Finds the checkpoint directory meant by `path`: a checkpoint directory itself (it has a
/// `trainer_state.json`, a `model.safetensors` or a `model.safetensors.index.json`), or a run
/// directory (its latest checkpoint).
pub fn resolve_checkpoint(path: &Path) -> Result<PathBuf> {
    if !path.exists() {
        return Err(Error::checkpoint(path, "no such file or directory"));
    }
    if path.join(STATE_FILE).is_file() || WeightFiles::present_in(path) {
        return Ok(path.to_path_buf());
    }
    let ckpts = checkpoints_dir(path);
    let latest = ckpts.join("latest");
    if latest.is_dir() {
        // `latest` as a symlink to the checkpoint directory (a common convention).
        if latest.join(STATE_FILE).is_file() {
            return fs::canonicalize(&latest).map_err(|e| Error::io(&latest, e));
        }
        return Err(Error::checkpoint(
            &latest,
            "links to a directory that is not a complete checkpoint (no trainer_state.json)",
        ));
    }
    if latest.is_symlink() && !latest.exists() {
        let target = fs::read_link(&latest).map_err(|e| Error::io(&latest, e))?;
        return Err(Error::checkpoint(
            &latest,
            format!("is a dangling symlink (to {})", target.display()),
        ));
    }
    if latest.is_file() {
        let name = fs::read_to_string(&latest).map_err(|e| Error::io(&latest, e))?;
        let dir = ckpts.join(name.trim());
        if dir.join(STATE_FILE).is_file() {
            return Ok(dir);
        }
        return Err(Error::checkpoint(
            &latest,
            format!(
                "points to `{}`, which is not a complete checkpoint",
                name.trim()
            ),
        ));
    }
    Err(Error::checkpoint(
        path,
        "neither a checkpoint directory (no trainer_state.json / model.safetensors) nor a run \
         directory with checkpoints/latest",
    ))
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
    fn a_missing_adapter_base_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = resolve_adapter_base(dir.path(), "../no-such-base").unwrap_err();
        assert!(
            e.to_string()
                .contains("base_model_name_or_path `../no-such-base`"),
            "{e}"
        );
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
