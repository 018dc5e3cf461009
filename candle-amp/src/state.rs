//! Scaler state and its safetensors round trip.
//!
//! The state is stored twice in a file written by [`ScalerState::save`]: as tensors
//! (`<prefix>scale`, an `f64` tensor of shape `[1]`, and `<prefix>counters`, an `i64` tensor)
//! and as string metadata (`<prefix>scale`, `<prefix>steps`, ...). Both encodings are exact:
//! the tensor holds the `f64` bits and the metadata uses Rust's shortest round-trip float
//! formatting. [`ScalerState::load`] reads the tensors and falls back to the metadata.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{AmpError, Result};

/// Key prefix used by [`ScalerState::save`] and [`ScalerState::load`].
pub(crate) const DEFAULT_PREFIX: &str = "amp.";

/// Names of the counters, in the order they are stored in the `counters` tensor.
const COUNTERS: [&str; 9] = [
    "growth_tracker",
    "hysteresis_left",
    "steps",
    "applied",
    "skipped",
    "overflows",
    "consecutive_skips",
    "backoffs",
    "growths",
];

/// Everything a loss scaler needs to resume bit-exactly, plus step counters.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalerState {
    /// Current loss scale.
    pub scale: f64,
    /// Consecutive clean steps since the last growth or overflow.
    pub growth_tracker: u64,
    /// Remaining hysteresis budget (overflows tolerated before a backoff).
    pub hysteresis_left: u32,
    /// Steps attempted.
    pub steps: u64,
    /// Steps whose update was applied.
    pub applied: u64,
    /// Steps whose update was skipped.
    pub skipped: u64,
    /// Overflow detections (one per skipped step).
    pub overflows: u64,
    /// Skipped steps since the last applied one.
    pub consecutive_skips: u64,
    /// Number of times the scale backed off.
    pub backoffs: u64,
    /// Number of times the scale grew.
    pub growths: u64,
}

impl ScalerState {
    /// The state of a fresh scaler.
    pub fn initial(scale: f64, hysteresis: u32) -> Self {
        Self {
            scale,
            growth_tracker: 0,
            hysteresis_left: hysteresis,
            steps: 0,
            applied: 0,
            skipped: 0,
            overflows: 0,
            consecutive_skips: 0,
            backoffs: 0,
            growths: 0,
        }
    }

    fn counters(&self) -> [u64; 9] {
        [
            self.growth_tracker,
            u64::from(self.hysteresis_left),
            self.steps,
            self.applied,
            self.skipped,
            self.overflows,
            self.consecutive_skips,
            self.backoffs,
            self.growths,
        ]
    }

    fn from_parts(scale: f64, c: &[u64]) -> Result<Self> {
        if c.len() != COUNTERS.len() {
            return Err(AmpError::State(format!(
                "expected {} counters, found {}",
                COUNTERS.len(),
                c.len()
            )));
        }
        if !(scale.is_finite() && scale > 0.0) {
            return Err(AmpError::State(format!("scale {scale} is not positive")));
        }
        let hysteresis_left = u32::try_from(c[1])
            .map_err(|_| AmpError::State(format!("hysteresis_left {} too large", c[1])))?;
        Ok(Self {
            scale,
            growth_tracker: c[0],
            hysteresis_left,
            steps: c[2],
            applied: c[3],
            skipped: c[4],
            overflows: c[5],
            consecutive_skips: c[6],
            backoffs: c[7],
            growths: c[8],
        })
    }

    /// The state as tensors named `<prefix>scale` (f64, `[1]`) and `<prefix>counters`
    /// (i64), ready to be merged into a checkpoint's tensor map.
    pub fn to_tensors(&self, prefix: &str, device: &Device) -> Result<HashMap<String, Tensor>> {
        let scale = Tensor::from_vec(vec![self.scale], 1, device)?;
        let counters: Vec<i64> = self
            .counters()
            .iter()
            .map(|&c| {
                i64::try_from(c).map_err(|_| AmpError::State(format!("counter {c} too large")))
            })
            .collect::<Result<_>>()?;
        let counters = Tensor::from_vec(counters, COUNTERS.len(), device)?;
        Ok(HashMap::from([
            (format!("{prefix}scale"), scale),
            (format!("{prefix}counters"), counters),
        ]))
    }

    /// Reads the state written by [`to_tensors`](Self::to_tensors).
    pub fn from_tensors(tensors: &HashMap<String, Tensor>, prefix: &str) -> Result<Self> {
        let get = |name: &str| {
            tensors
                .get(&format!("{prefix}{name}"))
                .ok_or_else(|| AmpError::State(format!("missing tensor `{prefix}{name}`")))
        };
        let scale = get("scale")?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        let [scale] = scale[..] else {
            return Err(AmpError::State("`scale` must hold one value".into()));
        };
        let counters = get("counters")?;
        if counters.dtype() != DType::I64 {
            return Err(AmpError::State(format!(
                "`counters` has dtype {:?}",
                counters.dtype()
            )));
        }
        let counters: Vec<u64> = counters
            .flatten_all()?
            .to_vec1::<i64>()?
            .into_iter()
            .map(|c| u64::try_from(c).map_err(|_| AmpError::State(format!("negative counter {c}"))))
            .collect::<Result<_>>()?;
        Self::from_parts(scale, &counters)
    }

    /// The state as string metadata (`<prefix>scale`, `<prefix>steps`, ...), exact.
    pub(crate) fn to_metadata(&self, prefix: &str) -> HashMap<String, String> {
        let mut m: HashMap<String, String> = COUNTERS
            .iter()
            .zip(self.counters())
            .map(|(n, c)| (format!("{prefix}{n}"), c.to_string()))
            .collect();
        m.insert(format!("{prefix}scale"), self.scale.to_string());
        m
    }

    /// Reads the state written by [`to_metadata`](Self::to_metadata).
    pub(crate) fn from_metadata(meta: &HashMap<String, String>, prefix: &str) -> Result<Self> {
        let get = |name: &str| {
            meta.get(&format!("{prefix}{name}"))
                .ok_or_else(|| AmpError::State(format!("missing metadata `{prefix}{name}`")))
        };
        let scale: f64 = get("scale")?
            .parse()
            .map_err(|e| AmpError::State(format!("bad scale: {e}")))?;
        let counters = COUNTERS
            .iter()
            .map(|n| {
                get(n)?
                    .parse::<u64>()
                    .map_err(|e| AmpError::State(format!("bad `{n}`: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_parts(scale, &counters)
    }

    /// Writes the state to a safetensors file, as tensors and as metadata, under the prefix
    /// `amp.`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        self.save_with_metadata(path, HashMap::new())
    }

    /// Like [`save`](Self::save) (written atomically: temporary file, fsync, rename), adding
    /// `extra` string metadata (keys must not collide with the state's own `amp.*` keys,
    /// which win).
    pub(crate) fn save_with_metadata(
        &self,
        path: impl AsRef<Path>,
        mut extra: HashMap<String, String>,
    ) -> Result<()> {
        let tensors = self.to_tensors(DEFAULT_PREFIX, &Device::Cpu)?;
        extra.extend(self.to_metadata(DEFAULT_PREFIX));
        let bytes = safetensors::serialize(tensors, Some(extra))?;
        write_atomic(path.as_ref(), &bytes)?;
        Ok(())
    }

    /// The string metadata of a safetensors file (empty if it has none).
    pub(crate) fn read_file_metadata(path: impl AsRef<Path>) -> Result<HashMap<String, String>> {
        let bytes = std::fs::read(path)?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
        Ok(header.metadata().clone().unwrap_or_default())
    }

    /// Reads a file written by [`save`](Self::save) (or any safetensors file holding the
    /// tensors or the metadata under the prefix `amp.`).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let bytes = std::fs::read(path)?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)?;
        if tensors.contains_key(&format!("{DEFAULT_PREFIX}scale")) {
            return Self::from_tensors(&tensors, DEFAULT_PREFIX);
        }
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
        match header.metadata() {
            Some(meta) => Self::from_metadata(meta, DEFAULT_PREFIX),
            None => Err(AmpError::State(
                "file holds neither amp tensors nor metadata".into(),
            )),
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory that is fsynced and
/// then renamed over `path`, so a crash leaves the old file or the new one, never a torn one.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.unwrap_or_else(|| "amp-state".into()),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ScalerState {
        ScalerState {
            scale: 0.1f64 * 7.0, // not a power of two: exercises exact float formatting
            steps: (1 << 50) + 3,
            skipped: 9,
            overflows: 9,
            ..ScalerState::initial(1.0, 4)
        }
    }

    /// The metadata encoding alone is exact, and `load` falls back to it when a file holds
    /// no amp tensors (e.g. the state embedded in someone's checkpoint header).
    #[test]
    fn metadata_round_trips_and_is_the_fallback() -> Result<()> {
        let st = sample();
        assert_eq!(ScalerState::from_metadata(&st.to_metadata("y/"), "y/")?, st);
        let path = std::env::temp_dir().join(format!(
            "candle-amp-{}-meta-only.safetensors",
            std::process::id()
        ));
        let none: HashMap<String, Tensor> = HashMap::new();
        let bytes = safetensors::serialize(none, Some(st.to_metadata(DEFAULT_PREFIX)))?;
        std::fs::write(&path, bytes)?;
        assert_eq!(ScalerState::load(&path)?, st);
        std::fs::remove_file(path)?;
        // Missing fields are an error, not a panic.
        let mut m = st.to_metadata(DEFAULT_PREFIX);
        m.remove("amp.skipped");
        assert!(ScalerState::from_metadata(&m, DEFAULT_PREFIX).is_err());
        Ok(())
    }
}
