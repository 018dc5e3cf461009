//! A tensor's bytes in a ggml type, as llama.cpp's converter computes them (gguf-py's
//! `quants.py`): the tensor is read as f32 first (a bf16 source exactly), then rounded to
//! nearest-even for f16 and bf16; q8_0 by Candle's port of ggml's reference quantizer (blocks
//! of 32: `d = max|x| / 127` as f16 and `round(x * (1/d))`, halves away from zero), which
//! gguf-py reproduces bit for bit; q5_0 likewise by Candle's port; q4_k and q6_k by
//! [`super::kquants`], llama.cpp's current quantizers.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use half::{bf16, f16};

use super::writer::GgmlType;

/// The bytes of `t` (row-major) stored as `ty`.
pub fn encode(t: &Tensor, ty: GgmlType) -> candle_core::Result<Vec<u8>> {
    let t = t.to_dtype(DType::F32)?;
    let quantized = |q: GgmlDType| -> candle_core::Result<Vec<u8>> {
        Ok(QTensor::quantize(&t, q)?.data()?.into_owned())
    };
    let x = || t.flatten_all()?.to_vec1::<f32>();
    Ok(match ty {
        GgmlType::F32 => x()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => x()?
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => x()?
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => quantized(GgmlDType::Q8_0)?,
        GgmlType::Q5_0 => quantized(GgmlDType::Q5_0)?,
        GgmlType::Q4K => super::kquants::q4_k(&x()?),
        GgmlType::Q6K => super::kquants::q6_k(&x()?),
    })
}
