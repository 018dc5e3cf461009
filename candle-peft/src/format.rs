//! PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`, tensors named as
//! PEFT writes them (`base_model.model.<module path>.lora_A.weight`, the adapter name
//! stripped; a module to save under its plain path, `base_model.model.lm_head.weight`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::error::{PeftError, Result};
use crate::LoraConfig;

/// The adapter's configuration file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's weights.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// PEFT's legacy pickle weights (refused with advice).
pub const ADAPTER_BIN_FILE: &str = "adapter_model.bin";
/// What PEFT puts before every module path (`PeftModel.base_model.model`).
pub const PREFIX: &str = "base_model.model.";

/// The on-disk name of the `lora_A` weight of the module at `path`.
pub fn lora_a_name(path: &str) -> String {
    format!("{PREFIX}{path}.lora_A.weight")
}

/// The on-disk name of the `lora_B` weight of the module at `path`.
pub fn lora_b_name(path: &str) -> String {
    format!("{PREFIX}{path}.lora_B.weight")
}

/// The on-disk name of the parameter `name` of a module to save (`lm_head.weight`).
pub fn saved_name(name: &str) -> String {
    format!("{PREFIX}{name}")
}

/// What an on-disk tensor name is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// `lora_A` of the module at this path.
    A(String),
    /// `lora_B` of the module at this path.
    B(String),
    /// A parameter of a module to save, by its plain name (`lm_head.weight`).
    Saved(String),
}

/// Reads an on-disk name (`None`: not under [`PREFIX`]).
pub fn tensor_role(name: &str) -> Option<TensorRole> {
    let rest = name.strip_prefix(PREFIX)?;
    if let Some(path) = rest.strip_suffix(".lora_A.weight") {
        return Some(TensorRole::A(path.to_string()));
    }
    if let Some(path) = rest.strip_suffix(".lora_B.weight") {
        return Some(TensorRole::B(path.to_string()));
    }
    Some(TensorRole::Saved(rest.to_string()))
}

/// An adapter read from a PEFT directory: its config and its tensors by on-disk name.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// The directory it was read from.
    pub dir: PathBuf,
    /// Its configuration.
    pub config: LoraConfig,
    /// `lora_A`/`lora_B` of each adapted module: path -> (A `[r, in]`, B `[out, r]`), in the
    /// stored dtype.
    pub loras: BTreeMap<String, (Tensor, Tensor)>,
    /// Parameters of the modules to save, by plain name (`lm_head.weight`).
    pub saved: BTreeMap<String, Tensor>,
    /// The weights file's `__metadata__` besides PEFT's `format` (what a writer recorded with
    /// [`save`]'s `metadata`, e.g. the base model the adapter was made on).
    pub metadata: BTreeMap<String, String>,
}

impl Adapter {
    /// Reads `dir/adapter_config.json` and `dir/adapter_model.safetensors` onto `device`.
    ///
    /// Refused, naming the file: a missing file (a legacy `adapter_model.bin` with advice), a
    /// config with an unsupported option ([`LoraConfig::from_peft_json`]), a tensor outside
    /// PEFT's names, an `A` without its `B`, a rank other than `r`, a saved tensor of a
    /// module not in `modules_to_save`.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let config = LoraConfig::load(&dir.join(ADAPTER_CONFIG_FILE))?;
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        if !path.is_file() {
            let msg = match dir.join(ADAPTER_BIN_FILE).is_file() {
                true => "missing; this adapter has only the legacy pickle adapter_model.bin: \
                         save it again with PEFT's safe_serialization=True"
                    .to_string(),
                false => "missing".to_string(),
            };
            return Err(PeftError::file(path, msg));
        }
        let unreadable =
            |e: String| PeftError::file(&path, format!("not a readable safetensors file: {e}"));
        let bytes = std::fs::read(&path).map_err(|e| unreadable(e.to_string()))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| unreadable(e.to_string()))?;
        let metadata: BTreeMap<String, String> = header
            .metadata()
            .iter()
            .flatten()
            .filter(|(k, _)| k.as_str() != "format")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let tensors = candle_core::safetensors::load_buffer(&bytes, device)
            .map_err(|e| unreadable(e.to_string()))?;
        drop(bytes);
        let mut a = BTreeMap::new();
        let mut b = BTreeMap::new();
        let mut saved = BTreeMap::new();
        for (name, t) in tensors {
            match tensor_role(&name) {
                Some(TensorRole::A(p)) => {
                    a.insert(p, t);
                }
                Some(TensorRole::B(p)) => {
                    b.insert(p, t);
                }
                Some(TensorRole::Saved(p)) if config.saves(module_of(&p)) => {
                    saved.insert(p, t);
                }
                _ => {
                    return Err(PeftError::file(
                        &path,
                        format!(
                            "tensor `{name}` is neither `{PREFIX}<module>.lora_A.weight` / \
                             `.lora_B.weight` nor a parameter of modules_to_save {:?}",
                            config.modules_to_save
                        ),
                    ))
                }
            }
        }
        let mut loras = BTreeMap::new();
        for (p, ta) in a {
            let tb = b.remove(&p).ok_or_else(|| {
                PeftError::file(
                    &path,
                    format!("`{}` has no `{}`", lora_a_name(&p), lora_b_name(&p)),
                )
            })?;
            let two_d = |t: &Tensor, name: String| {
                t.dims2().map_err(|_| {
                    PeftError::file(
                        &path,
                        format!("`{name}` is {:?}; LoRA matrices are 2-D", t.dims()),
                    )
                })
            };
            let (ra, _) = two_d(&ta, lora_a_name(&p))?;
            let (_, rb) = two_d(&tb, lora_b_name(&p))?;
            if ra != config.r || rb != config.r {
                return Err(PeftError::file(
                    &path,
                    format!(
                        "module `{p}`: lora_A {:?} and lora_B {:?} do not have rank r = {} \
                         (adapter_config.json)",
                        ta.dims(),
                        tb.dims(),
                        config.r
                    ),
                ));
            }
            loras.insert(p, (ta, tb));
        }
        if let Some(p) = b.keys().next() {
            return Err(PeftError::file(
                &path,
                format!("`{}` has no `{}`", lora_b_name(p), lora_a_name(p)),
            ));
        }
        Ok(Adapter {
            dir: dir.to_path_buf(),
            config,
            loras,
            saved,
            metadata,
        })
    }
}

/// The module path of a parameter name (`lm_head.weight` -> `lm_head`).
pub fn module_of(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(m, _)| m)
}

/// Writes a PEFT adapter directory: `adapter_config.json` from `config` and
/// `adapter_model.safetensors` (with PEFT's `{"format": "pt"}` metadata and `metadata`'s
/// entries, which PEFT ignores) from `tensors`, by on-disk name. Each file is written to a temporary name and renamed, so a failed write never
/// leaves a half-written file under the real name.
pub fn save(
    dir: &Path,
    config: &LoraConfig,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| PeftError::file(dir, format!("cannot create: {e}")))?;
    let json = serde_json::to_string_pretty(&config.to_peft_json())
        .map_err(|e| PeftError::file(dir.join(ADAPTER_CONFIG_FILE), e.to_string()))?;
    write_atomic(&dir.join(ADAPTER_CONFIG_FILE), |p| {
        std::fs::write(p, json.as_bytes()).map_err(|e| e.to_string())
    })?;
    let views: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.contiguous()?)))
        .collect::<candle_core::Result<_>>()?;
    let mut meta: HashMap<String, String> = metadata.clone().into_iter().collect();
    meta.insert("format".to_string(), "pt".to_string());
    // Serialised in memory (adapters are small) and written by `std::fs::write`, so the file
    // gets the usual mode (`0666` less the umask): `serialize_to_file` writes through a
    // `tempfile` file, mode 0600.
    let bytes = safetensors::serialize(views.iter().map(|(n, t)| (n.as_str(), t)), Some(meta))
        .map_err(|e| PeftError::file(dir.join(ADAPTER_WEIGHTS_FILE), e.to_string()))?;
    write_atomic(&dir.join(ADAPTER_WEIGHTS_FILE), |p| {
        std::fs::write(p, &bytes).map_err(|e| e.to_string())
    })
}

fn write_atomic(
    path: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), String>,
) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let done = write(&tmp).and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(PeftError::file(path, format!("cannot write: {e}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let p = "model.layers.0.self_attn.q_proj";
        assert_eq!(
            lora_a_name(p),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(tensor_role(&lora_a_name(p)), Some(TensorRole::A(p.into())));
        assert_eq!(tensor_role(&lora_b_name(p)), Some(TensorRole::B(p.into())));
        assert_eq!(
            tensor_role(&saved_name("lm_head.weight")),
            Some(TensorRole::Saved("lm_head.weight".into()))
        );
        assert_eq!(tensor_role("model.lm_head.weight"), None);
        assert_eq!(module_of("lm_head.weight"), "lm_head");
    }
}
