//! NF4 dequantization on CUDA through the Triton kernels (`triton/nf4.py`, launch table
//! `cuda_kernels/nf4.rs`): one elementwise pass over the values asked for, reading the whole
//! weight's packed codes and absmaxes (the range starts at an index, so every pointer stays
//! aligned); the CPU's operations (a table value times an f32 absmax; nested: a product and a
//! sum first), so the values are the CPU's bits.

use super::{Absmax, Nf4Weight};
use crate::cuda_kernels::launch::{cuda_of, launch, Buf, Output};
use crate::cuda_kernels::triton_input;
use crate::cuda_kernels::Scalar::{F32, I32};
use candle_core::{bail, DType, Device, Result, Tensor};

/// Values `start..end` of `w` dequantized to `dtype` (f32, bf16 or f16; rounded once) by
/// `nf4_dequant` from the plain `absmax` (f32, one per block), or by `nf4_dequant_nested`
/// from the weight's nested parts. The caller checked `start < end <= n <= i32::MAX`.
pub(super) fn dequantize(
    w: &Nf4Weight,
    absmax: &Tensor,
    start: usize,
    end: usize,
    dtype: DType,
) -> Result<Tensor> {
    let Device::Cuda(dev) = w.device() else {
        bail!("nf4: the Triton dequantization needs a CUDA weight")
    };
    let int = |v: usize| i32::try_from(v).map(I32).map_err(candle_core::Error::wrap);
    let mut out = Output::new(dev, end - start, dtype)?;
    let (entry, inputs, scalars) = match &w.absmax {
        Absmax::Plain(_) => {
            let scalars = vec![int(start)?, int(w.blocksize)?];
            ("nf4_dequant", vec![&w.packed, absmax], scalars)
        }
        Absmax::Nested(q) => {
            let (offset, nbs) = (F32(q.offset), int(q.blocksize)?);
            let scalars = vec![offset, int(start)?, int(w.blocksize)?, nbs];
            let inputs = vec![&w.packed, &q.codes, &q.absmax, &q.map];
            ("nf4_dequant_nested", inputs, scalars)
        }
    };
    // contiguous and aligned (a copy only where a part is not)
    let inputs = inputs
        .into_iter()
        .map(triton_input)
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = inputs.iter().map(Tensor::storage_and_layout).collect();
    let mut tensors = guards
        .iter()
        .map(|(s, l)| Ok(Buf::read(cuda_of(s)?, l)))
        .collect::<Result<Vec<_>>>()?;
    tensors.push(Buf::write(&mut out));
    launch(entry, dtype, tensors, &scalars)?;
    Ok(out.into_tensor())
}
