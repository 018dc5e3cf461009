//! Device buffers for the NCCL backend: tensors to and from cudarc slices, per element type, and
//! the header that travels before a point-to-point payload.

use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda::cudarc::nccl::result::NcclError;
use candle_core::cuda::cudarc::nccl::NcclType;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, DeviceLocation, Shape, Storage, Tensor};

use crate::error::{CandleContext, CommError, Op, Result};
use crate::host::{dtype_code, dtype_from_code};

/// Most dimensions a tensor sent with `send` may have.
pub(super) const MAX_DIMS: usize = 8;

/// Length in `u64`s of a point-to-point header: tag, dtype code, number of dimensions, dimensions.
pub(super) const HEADER_LEN: usize = MAX_DIMS + 3;

/// Element types NCCL moves and reduces natively, that Candle stores on CUDA devices.
pub(super) trait Elem: NcclType + CudaDType + DeviceRepr + ValidAsZeroBits + Copy {}
impl Elem for f32 {}
impl Elem for f64 {}
impl Elem for half::bf16 {}
impl Elem for half::f16 {}

/// Runs `$body` with the type alias `$t` bound to the element type of `$dtype` (f32, f64, bf16,
/// f16); any other dtype is [`CommError::UnsupportedDtype`].
macro_rules! with_elem {
    ($dtype:expr, $rank:expr, $op:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            dtype => Err($crate::error::CommError::UnsupportedDtype {
                rank: $rank,
                op: $op,
                dtype,
            }),
        }
    };
}
pub(super) use with_elem;

/// An error of a CUDA or NCCL call, carried as a Candle CUDA error.
#[derive(Debug)]
pub(super) struct DeviceFailure(pub(super) String);

impl std::fmt::Display for DeviceFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceFailure {}

/// [`CommError::Candle`] for a failed CUDA or NCCL call described by `what`.
pub(super) fn device_error(rank: usize, op: Op, what: String) -> CommError {
    CommError::Candle {
        rank,
        op,
        source: candle_core::Error::Cuda(Box::new(DeviceFailure(what))),
    }
}

/// Name and description of an NCCL error code.
pub(super) fn nccl_text(e: &NcclError) -> String {
    use candle_core::cuda::cudarc::nccl::sys;
    // SAFETY: ncclGetErrorString returns a pointer to a static, NUL-terminated string for every
    // result code (it is documented never to fail).
    let text = unsafe {
        let p = sys::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    format!("NCCL {:?} ({text})", e.0)
}

/// A tensor made ready for NCCL: contiguous, on the communicator's GPU.
pub(super) struct Staged {
    /// Contiguous tensor on the communicator's GPU.
    pub(super) tensor: Tensor,
    /// The CUDA device results are built on (the input's, or the communicator's for a host input).
    pub(super) device: CudaDevice,
    /// Whether the input was on the host (results go back there).
    pub(super) from_host: bool,
}

impl Staged {
    /// Stages `tensor`: CUDA tensors must be on GPU `ordinal` (made contiguous when they are
    /// not), host tensors are copied to `home`; other devices are rejected.
    pub(super) fn new(tensor: &Tensor, home: &Device, rank: usize, op: Op) -> Result<Self> {
        let dtype = tensor.dtype();
        if !matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
            return Err(CommError::UnsupportedDtype { rank, op, dtype });
        }
        let ordinal = match home.location() {
            DeviceLocation::Cuda { gpu_id } => gpu_id,
            _ => usize::MAX,
        };
        match tensor.device() {
            Device::Cuda(dev) => {
                if tensor.device().location() != home.location() {
                    return Err(CommError::InvalidArgument {
                        rank,
                        op,
                        message: format!(
                            "tensor is on {:?}, this NCCL communicator on cuda:{ordinal}",
                            tensor.device().location()
                        ),
                    });
                }
                Ok(Self {
                    tensor: tensor.contiguous().at(rank, op)?,
                    device: dev.clone(),
                    from_host: false,
                })
            }
            Device::Cpu => {
                let device = home.as_cuda_device().at(rank, op)?.clone();
                let tensor = tensor
                    .contiguous()
                    .and_then(|t| t.to_device(home))
                    .at(rank, op)?;
                Ok(Self {
                    tensor,
                    device,
                    from_host: true,
                })
            }
            other => Err(CommError::InvalidArgument {
                rank,
                op,
                message: format!(
                    "NCCL communicates CUDA (or host) tensors, not tensors on {:?}",
                    other.location()
                ),
            }),
        }
    }

    /// Wraps `slice` (on [`Staged::device`]) as a tensor of `shape`, moved back to the host when
    /// the input came from there.
    pub(super) fn finish<T: Elem>(
        &self,
        slice: CudaSlice<T>,
        shape: impl Into<Shape>,
        rank: usize,
        op: Op,
    ) -> Result<Tensor> {
        let t = wrap(slice, &self.device, shape);
        if self.from_host {
            t.to_device(&Device::Cpu).at(rank, op)
        } else {
            Ok(t)
        }
    }
}

/// A tensor over `slice`, on `device`, without a gradient graph.
pub(super) fn wrap<T: Elem>(
    slice: CudaSlice<T>,
    device: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, device.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Runs `f` on the device elements of the contiguous CUDA tensor `tensor` (the storage stays
/// read-locked while `f` runs).
pub(super) fn with_view<T: Elem, R>(
    tensor: &Tensor,
    rank: usize,
    op: Op,
    f: impl FnOnce(CudaView<'_, T>) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            message: "internal: staged tensor is not on a CUDA device".to_string(),
        });
    };
    let start = layout.start_offset();
    let slice = cuda.as_cuda_slice::<T>().at(rank, op)?;
    let view = slice
        .try_slice(start..start + tensor.elem_count())
        .ok_or_else(|| CommError::InvalidArgument {
            rank,
            op,
            message: "internal: tensor layout outside its storage".to_string(),
        })?;
    f(view)
}

/// The header sent before a point-to-point payload.
pub(super) fn encode_header(tag: u32, dtype: DType, dims: &[usize]) -> [u64; HEADER_LEN] {
    let mut h = [0u64; HEADER_LEN];
    h[0] = u64::from(tag);
    h[1] = dtype_code(dtype);
    h[2] = dims.len() as u64;
    for (slot, &d) in h[3..].iter_mut().zip(dims) {
        *slot = d as u64;
    }
    h
}

/// Tag, dtype and dimensions of a received header, or what is wrong with it.
pub(super) fn decode_header(h: &[u64]) -> std::result::Result<(u32, DType, Vec<usize>), String> {
    if h.len() != HEADER_LEN {
        return Err(format!("header of {} words", h.len()));
    }
    let tag = u32::try_from(h[0]).map_err(|_| format!("tag {} in the header", h[0]))?;
    let dtype = dtype_from_code(h[1])
        .ok_or_else(|| format!("unknown dtype code {} in the header", h[1]))?;
    let ndim = usize::try_from(h[2]).unwrap_or(usize::MAX);
    if ndim > MAX_DIMS {
        return Err(format!("{ndim} dimensions in the header"));
    }
    let dims = h[3..3 + ndim]
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("dimension {d} in the header")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((tag, dtype, dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = encode_header(77, DType::BF16, &[3, 1, 4]);
        assert_eq!(decode_header(&h), Ok((77, DType::BF16, vec![3, 1, 4])));
        let h = encode_header(0, DType::F64, &[]);
        assert_eq!(decode_header(&h), Ok((0, DType::F64, vec![])));
        let mut bad = encode_header(1, DType::F32, &[2]);
        bad[1] = 99;
        assert!(decode_header(&bad).unwrap_err().contains("dtype code 99"));
        bad = encode_header(1, DType::F32, &[2]);
        bad[2] = 9;
        assert!(decode_header(&bad).unwrap_err().contains("9 dimensions"));
    }
}
