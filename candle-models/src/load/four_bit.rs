//! How the loader reads a base held in 4 bits (QLoRA): a model saved by transformers with
//! `load_in_4bit`, read as saved, or a full-precision model quantized as it is read.

use std::path::Path;

use candle_core::Device;

use super::{Checks, ModelDir, CONFIG_FILE};
use crate::lora::{BaseIdentity, Nf4Layers, Nf4Settings};
use crate::model::{ModelConfig, Params};
use crate::{Error, Result};

/// What a command does with a base held in 4 bits ([`Checks::four_bit`]).
#[derive(Clone, Copy, Debug, Default)]
pub enum FourBit<'a> {
    /// A model saved in 4 bits is refused unless adapters are loaded over it (full
    /// fine-tuning needs every weight; inference reads the adapters' base dequantized).
    #[default]
    Refuse,
    /// The base of a LoRA run: a model saved in 4 bits is read as saved
    /// ([`crate::lora::read_bnb_4bit`]: codes, absmaxes and nested state as they are), a
    /// full-precision one as it is.
    Keep,
    /// The base of a `--base-quant nf4` LoRA run: its linear layers quantized as they are read,
    /// one at a time, as the settings say; a model saved in 4 bits is refused (it is quantized
    /// already).
    Quantize(&'a Nf4Settings),
}

/// The weights a load read: the full-precision parameters, the 4-bit layers if any, and the
/// base's identity when the load is a LoRA base's.
pub(super) struct Base {
    pub params: Params,
    pub quantized: Option<Nf4Layers>,
    pub identity: Option<BaseIdentity>,
}

/// `Some(double)` when the `config.json` at `path` describes a bitsandbytes 4-bit NF4 model;
/// any other quantization is refused by name.
fn saved_4bit(path: &Path) -> Result<Option<bool>> {
    let json: serde_json::Value = candle_data::io::read_json(path)?;
    crate::lora::check_quantization_config(path, &json)
}

impl ModelDir {
    /// Errors unless `checks` accept what `config.json` says the base is (module docs,
    /// step 1): a model saved in 4 bits (`Some(double quantization)`) is read for adapters or
    /// a LoRA run only.
    pub(super) fn check_four_bit(&self, checks: &Checks) -> Result<Option<bool>> {
        let path = self.dir.join(CONFIG_FILE);
        let Some(double) = saved_4bit(&path)? else {
            return Ok(None);
        };
        match checks.four_bit {
            FourBit::Keep => Ok(Some(double)),
            FourBit::Refuse if self.adapter.is_some() => Ok(Some(double)),
            FourBit::Refuse => Err(Error::checkpoint(
                path,
                "is a bitsandbytes 4-bit (NF4) model: its projections are packed 4-bit codes, \
                 which full fine-tuning cannot train nor a plain model read; train LoRA \
                 adapters over it (--lora-r), or give the full-precision model",
            )),
            FourBit::Quantize(_) => Err(Error::checkpoint(
                path,
                "is a bitsandbytes 4-bit (NF4) model already: it is read as saved (its \
                 quantization_config says how); leave --base-quant out",
            )),
        }
    }

    /// The weights (module docs, step 5) as `checks` ask: a model saved in 4 bits as saved
    /// (`saved_4bit`), a full-precision one quantized as it is read
    /// ([`FourBit::Quantize`]) or read whole. The base's identity is computed for adapters
    /// and LoRA bases (from the files, one tensor at a time, when quantized on load).
    pub(super) fn read_base(
        &self,
        checks: &Checks,
        config: &dyn ModelConfig,
        device: &Device,
        saved_4bit: bool,
    ) -> Result<Base> {
        let identify = self.adapter.is_some() || !matches!(checks.four_bit, FourBit::Refuse);
        let name = self.base_name();
        if saved_4bit {
            let q = crate::lora::read_bnb_4bit(&self.dir, device)?;
            let identity = identify
                .then(|| BaseIdentity::of_4bit(&name, config, &q.params, &q.layers))
                .transpose()?;
            return Ok(Base {
                params: q.params,
                quantized: Some(q.layers),
                identity,
            });
        }
        if let FourBit::Quantize(settings) = checks.four_bit {
            let weights = self.weights.open(config, self.source())?;
            let file = self.weights.path().to_path_buf();
            let (params, layers) =
                crate::lora::quantize_streamed(config, &weights, settings, device, file)?;
            // Each tensor once more, in name order: those kept from `params`, the quantized
            // ones read again one at a time.
            let tensors = weights.names().map(|n| match params.get(n) {
                Some(v) => Ok((n.clone(), v.as_tensor().clone())),
                None => Ok((n.clone(), weights.tensor(n, device)?)),
            });
            let identity = BaseIdentity::of_tensors(&name, config, tensors, None)?;
            return Ok(Base {
                params,
                quantized: Some(layers),
                identity: Some(identity),
            });
        }
        let params = self.weights.read(config, device, self.source())?;
        let identity = identify
            .then(|| BaseIdentity::of(&name, config, &params))
            .transpose()?;
        Ok(Base {
            params,
            quantized: None,
            identity,
        })
    }
}
