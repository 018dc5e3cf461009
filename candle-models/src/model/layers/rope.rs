//! Rotary position embeddings as transformers computes their frequencies: `inv_freq[i] =
//! 1 / theta^(2i / d)` in f32, then the `rope_scaling` of the config (`linear`: every
//! frequency divided by the factor; `llama3`: low frequencies divided, high ones kept, a
//! smooth blend between).

use std::f64::consts::PI;
use std::path::Path;
use std::sync::Mutex;

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use crate::{Error, Result};

/// A RoPE frequency scaling (`rope_scaling` / `rope_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`default`, or no scaling).
    None,
    /// `linear`: positions divided by `factor` (frequencies divided by it).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `llama3` (Llama 3.1+): wavelengths longer than `original / low_freq_factor` are
    /// stretched by `factor`, shorter than `original / high_freq_factor` kept, and those between
    /// blended smoothly.
    Llama3 {
        /// Stretch of the low frequencies.
        factor: f64,
        /// Bound of the low band (`original / low_freq_factor` is its shortest wavelength).
        low_freq_factor: f64,
        /// Bound of the high band.
        high_freq_factor: f64,
        /// The context the model was pretrained on (`original_max_position_embeddings`).
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// Reads `(rope_theta, scaling)` from a `config.json`: transformers 5.x's
    /// `rope_parameters`, or 4.x's top-level `rope_theta` and `rope_scaling` (with `rope_type`
    /// or the older `type`). `original_max_position_embeddings` defaults to
    /// `max_position_embeddings`, as transformers does.
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<(f64, RopeScaling)> {
        let (params, key) = match v.get("rope_parameters") {
            Some(p @ Value::Object(_)) => (Some(p), "rope_parameters"),
            _ => (v.get("rope_scaling"), "rope_scaling"),
        };
        let err =
            |field: &str, msg: String| Error::checkpoint(path, format!("`{key}.{field}`: {msg}"));
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .map(|t| {
                t.as_f64()
                    .ok_or_else(|| err("rope_theta", format!("must be a number, got {t}")))
            })
            .transpose()?
            .unwrap_or(10000.0);
        let Some(p) = params.filter(|p| !p.is_null()) else {
            return Ok((theta, RopeScaling::None));
        };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |field: &str| -> Result<f64> {
            p.get(field)
                .and_then(Value::as_f64)
                .ok_or_else(|| err(field, "missing or not a number".into()))
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: num("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: match p
                    .get("original_max_position_embeddings")
                    .and_then(Value::as_u64)
                {
                    Some(n) => n as usize,
                    None => v
                        .get("max_position_embeddings")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| err("original_max_position_embeddings", "missing".into()))?
                        as usize,
                },
            },
            other => {
                return Err(err(
                    "rope_type",
                    format!("`{other}` is not supported (default, linear and llama3 are)"),
                ))
            }
        };
        scaling
            .validate()
            .map_err(|e| err("rope_type", e.to_string()))?;
        Ok((theta, scaling))
    }

    /// Checks the factors.
    pub fn validate(&self) -> Result<()> {
        let ok = match *self {
            RopeScaling::None => true,
            RopeScaling::Linear { factor } => factor > 0.0,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                factor > 0.0
                    && low_freq_factor > 0.0
                    && high_freq_factor > low_freq_factor
                    && original_max_position_embeddings > 0
            }
        };
        match ok {
            true => Ok(()),
            false => Err(Error::Config(format!("invalid rope scaling {self:?}"))),
        }
    }

    /// The `rope_scaling` value of a 4.x-layout `config.json` (`null` for none).
    pub fn to_hf_json(&self) -> Value {
        match *self {
            RopeScaling::None => Value::Null,
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        }
    }

    /// The inverse frequencies `[head_dim / 2]` (f32, as transformers computes them: the
    /// exponent in f32 from an integer `arange`, the power and scaling in f32).
    ///
    /// ```
    /// use candle_models::model::llama::RopeScaling;
    /// let f = RopeScaling::None.inv_freq(10000.0, 4);
    /// assert_eq!(f[0], 1.0);
    /// assert!((f[1] - 0.01).abs() < 1e-9);
    /// let lin = RopeScaling::Linear { factor: 4.0 }.inv_freq(10000.0, 4);
    /// assert_eq!(lin[0], 0.25);
    /// ```
    pub fn inv_freq(&self, theta: f64, head_dim: usize) -> Vec<f32> {
        // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), in f32.
        let base = theta as f32;
        let plain = (0..head_dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32));
        match *self {
            RopeScaling::None => plain.collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old as f64 / low_freq_factor;
                let high_wavelen = old as f64 / high_freq_factor;
                plain
                    .map(|f| {
                        // transformers computes these in f32 tensors; f64 then rounding once
                        // differs by at most an ulp and is checked against its fixtures.
                        let wavelen = 2.0 * PI / f as f64;
                        if wavelen > low_wavelen {
                            (f as f64 / factor) as f32
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old as f64 / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            ((1.0 - smooth) * f as f64 / factor + smooth * f as f64) as f32
                        }
                    })
                    .collect()
            }
        }
    }
}

/// A layer's constant RoPE inputs on the device: `inv_freq` and the positions `0..T` of a
/// training row, each copied to a device once and reused by every later forward (not copied
/// from the host at every call: the step copies only its batch, `trainer/tests/transfers.rs`).
#[derive(Debug)]
pub(super) struct RopeConsts {
    inv_freq: Vec<f32>,
    on_device: Mutex<OnDevice>,
}

/// The device copies made so far (the last device's; a layer runs on one device).
#[derive(Debug, Default)]
struct OnDevice {
    inv_freq: Option<Tensor>,
    positions: Option<Tensor>,
}

impl RopeConsts {
    pub(super) fn new(inv_freq: Vec<f32>) -> Self {
        RopeConsts {
            inv_freq,
            on_device: Mutex::new(OnDevice::default()),
        }
    }

    /// `inv_freq` `[D / 2]` f32 on `device`.
    pub(super) fn inv_freq(&self, device: &Device) -> candle_core::Result<Tensor> {
        let mut c = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = c
            .inv_freq
            .as_ref()
            .filter(|t| t.device().same_device(device))
        {
            return Ok(t.clone());
        }
        let n = self.inv_freq.len();
        let t = candle_data::transfer::upload(self.inv_freq.clone(), n, device)?;
        c.inv_freq = Some(t.clone());
        Ok(t)
    }

    /// Positions `offset..offset + t` in each of `b` rows, `[b, t]` u32 on `device`; the row
    /// `0..t` is copied once per device and length, others (cached decoding) at every call.
    pub(super) fn positions(
        &self,
        b: usize,
        t: usize,
        offset: usize,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let upload = || {
            let row: Vec<u32> = (offset as u32..(offset + t) as u32).collect();
            candle_data::transfer::upload(row, t, device)
        };
        let row = if offset == 0 {
            let mut c = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
            match c
                .positions
                .as_ref()
                .filter(|p| p.device().same_device(device) && p.dim(0).is_ok_and(|n| n >= t))
            {
                Some(p) => p.narrow(0, 0, t)?,
                None => {
                    let p = upload()?;
                    c.positions = Some(p.clone());
                    p
                }
            }
        } else {
            upload()?
        };
        row.unsqueeze(0)?.broadcast_as((b, t))?.contiguous()
    }
}
