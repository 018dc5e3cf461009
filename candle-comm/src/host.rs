//! Staging tensors through host buffers, and the reductions the in-process backends run on them.

use candle_core::{DType, Device, Shape, Storage, Tensor};

use crate::comm::ReduceOp;
use crate::error::{CandleContext, CommError, Op, Result};

/// A tensor's elements on the host, in the type they travel as (bf16/f16 travel as f32).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HostBuf {
    /// f32, bf16 and f16 tensors.
    F32(Vec<f32>),
    /// f64 tensors.
    F64(Vec<f64>),
}

impl HostBuf {
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            HostBuf::F32(v) => v.len(),
            HostBuf::F64(v) => v.len(),
        }
    }

    /// Whether both buffers have the same element type and length.
    pub(crate) fn same_layout(&self, other: &HostBuf) -> bool {
        matches!(
            (self, other),
            (HostBuf::F32(_), HostBuf::F32(_)) | (HostBuf::F64(_), HostBuf::F64(_))
        ) && self.len() == other.len()
    }

    /// `self[i] = op(self[i], other[i])` for a native op (Sum, Max, Min; Mean reduces as Sum).
    /// The caller checks [`same_layout`](HostBuf::same_layout).
    pub(crate) fn combine(&mut self, other: &HostBuf, op: ReduceOp) {
        fn go<T: Copy + PartialOrd + std::ops::Add<Output = T>>(
            a: &mut [T],
            b: &[T],
            op: ReduceOp,
        ) {
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    a.iter_mut().zip(b).for_each(|(x, &y)| *x = *x + y)
                }
                ReduceOp::Max => a.iter_mut().zip(b).for_each(|(x, &y)| {
                    if y > *x || y.ne(&y) {
                        *x = y
                    }
                }),
                ReduceOp::Min => a.iter_mut().zip(b).for_each(|(x, &y)| {
                    if y < *x || y.ne(&y) {
                        *x = y
                    }
                }),
            }
        }
        match (self, other) {
            (HostBuf::F32(a), HostBuf::F32(b)) => go(a, b, op),
            (HostBuf::F64(a), HostBuf::F64(b)) => go(a, b, op),
            _ => {}
        }
    }

    /// Divides every element by `world` when `op` is [`ReduceOp::Mean`].
    pub(crate) fn finish(&mut self, op: ReduceOp, world: usize) {
        if op != ReduceOp::Mean || world == 1 {
            return;
        }
        match self {
            HostBuf::F32(v) => {
                let d = world as f32;
                v.iter_mut().for_each(|x| *x /= d)
            }
            HostBuf::F64(v) => {
                let d = world as f64;
                v.iter_mut().for_each(|x| *x /= d)
            }
        }
    }

    /// Elements `start..start + len`.
    pub(crate) fn slice(&self, start: usize, len: usize) -> HostBuf {
        match self {
            HostBuf::F32(v) => HostBuf::F32(v[start..start + len].to_vec()),
            HostBuf::F64(v) => HostBuf::F64(v[start..start + len].to_vec()),
        }
    }

    /// Concatenation of `parts` (all of the same element type as the first; parts of the other
    /// type are skipped).
    pub(crate) fn concat(parts: &[HostBuf]) -> HostBuf {
        let mut out = match parts.first() {
            Some(HostBuf::F64(_)) => HostBuf::F64(Vec::new()),
            _ => HostBuf::F32(Vec::new()),
        };
        for p in parts {
            match (&mut out, p) {
                (HostBuf::F32(a), HostBuf::F32(b)) => a.extend_from_slice(b),
                (HostBuf::F64(a), HostBuf::F64(b)) => a.extend_from_slice(b),
                _ => {}
            }
        }
        out
    }
}

/// The element type a dtype travels as, or an error for dtypes that cannot be communicated.
pub(crate) fn wire_dtype(dtype: DType, rank: usize, op: Op) -> Result<DType> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(DType::F32),
        DType::F64 => Ok(DType::F64),
        dtype => Err(CommError::UnsupportedDtype { rank, op, dtype }),
    }
}

/// Copies `tensor`'s elements (row-major, any layout) to the host.
pub(crate) fn stage(tensor: &Tensor, rank: usize, op: Op) -> Result<HostBuf> {
    let wire = wire_dtype(tensor.dtype(), rank, op)?;
    let flat = tensor.flatten_all().at(rank, op)?;
    match wire {
        DType::F64 => Ok(HostBuf::F64(flat.to_vec1::<f64>().at(rank, op)?)),
        _ => {
            let flat = flat.to_dtype(DType::F32).at(rank, op)?;
            Ok(HostBuf::F32(flat.to_vec1::<f32>().at(rank, op)?))
        }
    }
}

/// A tensor's elements borrowed (or staged) on the host, in the type they travel as.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
pub(crate) enum HostSlice<'a> {
    /// f32, bf16 and f16 tensors.
    F32(&'a [f32]),
    /// f64 tensors.
    F64(&'a [f64]),
}

/// Runs `f` on `tensor`'s elements: borrowed in place for a contiguous f32/f64 CPU tensor (no
/// copy; the storage stays read-locked while `f` runs), staged through [`stage`] otherwise.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn with_host<R>(
    tensor: &Tensor,
    rank: usize,
    op: Op,
    f: impl FnOnce(HostSlice<'_>) -> R,
) -> Result<R> {
    if tensor.device().is_cpu() && tensor.is_contiguous() {
        let (storage, layout) = tensor.storage_and_layout();
        if let Storage::Cpu(cpu) = &*storage {
            let range = layout.start_offset()..layout.start_offset() + tensor.elem_count();
            match tensor.dtype() {
                DType::F32 => {
                    let all = cpu.as_slice::<f32>().at(rank, op)?;
                    return Ok(f(HostSlice::F32(&all[range])));
                }
                DType::F64 => {
                    let all = cpu.as_slice::<f64>().at(rank, op)?;
                    return Ok(f(HostSlice::F64(&all[range])));
                }
                _ => {}
            }
        }
    }
    let buf = stage(tensor, rank, op)?;
    Ok(match &buf {
        HostBuf::F32(v) => f(HostSlice::F32(v)),
        HostBuf::F64(v) => f(HostSlice::F64(v)),
    })
}

/// Builds a tensor of `shape` and `dtype` on `device` from host elements.
pub(crate) fn unstage(
    buf: HostBuf,
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
    rank: usize,
    op: Op,
) -> Result<Tensor> {
    let shape = shape.into();
    if buf.len() != shape.elem_count() {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            message: format!("{} elements received for shape {shape:?}", buf.len()),
        });
    }
    let host = match buf {
        HostBuf::F32(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        HostBuf::F64(v) => Tensor::from_vec(v, shape, &Device::Cpu),
    }
    .at(rank, op)?;
    let host = if host.dtype() == dtype {
        host
    } else {
        host.to_dtype(dtype).at(rank, op)?
    };
    host.to_device(device).at(rank, op)
}

/// [`unstage`] into the shape, dtype and device of `like`.
pub(crate) fn unstage_like(buf: HostBuf, like: &Tensor, rank: usize, op: Op) -> Result<Tensor> {
    unstage(buf, like.shape(), like.dtype(), like.device(), rank, op)
}

/// Stable numeric code of a communicable dtype (sent in point-to-point headers).
pub(crate) fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1,
        DType::F64 => 2,
        DType::BF16 => 3,
        DType::F16 => 4,
        _ => 0,
    }
}

/// Inverse of [`dtype_code`].
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn dtype_from_code(code: u64) -> Option<DType> {
    match code {
        1 => Some(DType::F32),
        2 => Some(DType::F64),
        3 => Some(DType::BF16),
        4 => Some(DType::F16),
        _ => None,
    }
}

/// Shape of an all-gather result: `world` blocks of `dims` along the first dimension.
pub(crate) fn gathered_shape(dims: &[usize], world: usize) -> Vec<usize> {
    match dims.split_first() {
        Some((d0, rest)) => std::iter::once(d0 * world)
            .chain(rest.iter().copied())
            .collect(),
        None => vec![world],
    }
}
