//! Creating the NCCL communicators of an [`NcclComm`], and the streams of its point-to-point
//! links.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda::cudarc::driver::{sys, CudaContext, CudaStream};
use candle_core::cuda::cudarc::nccl::{Comm, Id};
use candle_core::cuda::CudaDevice;
use candle_core::Device;

use super::buf::nccl_text;
use super::setup::{IdBlob, Notice, Watchdog};
use super::{init_error, NcclBuilder, NcclComm};
use crate::error::Result;

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

impl NcclComm {
    /// Creates the communicators (bounded by a watchdog: NCCL's setup calls block).
    pub(super) fn connect(
        opts: &NcclBuilder,
        device: Device,
        rank: usize,
        blob: &IdBlob,
        notice: Option<Notice>,
    ) -> Result<Self> {
        let world = blob.world;
        let cuda = device
            .as_cuda_device()
            .map_err(|e| init_error(e.to_string()))?
            .clone();
        let stream = cuda.cuda_stream();
        let ctx = stream.context().clone();
        let _watchdog = Watchdog::arm(
            opts.timeout,
            format!(
                "rank {rank} of {world}: NCCL setup did not finish within {:?} (a rank is \
                 missing, or read a stale rendezvous file); exiting",
                opts.timeout
            ),
        );
        let failed = |what: &str, e: String| init_error(format!("rank {rank}: {what}: {e}"));
        ctx.bind_to_thread()
            .map_err(|e| failed("binding the CUDA context", format!("{e:?}")))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, blob.world_id())
            .map_err(|e| failed("ncclCommInitRank (world)", nccl_text(&e)))?;
        // Ordered pairs in one global order: both members of the pair being set up are always
        // there (they finished every earlier pair), so no rank waits on a rank that waits on it.
        let mut halves: Vec<[Option<Half>; 2]> = (0..world).map(|_| [None, None]).collect();
        for from in 0..world {
            for to in 0..world {
                if from == to || (rank != from && rank != to) {
                    continue;
                }
                let Some(id) = blob.pair(from, to) else {
                    continue;
                };
                let what = format!("point-to-point link {from} -> {to}");
                let half = Half::connect(&cuda, rank == from, id).map_err(|e| failed(&what, e))?;
                let (slot, peer) = if rank == from { (0, to) } else { (1, from) };
                halves[peer][slot] = Some(half);
            }
        }
        let links = halves
            .into_iter()
            .map(|h| match h {
                [Some(send), Some(recv)] => Some(Link { send, recv }),
                _ => None,
            })
            .collect();
        Ok(Self {
            rank,
            size: world,
            timeout: opts.timeout,
            p2p: blob.p2p,
            device,
            cuda,
            stream,
            comm: RefCell::new(Some(comm)),
            links: RefCell::new(links),
            mailbox: RefCell::new(HashMap::new()),
            in_flight: RefCell::new(Vec::new()),
            notice,
        })
    }
}

impl Half {
    /// Joins the two-rank communicator `id` as its sender (rank 0) or receiver (rank 1), on a
    /// new stream, and connects it with one tiny transfer: NCCL connects lazily, and a first
    /// send would otherwise wait on the host for the peer's first receive.
    fn connect(cuda: &CudaDevice, sending: bool, id: Id) -> std::result::Result<Self, String> {
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
