//! A base's linear layers held in 4 bits ([`Nf4Layers`]): read as a saved bitsandbytes model
//! holds them, or quantized one tensor at a time as a full-precision model is read
//! (`quantize_streamed`), so that its full-precision weights are never whole in memory.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::{DType, Tensor};
use candle_fused::nf4::{Absmax, Nf4Weight, QUANT_STATE_SUFFIX};

use crate::model::Params;
use crate::Result;

/// The linear layers of a base held in 4 bits (NF4), by module path
/// (`model.layers.0.mlp.up_proj`), and where they come from.
#[derive(Clone, Debug)]
pub struct Nf4Layers {
    /// The 4-bit weights, by module path.
    pub weights: BTreeMap<String, Nf4Weight>,
    /// The file they were read from (for errors).
    pub file: PathBuf,
    /// The dtype they are dequantized into and compute in (bitsandbytes'
    /// `bnb_4bit_compute_dtype`: a saved model's, until a run sets its own); `None`: the
    /// model's compute dtype.
    pub compute_dtype: Option<DType>,
}

impl Nf4Layers {
    /// The 4-bit weight of the linear layer `fan_in -> fan_out` at `path`, if it is one (a
    /// [`Quant`](crate::model::Quant) for [`adapt_quantized`](crate::lora::adapt_quantized)).
    /// A weight whose quant state gives another shape than the layer's `[fan_out, fan_in]` is
    /// refused, naming its file and its quant state tensor.
    pub fn quant(
        &self,
        path: &str,
        fan_in: usize,
        fan_out: usize,
    ) -> crate::Result<Option<Nf4Weight>> {
        let Some(w) = self.weights.get(path) else {
            return Ok(None);
        };
        if w.shape() != [fan_out, fan_in] {
            return Err(crate::Error::checkpoint(
                &self.file,
                format!(
                    "`{path}.weight.{QUANT_STATE_SUFFIX}` gives the shape {:?}, but the model's \
                     layer `{path}` is {fan_in} -> {fan_out} (a weight [{fan_out}, {fan_in}])",
                    w.shape()
                ),
            ));
        }
        Ok(Some(w.clone()))
    }

    /// Whether the absmaxes are quantized again (`bnb_4bit_use_double_quant`).
    pub fn double(&self) -> bool {
        self.weights
            .values()
            .any(|w| matches!(w.absmax(), Absmax::Nested(_)))
    }

    /// How the layers are quantized, for the base identity and messages
    /// (`bitsandbytes nf4, blocksize 64, double quantization`).
    pub fn describe(&self) -> String {
        let blocksize = self.weights.values().next().map_or(0, |w| w.blocksize());
        let double = match self.double() {
            true => ", double quantization",
            false => "",
        };
        let compute = match self.compute_dtype {
            Some(d) => format!(", compute {}", format!("{d:?}").to_lowercase()),
            None => String::new(),
        };
        format!("bitsandbytes nf4, blocksize {blocksize}{double}{compute}")
    }

    /// The tensors transformers saves for the layers (`…weight`, `…weight.absmax`, ..), by
    /// name: what identifies a saved 4-bit base.
    pub(crate) fn saved_tensors(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for (path, w) in &self.weights {
            out.extend(w.to_tensors(&format!("{path}.weight"))?);
        }
        Ok(out)
    }

    /// `params` with each 4-bit layer's weight dequantized to f32 as `…weight`: the weights a
    /// LoRA run over this base computes with, for merging adapters into them.
    pub fn dequantized_into(&self, params: &Params) -> Result<Params> {
        let mut tensors: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        for (path, w) in &self.weights {
            tensors.push((format!("{path}.weight"), w.dequantize(DType::F32)?));
        }
        Params::from_tensors(tensors)
    }

    /// `params` (merged f32 weights) with each 4-bit layer's weight quantized again (double
    /// when these are) and dequantized to f32: what PEFT's `merge_and_unload` leaves of a
    /// 4-bit base, dequantized.
    pub fn requantized(&self, params: &Params) -> Result<Params> {
        let double = self.double();
        let tensors: Result<Vec<(String, Tensor)>> = params
            .iter()
            .map(|(n, v)| {
                let t = v.as_tensor();
                let layer = n
                    .strip_suffix(".weight")
                    .filter(|p| self.weights.contains_key(*p));
                Ok(match layer {
                    Some(_) => (
                        n.clone(),
                        Nf4Weight::quantize(t, double)?.dequantize(DType::F32)?,
                    ),
                    None => (n.clone(), t.clone()),
                })
            })
            .collect();
        Params::from_tensors(tensors?)
    }
}
