//! The point-to-point links of an [`NcclComm`](super::NcclComm): per peer, two two-rank NCCL
//! communicators, each on a CUDA stream of its own.

use std::sync::Arc;

use candle_core::cuda::cudarc::driver::{sys, CudaContext, CudaStream};
use candle_core::cuda::cudarc::nccl::{Comm, Id};
use candle_core::cuda::CudaDevice;

use super::buf::nccl_text;

/// A CUDA stream created for one point-to-point communicator and destroyed with it.
///
/// It is wrapped with `wrap_borrowed_stream`, not made with cudarc's `new_stream`: that would
/// switch the whole CUDA context (Candle's too) to multi-stream event tracking, an event record
/// per kernel argument. Ordering with Candle's stream is explicit instead (see `join`).
pub(super) struct RawStream {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
}

impl RawStream {
    fn new(ctx: &Arc<CudaContext>) -> std::result::Result<(Self, Arc<CudaStream>), String> {
        use candle_core::cuda::cudarc::driver::result::stream;
        ctx.bind_to_thread().map_err(|e| format!("CUDA {e:?}"))?;
        let raw =
            stream::create(stream::StreamKind::NonBlocking).map_err(|e| format!("CUDA {e:?}"))?;
        // SAFETY: `raw` is a live stream of `ctx`. The `RawStream` that destroys it is the last
        // field of its `Half`, so it outlives the communicator using the wrapper; other clones
        // of the wrapper live only during one operation of the `NcclComm` that owns the `Half`
        // (dropped with it, or in `die`, which then exits the process). Work on the stream is
        // ordered with Candle's stream by explicit joins.
        let wrapped = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok((
            Self {
                ctx: ctx.clone(),
                raw,
            },
            wrapped,
        ))
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: made by `stream::create` in `RawStream::new`, destroyed only here.
        let _ = unsafe { candle_core::cuda::cudarc::driver::result::stream::destroy(self.raw) };
    }
}

/// One direction of a point-to-point link: a two-rank communicator on a stream of its own.
pub(super) struct Half {
    pub(super) comm: Comm,
    pub(super) stream: Arc<CudaStream>,
    /// Destroyed after the communicator (fields drop in order).
    _raw: RawStream,
}

/// The two point-to-point communicators with one peer.
pub(super) struct Link {
    /// This rank (0 in it) sends to the peer (1).
    pub(super) send: Half,
    /// The peer (0 in it) sends to this rank (1).
    pub(super) recv: Half,
}

impl Half {
    /// Joins the two-rank communicator `id` as its sender (rank 0) or receiver (rank 1), on a
    /// new stream, and connects it with one tiny transfer: NCCL connects lazily, and a first
    /// send would otherwise wait on the host for the peer's first receive.
    pub(super) fn connect(
        cuda: &CudaDevice,
        sending: bool,
        id: Id,
    ) -> std::result::Result<Self, String> {
        let main = cuda.cuda_stream();
        let (raw, stream) = RawStream::new(main.context())?;
        let comm = Comm::from_rank(stream.clone(), usize::from(!sending), 2, id)
            .map_err(|e| nccl_text(&e))?;
        let mut probe = cuda.alloc_zeros::<u64>(1).map_err(|e| e.to_string())?;
        stream.join(&main).map_err(|e| format!("CUDA {e:?}"))?;
        let sent = if sending {
            comm.send(&probe, 1)
        } else {
            comm.recv(&mut probe, 0).map(|_| ())
        };
        sent.map_err(|e| nccl_text(&e))?;
        stream.synchronize().map_err(|e| format!("CUDA {e:?}"))?;
        Ok(Self {
            comm,
            stream,
            _raw: raw,
        })
    }
}
