//! The base model adapters belong to: its identity ([`BaseIdentity`], by content), as a run
//! records it ([`RecordedBase`]) and as adapter files carry it ([`BASE_METADATA_KEY`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use candle_peft::format;
use candle_peft::Adapter;
use serde::{Deserialize, Serialize};

use super::Nf4Layers;
use crate::model::{ModelConfig, Params};
use crate::{Error, Result};

/// The key of an adapter file's `__metadata__` that records the base it was made on (the
/// [`BaseIdentity`] as JSON). PEFT and `safetensors` ignore metadata they do not know.
pub const BASE_METADATA_KEY: &str = "trainer.base_model";

/// `config.json` keys that do not change what the model computes: the dtype the weights were
/// stored in (their values are compared as f32), how they were initialised, the writer.
const NOT_ARCHITECTURE: [&str; 5] = [
    "torch_dtype",
    "dtype",
    "initializer_range",
    "transformers_version",
    "use_cache",
];

/// What identifies a base model, whatever its files look like: its architecture as parsed from
/// `config.json` (without the run settings, dropout and special tokens, nor the keys that do
/// not change what it computes, e.g. `torch_dtype`) and its tensors'
/// values by name (as f32). A reformatted `config.json`, resharded weights or weights stored
/// in another dtype with the same values are the same base. Recorded in a LoRA run's state
/// and in the adapters it writes, so that using adapters over another base is refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseIdentity {
    /// The base as the run named it (`init_from`), for messages.
    pub model: String,
    /// Digest of the parsed architecture ([`ModelConfig::to_hf_json`]).
    pub architecture: String,
    /// Digest of the tensors: each name, shape and f32 value, in name order.
    pub tensors: String,
    /// How a base saved in 4 bits is quantized ([`Nf4Layers::describe`]); its tensors are then
    /// the saved ones (codes, absmaxes, ..). `None` for a full-precision base (quantized on
    /// load or not: the run's `--base-quant` settings are fixed by the run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
}

impl BaseIdentity {
    /// The identity of the model `config` with parameters `params`, named `model`.
    pub fn of(model: &str, config: &dyn ModelConfig, params: &Params) -> Result<Self> {
        let tensors = params
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().clone())));
        Self::of_tensors(model, config, tensors, None)
    }

    /// The identity of a base saved in 4 bits: `params` (its full-precision tensors) and its
    /// 4-bit `layers` as saved, with how they are quantized.
    pub fn of_4bit(
        model: &str,
        config: &dyn ModelConfig,
        params: &Params,
        layers: &Nf4Layers,
    ) -> Result<Self> {
        let saved = layers.saved_tensors()?;
        let tensors = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .chain(saved)
            .map(Ok);
        Self::of_tensors(model, config, tensors, Some(layers.describe()))
    }

    /// The identity of the model `config` whose tensors `tensors` yields in name order (read
    /// one at a time: a base streamed from its files is never whole in memory).
    pub(crate) fn of_tensors(
        model: &str,
        config: &dyn ModelConfig,
        tensors: impl Iterator<Item = Result<(String, Tensor)>>,
        quantization: Option<String>,
    ) -> Result<Self> {
        let plain = config.with_run_settings(0.0, crate::model::SpecialTokens::default());
        let mut json = plain.to_hf_json();
        if let Some(m) = json.as_object_mut() {
            for k in NOT_ARCHITECTURE {
                m.remove(k);
            }
        }
        let json = serde_json::to_string(&json)
            .map_err(|e| Error::Config(format!("{model}: config: {e}")))?;
        let mut h = candle_data::hash::Hasher64::new();
        h.update(json.as_bytes());
        let architecture = format!("{:016x}", h.finish());
        let mut h = candle_data::hash::Hasher64::new();
        for named in tensors {
            let (name, v) = named?;
            h.update(&(name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            let dims: Vec<u8> = v
                .dims()
                .iter()
                .flat_map(|d| (*d as u64).to_le_bytes())
                .collect();
            h.update(&dims);
            let values = v.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            for chunk in values.chunks(1 << 20) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
                h.update(&bytes);
            }
        }
        Ok(BaseIdentity {
            model: model.to_string(),
            architecture,
            tensors: format!("{:016x}", h.finish()),
            quantization,
        })
    }

    /// What differs between this identity and `other` ("architecture", "tensors"), empty
    /// when they are the same base.
    fn differences(&self, other: &BaseIdentity) -> Vec<&'static str> {
        let mut diff = Vec::new();
        if self.architecture != other.architecture {
            diff.push("architecture");
        }
        if self.tensors != other.tensors {
            diff.push("tensor values");
        }
        if self.quantization != other.quantization {
            diff.push("quantization");
        }
        diff
    }

    /// `architecture/tensors`, for messages.
    fn digests(&self) -> String {
        let quantization = match &self.quantization {
            Some(q) => format!(", {q}"),
            None => String::new(),
        };
        format!(
            "architecture {}, tensors {}{quantization}",
            self.architecture, self.tensors
        )
    }

    /// Errors unless `now` (the base found now) is this one (the base `adapters` were made
    /// on), naming both and what differs; `advice` ends the message.
    pub fn check(&self, now: &BaseIdentity, adapters: &Path, advice: &str) -> Result<()> {
        let diff = self.differences(now);
        if diff.is_empty() {
            return Ok(());
        }
        Err(Error::checkpoint(
            adapters,
            format!(
                "these adapters were made on the base `{}` ({}), but the base given is `{}` \
                 ({}): they differ in {}, and adapters only make sense on the weights they were \
                 trained on{advice}",
                self.model,
                self.digests(),
                now.model,
                now.digests(),
                diff.join(" and ")
            ),
        ))
    }

    /// The identity as an adapter file's metadata entry ([`BASE_METADATA_KEY`]).
    pub fn to_metadata(&self) -> BTreeMap<String, String> {
        let json = serde_json::to_string(self).unwrap_or_default();
        BTreeMap::from([(BASE_METADATA_KEY.to_string(), json)])
    }

    /// The identity an adapter records in its metadata, if any; an unreadable one is an error
    /// naming the adapter's file.
    pub fn from_metadata(adapter: &Adapter) -> Result<Option<Self>> {
        let Some(json) = adapter.metadata.get(BASE_METADATA_KEY) else {
            return Ok(None);
        };
        serde_json::from_str(json).map(Some).map_err(|e| {
            Error::checkpoint(
                adapter.dir.join(format::ADAPTER_WEIGHTS_FILE),
                format!("`__metadata__` entry `{BASE_METADATA_KEY}` is not a base identity: {e}"),
            )
        })
    }
}

/// The base identity a run's `trainer_state.json` records: the semantic [`BaseIdentity`], or
/// the digests of the files that runs written before it recorded (still checked, as then).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RecordedBase {
    /// What runs record now.
    Semantic(BaseIdentity),
    /// What older runs recorded: `config.json` and each weight file, by byte digest.
    Files {
        /// The base as the run named it.
        model: String,
        /// Digest of its `config.json`.
        config: String,
        /// Digest of each weight file, by file name.
        weights: BTreeMap<String, String>,
    },
}

impl RecordedBase {
    /// Errors unless the base found now is the recorded one: `now` for a semantic record;
    /// for an old one, the bytes of `dir`'s `config.json` and of `weight_files`, as old
    /// runs were checked. `adapters` is the checkpoint named in the error.
    pub fn check(
        &self,
        now: &BaseIdentity,
        dir: &Path,
        weight_files: &[PathBuf],
        adapters: &Path,
    ) -> Result<()> {
        let (model, config, weights) = match self {
            RecordedBase::Semantic(id) => return id.check(now, adapters, ""),
            RecordedBase::Files {
                model,
                config,
                weights,
            } => (model, config, weights),
        };
        let digest = candle_data::digest::file_digest;
        let mut diff = Vec::new();
        if *config != digest(&dir.join(crate::load::CONFIG_FILE))? {
            diff.push(crate::load::CONFIG_FILE.to_string());
        }
        let mut found = BTreeMap::new();
        for f in weight_files {
            let name = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            found.insert(name, digest(f)?);
        }
        let names: BTreeSet<&String> = weights.keys().chain(found.keys()).collect();
        diff.extend(
            names
                .into_iter()
                .filter(|n| weights.get(*n) != found.get(*n))
                .cloned(),
        );
        if diff.is_empty() {
            return Ok(());
        }
        Err(Error::checkpoint(
            adapters,
            format!(
                "its adapters were trained on the base `{model}`, recorded (by a trainer \
                 before identities were semantic) as the bytes of its files; `{}` differs in \
                 {}: adapters only make sense on the weights they were trained on",
                now.model,
                diff.join(", ")
            ),
        ))
    }
}

/// Refuses `adapter` when its file records a base other than `now`, naming both, unless
/// `other_base` (then a warning). An adapter that records no base (PEFT's own) is used as it is.
pub fn check_adapter_base(adapter: &Adapter, now: &BaseIdentity, other_base: bool) -> Result<()> {
    let Some(made_on) = BaseIdentity::from_metadata(adapter)? else {
        return Ok(());
    };
    let file = adapter.dir.join(format::ADAPTER_WEIGHTS_FILE);
    let advice = match other_base {
        true => " (used anyway: --other-base)",
        false => "; give --other-base to use them anyway",
    };
    match made_on.check(now, &file, advice) {
        Err(e) if other_base => {
            tracing::warn!("{e}");
            Ok(())
        }
        r => r,
    }
}
