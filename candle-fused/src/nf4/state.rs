//! The quant state transformers saves beside a 4-bit weight
//! (`weight.quant_state.bitsandbytes__nf4`): bitsandbytes' settings as JSON bytes.

use candle_core::{bail, DType, Result, Tensor};

/// The torch name of a dtype, as bitsandbytes writes it (`str(dtype).strip("torch.")`).
pub(super) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "unknown",
    }
}

/// The settings of a saved quant state.
pub(super) struct QuantState {
    pub(super) blocksize: usize,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    /// `(nested_blocksize, nested_offset)` with double quantization.
    pub(super) nested: Option<(usize, f32)>,
}

impl QuantState {
    /// Parses the JSON bytes of `tensor` (named `name`).
    pub(super) fn parse(name: &str, tensor: &Tensor) -> Result<Self> {
        use serde_json::Value;
        let bytes = tensor.flatten_all()?.to_dtype(DType::U8)?.to_vec1::<u8>()?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| candle_core::Error::Msg(format!("`{name}`: not JSON: {e}")))?;
        let field = |k: &str| -> Result<&Value> {
            v.get(k)
                .ok_or_else(|| candle_core::Error::Msg(format!("`{name}`: no `{k}` key")))
        };
        match field("quant_type")?.as_str() {
            Some("nf4") => {}
            other => bail!("`{name}`: quant_type {other:?}: only nf4 is supported"),
        }
        let size = |k: &str| -> Result<usize> {
            match field(k)?.as_u64() {
                Some(x) => Ok(x as usize),
                None => bail!("`{name}`: `{k}` must be a size, got {}", field(k)?),
            }
        };
        let dtype = match field("dtype")?.as_str() {
            Some("float32") => DType::F32,
            Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            _ => bail!(
                "`{name}`: dtype {} is not float32, bfloat16 or float16",
                field("dtype")?
            ),
        };
        let shape = match field("shape")?.as_array() {
            Some(a) => a
                .iter()
                .map(|d| match d.as_u64() {
                    Some(x) => Ok(x as usize),
                    None => bail!("`{name}`: shape entry {d} is not a size"),
                })
                .collect::<Result<Vec<_>>>()?,
            None => bail!("`{name}`: shape must be a list, got {}", field("shape")?),
        };
        let nested = match v.get("nested_blocksize") {
            None => None,
            Some(_) => {
                let offset = match field("nested_offset")?.as_f64() {
                    Some(x) => x as f32,
                    None => bail!("`{name}`: nested_offset must be a number"),
                };
                if field("nested_dtype")?.as_str() != Some("float32") {
                    bail!(
                        "`{name}`: nested_dtype {} is not float32",
                        field("nested_dtype")?
                    );
                }
                Some((size("nested_blocksize")?, offset))
            }
        };
        Ok(QuantState {
            blocksize: size("blocksize")?,
            dtype,
            shape,
            nested,
        })
    }
}
