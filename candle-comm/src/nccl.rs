//! The NCCL backend (feature `nccl`, on cudarc's NCCL bindings): one process (or thread) per GPU,
//! tensors stay on the device. See [`NcclComm`].

mod buf;
mod link;
mod ops;
mod setup;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use candle_core::cuda::cudarc::nccl::result::NcclError;
use candle_core::cuda::cudarc::nccl::Comm;
use candle_core::cuda::CudaDevice;
use candle_core::{Device, Tensor};

use crate::comm::Communicator;
use crate::error::{CommError, Op, Result};
use buf::{device_error, nccl_text};
use link::{Half, Link};
use setup::{report, IdBlob, Notice, Watchdog, ABORT_CODE};

/// Default time a rank waits for an NCCL operation (or for communicator setup) before it exits.
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(300);

/// Time a rank polls without sleeping before it sleeps between polls.
const SPIN: Duration = Duration::from_secs(1);

/// How often a waiting rank looks for another rank's abort notice.
const NOTICE_POLL: Duration = Duration::from_millis(100);

/// How long `ncclCommAbort` may take before a failing rank exits anyway.
const ABORT_GRACE: Duration = Duration::from_secs(10);

/// Options of an [`NcclComm`]; made by [`NcclComm::builder`].
#[derive(Debug, Clone)]
pub struct NcclBuilder {
    ordinal: usize,
    timeout: Duration,
    p2p: bool,
}

impl NcclBuilder {
    /// How long an operation, or the setup, may wait for its peers before this rank exits
    /// (default [`DEFAULT_NCCL_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether to set up point-to-point links (default on): `2 * (world - 1)` two-rank NCCL
    /// communicators per rank, each with a CUDA stream, connected during setup. Turn it off when
    /// only collectives are used (large worlds); `send`/`recv` to another rank then fail. Every
    /// rank must use the same setting (checked during setup).
    pub fn p2p(mut self, on: bool) -> Self {
        self.p2p = on;
        self
    }

    /// Joins the world of `world` ranks as `rank` through the rendezvous file `path`: rank 0
    /// writes the NCCL unique ids there (atomically: a temporary file renamed into place) and
    /// removes the file once every rank has joined; the other ranks wait for it up to the
    /// timeout. Use a fresh path for every run (a stale file from a crashed run would be read).
    pub fn connect_file(
        self,
        path: impl AsRef<Path>,
        rank: usize,
        world: usize,
    ) -> Result<NcclComm> {
        let path = path.as_ref();
        if world == 0 || rank >= world {
            return Err(init_error(format!(
                "rank {rank} is out of range for a world of {world}"
            )));
        }
        let device = open_device(self.ordinal, rank)?;
        let blob = if rank == 0 {
            let blob = IdBlob::generate(world, self.p2p)?;
            setup::write_rendezvous(path, &blob)?;
            blob
        } else {
            setup::read_rendezvous(path, world, self.p2p, self.timeout)?
        };
        let notice = Notice::new(path, blob.nonce());
        let comm = NcclComm::connect(&self, device, rank, &blob, Some(notice))?;
        if rank == 0 {
            // Every rank has read the ids: the world communicator could not exist otherwise.
            let _ = std::fs::remove_file(path);
        }
        Ok(comm)
    }

    /// Joins the world of `comm` (same rank and size): rank 0 makes the NCCL unique ids and
    /// broadcasts them with `comm` (MPI, or a thread world with one GPU per thread).
    pub fn connect_with<C: Communicator + ?Sized>(self, comm: &C) -> Result<NcclComm> {
        let rank = comm.rank();
        let device = open_device(self.ordinal, rank)?;
        let blob = setup::exchange(comm, self.p2p)?;
        NcclComm::connect(&self, device, rank, &blob, None)
    }
}

fn init_error(message: String) -> CommError {
    CommError::Init {
        op: Op::Init,
        message,
    }
}

fn open_device(ordinal: usize, rank: usize) -> Result<Device> {
    Device::new_cuda(ordinal).map_err(|e| {
        init_error(format!(
            "rank {rank}: cannot open CUDA device {ordinal}: {e}"
        ))
    })
}

/// The NCCL major, minor and patch version of the linked `libnccl`.
pub fn nccl_version() -> Option<(u32, u32, u32)> {
    let code = candle_core::cuda::cudarc::nccl::result::get_nccl_version().ok()?;
    let code = u32::try_from(code).ok()?;
    Some((code / 10_000, code / 100 % 100, code % 100))
}

/// The error of an operation on an aborted communicator.
fn aborted(rank: usize, op: Op) -> CommError {
    CommError::InvalidArgument {
        rank,
        op,
        message: "the NCCL communicator was aborted".to_string(),
    }
}

/// A send not yet known to be complete, with the buffers it reads.
struct InFlight {
    done: CudaEvent,
    since: Instant,
    to: usize,
    _header: CudaSlice<u64>,
    _data: Option<Tensor>,
}

/// This rank of an NCCL world (feature `nccl`): one process (or thread) per GPU, tensors stay
/// on the device.
///
/// It owns one NCCL communicator over all ranks, used for the collectives on the CUDA
/// stream of its Candle device, and (unless [`NcclBuilder::p2p`] is off) two two-rank
/// communicators per peer, each on a stream of its own, for [`Communicator::send`] and
/// [`Communicator::recv`]: a send waits on its own stream for the peer's receive, so two ranks may
/// send to each other before either receives, and a pending send never blocks the collectives.
/// The unique ids are made by rank 0 and reach the other ranks through a rendezvous file
/// ([`NcclComm::from_file`]) or another communicator ([`NcclComm::from_communicator`], e.g. MPI).
///
/// Every call returns once its NCCL operation has completed on the GPU: this rank polls a CUDA
/// event, which is what bounds every wait:
///
/// - a rank that fails calls [`Communicator::abort`] (or [`or_abort`](crate::or_abort)): it writes
///   `candle-comm: rank R of N failed: <reason>; aborting NCCL` to stderr, leaves the reason in
///   `<rendezvous file>.abort` (file rendezvous only), aborts its NCCL communicators
///   (`ncclCommAbort`) and exits with status 3;
/// - a rank that panics while it owns the [`NcclComm`] does the same from `Drop`;
/// - a rank waiting for a peer looks for that notice every 100 ms and exits (status 3) with
///   `rank R of N: <op>: rank P failed: <reason>`; under `mpirun` (MPI bootstrap), the launcher
///   ends the job when any rank exits non-zero;
/// - a rank that waits longer than its timeout (a peer hung, or died without a notice) exits the
///   same way with `<op> timed out after <t> waiting for <peer>`. NCCL cannot report which peer
///   is missing from a collective, and the safe cudarc API does not expose
///   `ncclCommGetAsyncError`, so a dead peer is noticed by the timeout, not sooner.
///
/// Tensors may be f32, f64, bf16 or f16, on this communicator's GPU (results come back on the
/// input's device, in its dtype) or on the host (staged through the GPU and back: the small
/// control messages of [`GradBuckets`](crate::GradBuckets) and [`check_in_sync`](crate::check_in_sync)
/// travel so). Unlike the host-staged backends, bf16/f16 are reduced by NCCL in their own
/// dtype (and `Mean` is `ncclAvg`), so a bf16 sum over many ranks can round more than once.
pub struct NcclComm {
    rank: usize,
    size: usize,
    timeout: Duration,
    p2p: bool,
    device: Device,
    cuda: CudaDevice,
    /// Stream of `device`, on which the collectives run.
    stream: Arc<CudaStream>,
    /// `None` once aborted.
    comm: RefCell<Option<Comm>>,
    /// By peer rank; `None` for this rank, and for every peer when p2p is off.
    links: RefCell<Vec<Option<Link>>>,
    /// Messages received while waiting for another tag (and messages to self), by (from, tag).
    mailbox: RefCell<HashMap<(usize, u32), VecDeque<Tensor>>>,
    in_flight: RefCell<Vec<InFlight>>,
    notice: Option<Notice>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device.location())
            .field("timeout", &self.timeout)
            .field("p2p", &self.p2p)
            .finish()
    }
}

impl NcclComm {
    /// Creates the communicators (bounded by a watchdog: NCCL's setup calls block).
    fn connect(
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

    /// Options for a communicator on CUDA device `ordinal` (usually the node-local rank).
    pub fn builder(ordinal: usize) -> NcclBuilder {
        NcclBuilder {
            ordinal,
            timeout: DEFAULT_NCCL_TIMEOUT,
            p2p: true,
        }
    }

    /// [`NcclBuilder::connect_file`] with the default options.
    pub fn from_file(
        path: impl AsRef<Path>,
        rank: usize,
        world: usize,
        ordinal: usize,
    ) -> Result<Self> {
        Self::builder(ordinal).connect_file(path, rank, world)
    }

    /// [`NcclBuilder::connect_with`] with the default options.
    pub fn from_communicator<C: Communicator + ?Sized>(comm: &C, ordinal: usize) -> Result<Self> {
        Self::builder(ordinal).connect_with(comm)
    }

    /// The NCCL world of an MPI job (rank 0's ids are broadcast over MPI); `ordinal` is this
    /// rank's GPU, usually its node-local rank. The [`MpiComm`](crate::MpiComm) is only used
    /// during setup and may be dropped afterwards.
    #[cfg(feature = "mpi")]
    pub fn from_mpi(mpi: &crate::mpi::MpiComm, ordinal: usize) -> Result<Self> {
        Self::builder(ordinal).connect_with(mpi)
    }

    /// Sets how long an operation may wait for its peers before this rank exits.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The timeout after which a waiting operation ends the process.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// This rank's CUDA device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether point-to-point links were set up (see [`NcclBuilder::p2p`]).
    pub fn has_p2p(&self) -> bool {
        self.p2p
    }

    /// Writes `message` to stderr, leaves `notice` for the other ranks (file rendezvous), aborts
    /// the NCCL communicators and exits with status 3.
    fn die(&self, message: &str, notice: Option<&str>) -> ! {
        report(&format!("{message}; aborting NCCL"));
        if let (Some(n), Some(reason)) = (&self.notice, notice) {
            n.post(self.rank, reason);
        }
        let _watchdog = Watchdog::arm(
            ABORT_GRACE,
            format!("rank {}: ncclCommAbort did not return; exiting", self.rank),
        );
        // cudarc's `Comm` calls ncclCommAbort when dropped (and panics if it fails).
        if let Ok(mut c) = self.comm.try_borrow_mut() {
            if let Some(c) = c.take() {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(c)));
            }
        }
        if let Ok(mut links) = self.links.try_borrow_mut() {
            for link in links.drain(..).flatten() {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(link)));
            }
        }
        std::process::exit(ABORT_CODE)
    }

    /// Exits when another rank of this run left an abort notice.
    fn check_notice(&self, op: Op) {
        if let Some((peer, reason)) = self.notice.as_ref().and_then(Notice::read) {
            if peer != self.rank {
                self.die(
                    &format!(
                        "rank {} of {}: {op}: rank {peer} failed: {reason}",
                        self.rank, self.size
                    ),
                    None,
                );
            }
        }
    }

    fn cuda_error(&self, op: Op, e: impl std::fmt::Debug) -> CommError {
        device_error(self.rank, op, format!("CUDA {e:?}"))
    }

    /// Polls until the work queued on `stream` so far is done; exits after the timeout.
    fn wait(&self, stream: &CudaStream, op: Op, peer: &str) -> Result<()> {
        let done = stream
            .record_event(None)
            .map_err(|e| self.cuda_error(op, e))?;
        let start = Instant::now();
        let mut next_notice = start + NOTICE_POLL;
        loop {
            if done.try_is_complete().map_err(|e| self.cuda_error(op, e))? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= next_notice {
                self.check_notice(op);
                next_notice = now + NOTICE_POLL;
            }
            let waited = now - start;
            if waited > self.timeout {
                let why = format!("{op} timed out after {:?} waiting for {peer}", self.timeout);
                self.die(
                    &format!(
                        "rank {} of {} failed: {why} (a peer is hung, or died without aborting)",
                        self.rank, self.size
                    ),
                    Some(&why),
                );
            }
            if waited < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Makes `waiter` wait for the work queued on `on` so far (nothing when they are the same).
    fn join(&self, waiter: &CudaStream, on: &CudaStream, op: Op) -> Result<()> {
        if waiter.cu_stream() == on.cu_stream() {
            return Ok(());
        }
        waiter.join(on).map_err(|e| self.cuda_error(op, e))
    }

    /// Frees the buffers of completed sends; with `wait`, waits for every pending send first.
    fn reap(&self, wait: bool) -> Result<()> {
        loop {
            let pending = std::mem::take(&mut *self.in_flight.borrow_mut());
            let mut still = Vec::with_capacity(pending.len());
            let mut error = None;
            for f in pending {
                match f.done.try_is_complete() {
                    Ok(true) => {}
                    Ok(false) if f.since.elapsed() > self.timeout => {
                        let why = format!(
                            "{} to rank {} timed out after {:?}: the message was never received",
                            Op::Send,
                            f.to,
                            self.timeout
                        );
                        self.die(
                            &format!("rank {} of {} failed: {why}", self.rank, self.size),
                            Some(&why),
                        )
                    }
                    Ok(false) => still.push(f),
                    Err(e) => {
                        error.get_or_insert(self.cuda_error(Op::Send, e));
                        still.push(f);
                    }
                }
            }
            let done = still.is_empty();
            self.in_flight.borrow_mut().extend(still);
            if let Some(e) = error {
                return Err(e);
            }
            if done || !wait {
                return Ok(());
            }
            self.check_notice(Op::Send);
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Runs `f` on the world communicator, mapping NCCL errors.
    fn with_comm<R>(
        &self,
        op: Op,
        f: impl FnOnce(&Comm) -> std::result::Result<R, NcclError>,
    ) -> Result<R> {
        let guard = self.comm.borrow();
        let comm = guard.as_ref().ok_or_else(|| aborted(self.rank, op))?;
        f(comm).map_err(|e| device_error(self.rank, op, nccl_text(&e)))
    }

    /// Runs `f` on the point-to-point link with `peer`, mapping NCCL errors.
    fn with_link<R>(
        &self,
        peer: usize,
        op: Op,
        f: impl FnOnce(&Link) -> std::result::Result<R, NcclError>,
    ) -> Result<R> {
        let links = self.links.borrow();
        let link = links
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| self.no_link(peer, op))?;
        f(link).map_err(|e| device_error(self.rank, op, nccl_text(&e)))
    }

    fn no_link(&self, peer: usize, op: Op) -> CommError {
        CommError::InvalidArgument {
            rank: self.rank,
            op,
            message: if self.p2p {
                format!("no point-to-point link to rank {peer} (communicator aborted?)")
            } else {
                "point-to-point transfers are off (NcclBuilder::p2p(false))".to_string()
            },
        }
    }

    /// The stream of the link with `peer` that sends (`true`) or receives.
    fn link_stream(&self, peer: usize, op: Op, sending: bool) -> Result<Arc<CudaStream>> {
        self.with_link(peer, op, |l| {
            Ok(if sending {
                l.send.stream.clone()
            } else {
                l.recv.stream.clone()
            })
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.die(
                &format!("rank {} of {} failed: panicked", self.rank, self.size),
                Some("panicked"),
            );
        }
        // Buffers of sends still in flight must outlive them.
        if let Err(e) = self.reap(true) {
            report(&format!("rank {}: {e}", self.rank));
        }
    }
}
