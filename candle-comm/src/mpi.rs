//! The MPI backend (feature `mpi`, on rsmpi): one process per rank, started by `mpirun`.
//!
//! Tensors are staged through host buffers (f32 for f32/bf16/f16, f64 for f64) and handed to
//! MPI's non-blocking collectives (`MPI_Iallreduce`, `MPI_Ireduce_scatter_block`,
//! `MPI_Iallgather`, `MPI_Ibcast`, `MPI_Ibarrier`, `MPI_Isend`/`MPI_Irecv`), which this rank
//! polls until they complete. Polling is what bounds every wait:
//!
//! - a rank that fails calls [`Communicator::abort`] (or [`or_abort`](crate::or_abort)): it
//!   writes `candle-comm: rank R of N failed: <reason>` to stderr and calls `MPI_Abort`, and
//!   `mpirun` terminates every process of the job, which exits non-zero;
//! - a rank that panics while it owns the [`MpiComm`] does the same from `Drop`;
//! - a rank that waits longer than its timeout (a peer hung, or died without aborting) writes
//!   `candle-comm: rank R of N: <op> timed out after <t> ...` and calls `MPI_Abort`. It cannot
//!   return an error instead: MPI still owns the buffers of the unfinished operation.
//!
//! [`MpiComm::split_group`] makes sub-communicators with `MPI_Comm_split`. Each is an `MpiComm`
//! sharing the MPI environment (finalised when the last one is dropped); its abort and timeout
//! lines name the rank in the world and in the group, and `MPI_Abort` still ends the whole job.

use std::cell::RefCell;
use std::io::Write;
use std::rc::Rc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::request::{Request, Scope, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Root, Source};

use crate::comm::{check_peer, check_tag, scatter_rows, Communicator, ReduceOp};
use crate::error::{CommError, Op, Result};
use crate::group::{group_wrapped_ops, plan, Membership};
use crate::host::{
    dtype_code, dtype_from_code, gathered_shape, stage, unstage, unstage_like, with_host, HostBuf,
    HostSlice,
};

/// Default time a rank waits for an MPI operation before aborting the job.
pub const DEFAULT_MPI_TIMEOUT: Duration = Duration::from_secs(300);

/// A collective over all ranks from the host slice `$buf` into a new buffer of `$n` elements of
/// its type: `$start` (with `$sc` the request scope, `$v` the slice, `$r` the new buffer) starts
/// the request, which `$comm` completes (or aborts the job); gives the [`HostBuf`].
macro_rules! all_ranks_into {
    ($comm:expr, $what:expr, $buf:expr, $n:expr, |$sc:ident, $v:ident, $r:ident| $start:expr) => {
        match $buf {
            HostSlice::F32($v) => {
                HostBuf::F32(all_ranks_into!(@run $comm, $what, 0f32, $n, |$sc, $r| $start))
            }
            HostSlice::F64($v) => {
                HostBuf::F64(all_ranks_into!(@run $comm, $what, 0f64, $n, |$sc, $r| $start))
            }
        }
    };
    (@run $comm:expr, $what:expr, $zero:expr, $n:expr, |$sc:ident, $r:ident| $start:expr) => {{
        let mut $r = vec![$zero; $n];
        mpi::request::scope(|$sc| {
            let req = $start;
            $comm.complete(req, $what, "all ranks");
        });
        $r
    }};
}

/// Exit code passed to `MPI_Abort`.
const ABORT_CODE: i32 = 3;

/// Most dimensions a tensor sent with [`Communicator::send`] may have.
const MAX_DIMS: usize = 8;

/// Time a rank polls without sleeping before it sleeps between polls.
const SPIN: Duration = Duration::from_secs(1);

/// This process's rank of `MPI_COMM_WORLD`, or of a sub-communicator (see the
/// [module documentation](self)).
///
/// Create one per process with [`MpiComm::init`]; MPI is finalized when it and every
/// sub-communicator made from it ([`MpiComm::split_group`]) are dropped.
pub struct MpiComm {
    /// `MPI_COMM_WORLD`, or the communicator of this rank's group.
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Sends not yet matched by their receiver (see [`InFlight`]).
    in_flight: RefCell<Vec<InFlight>>,
    /// Empty for the world; the world ranks of the group for a sub-communicator.
    group: Membership,
    // Dropped last (after `comm` is freed): the last owner finalizes MPI.
    _universe: Rc<mpi::environment::Universe>,
}

/// A send that has left [`Communicator::send`] but not yet reached its receiver, with the copy
/// of the data it reads (owned here until MPI is done with it).
///
/// `send` does not wait for the receiver: two neighbours that send to each other before
/// receiving (1F1B pipelines do) would otherwise both block once a message is larger than MPI's
/// eager limit. Completed sends are reaped at every later call, and all of them before MPI is
/// finalised; one that stays pending past the timeout aborts the job like any other wait.
enum InFlight {
    Header(PendingSend<u64>, *mut [u64], Instant),
    F32(PendingSend<f32>, *mut [f32], Instant),
    F64(PendingSend<f64>, *mut [f64], Instant),
}

/// The request of a send that reads a buffer made by [`leak`].
type PendingSend<T> = Request<'static, [T], StaticScope>;

impl InFlight {
    /// `None` once the send is complete (its buffer freed), else the send itself.
    fn test(self) -> Option<Self> {
        // SAFETY (each arm): `test` returned `Ok`, so the request is complete and MPI no longer
        // reads the buffer `leak` made for it; nothing else holds the pointer.
        match self {
            InFlight::Header(r, p, t) => match r.test() {
                Ok(_) => unsafe { reclaim(p) },
                Err(r) => return Some(InFlight::Header(r, p, t)),
            },
            InFlight::F32(r, p, t) => match r.test() {
                Ok(_) => unsafe { reclaim(p) },
                Err(r) => return Some(InFlight::F32(r, p, t)),
            },
            InFlight::F64(r, p, t) => match r.test() {
                Ok(_) => unsafe { reclaim(p) },
                Err(r) => return Some(InFlight::F64(r, p, t)),
            },
        }
        None
    }

    /// When the send started.
    fn since(&self) -> Instant {
        match self {
            InFlight::Header(.., t) | InFlight::F32(.., t) | InFlight::F64(.., t) => *t,
        }
    }
}

/// Leaks a copy of `data` for a request with the static scope; [`reclaim`] frees it.
fn leak<T: Copy>(data: &[T]) -> (&'static [T], *mut [T]) {
    let ptr = Box::into_raw(data.to_vec().into_boxed_slice());
    // SAFETY: `ptr` comes from `Box::into_raw` and is freed only by `reclaim`, after MPI has
    // completed the one request that reads it.
    (unsafe { &*ptr }, ptr)
}

/// Starts sending a copy of `data` (made by [`leak`]) to `to` without waiting: the [`InFlight`]
/// of variant `kind` that owns the request and the copy.
fn send_copy<T: Equivalence + Copy, D: Destination>(
    to: &D,
    data: &[T],
    tag: i32,
    now: Instant,
    kind: fn(PendingSend<T>, *mut [T], Instant) -> InFlight,
) -> InFlight {
    let (d, dp) = leak(data);
    kind(to.immediate_send_with_tag(StaticScope, d, tag), dp, now)
}

/// Frees a buffer made by [`leak`].
///
/// # Safety
/// `ptr` must come from [`leak`], its request must be complete, and it must not be used again.
unsafe fn reclaim<T>(ptr: *mut [T]) {
    drop(Box::from_raw(ptr));
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("group", &self.group.label())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl MpiComm {
    /// Initialises MPI (rank and size come from the MPI environment set up by `mpirun`; a
    /// process started without it is rank 0 of 1). Fails if MPI was already initialised.
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| CommError::Init {
            op: Op::Init,
            message: "MPI is already initialised in this process".to_string(),
        })?;
        let world = universe.world();
        let (rank, size) = (world.rank(), world.size());
        let bad = |what: &str, v: i32| CommError::Init {
            op: Op::Init,
            message: format!("MPI returned {what} {v}"),
        };
        Ok(Self {
            rank: usize::try_from(rank).map_err(|_| bad("rank", rank))?,
            size: usize::try_from(size).map_err(|_| bad("size", size))?,
            comm: world,
            timeout: DEFAULT_MPI_TIMEOUT,
            in_flight: RefCell::new(Vec::new()),
            group: Membership::default(),
            _universe: Rc::new(universe),
        })
    }

    /// [`Communicator::split_named`] as an `MpiComm`: one all-gather in which the ranks agree on
    /// the groups (and check colors and keys), then `MPI_Comm_split` (which, unlike the other
    /// operations, is not bounded by the timeout: every rank has reached the split by then). The
    /// new communicator has this one's timeout.
    pub fn split_group(&self, name: &str, color: usize, key: usize) -> Result<MpiComm> {
        self.group.wrap(self.raw_split(name, color, key))
    }

    fn raw_split(&self, name: &str, color: usize, key: usize) -> Result<MpiComm> {
        let (rank, op) = (self.rank, Op::Split);
        let gather = |t: &Tensor| self.raw_all_gather(t);
        let p = plan(rank, self.size, &self.group, name, color, key, gather)?;
        let group_size = p.groups[p.mine].len();
        // `plan` checked that color and key fit an i32 on every rank.
        let (c, k) = (color as i32, key as i32);
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(c), k)
            .ok_or_else(|| CommError::InvalidArgument {
                rank,
                op,
                message: format!("MPI_Comm_split gave no communicator for color {color}"),
            })?;
        let (r, n) = (comm.rank(), comm.size());
        if usize::try_from(r) != Ok(p.rank) || usize::try_from(n) != Ok(group_size) {
            return Err(CommError::InvalidArgument {
                rank,
                op,
                message: format!(
                    "MPI_Comm_split made rank {r} of {n}, the agreed group has rank {} of \
                     {group_size}",
                    p.rank
                ),
            });
        }
        Ok(MpiComm {
            comm,
            rank: p.rank,
            size: group_size,
            timeout: self.timeout,
            in_flight: RefCell::new(Vec::new()),
            group: p.membership,
            _universe: Rc::clone(&self._universe),
        })
    }

    /// Sets how long an operation may wait for its peers before the job is aborted
    /// (default [`DEFAULT_MPI_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The timeout after which a waiting operation aborts the job.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The underlying rsmpi communicator (`MPI_COMM_WORLD`, or the group's), for MPI calls this
    /// crate does not wrap (calls made through it are not bounded by this communicator's
    /// timeout).
    pub fn raw(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// Writes the reason to stderr and aborts the whole MPI job: `candle-comm: rank R of N
    /// failed: ...`, or `candle-comm: world rank W of N (rank R of n in NAME COLOR) failed: ...`
    /// on a sub-communicator.
    fn fatal(&self, reason: &str) -> ! {
        let line = format!(
            "candle-comm: {} failed: {reason}; calling MPI_Abort\n",
            self.group.describe(self.rank, self.size)
        );
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(line.as_bytes());
        let _ = err.flush();
        SimpleCommunicator::world().abort(ABORT_CODE)
    }

    /// Polls `req` until it completes; aborts the job after the timeout.
    fn complete<'a, D: ?Sized, S: Scope<'a>>(&self, req: Request<'a, D, S>, op: Op, peer: &str) {
        let start = Instant::now();
        let mut req = req;
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            let waited = start.elapsed();
            if waited > self.timeout {
                self.fatal(&format!(
                    "{op} timed out after {:?} waiting for {peer} (a peer is hung, or died \
                     without aborting)",
                    self.timeout
                ));
            }
            if waited < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// All-reduce of host elements into a new buffer (divided by the world size for Mean).
    fn reduce_host(&self, buf: HostSlice<'_>, op: ReduceOp, what: Op) -> HostBuf {
        let sys = system_op(op);
        let mut out = all_ranks_into!(self, what, buf, v.len(), |sc, v, r| {
            self.comm.immediate_all_reduce_into(sc, v, &mut r[..], sys)
        });
        out.finish(op, self.size);
        out
    }
}

/// The MPI operation of a reduction (Mean reduces as Sum, then divides).
fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

impl MpiComm {
    /// Frees the buffers of completed sends; with `wait`, waits for every pending send first.
    /// A send pending longer than the timeout aborts the job.
    fn reap(&self, wait: bool) {
        loop {
            let pending = std::mem::take(&mut *self.in_flight.borrow_mut());
            let mut still = Vec::with_capacity(pending.len());
            for f in pending {
                match f.test() {
                    None => {}
                    Some(f) if f.since().elapsed() > self.timeout => self.fatal(&format!(
                        "{} timed out after {:?}: a message was never received (a peer is \
                         hung, or died without aborting)",
                        Op::Send,
                        self.timeout
                    )),
                    Some(f) => still.push(f),
                }
            }
            let done = still.is_empty();
            self.in_flight.borrow_mut().extend(still);
            if done || !wait {
                return;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.fatal("panicked");
        }
        // MPI must not be finalised while a send still reads its buffer.
        self.reap(true);
    }
}

/// The collectives without group context (the trait methods add it).
impl MpiComm {
    fn raw_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let what = Op::AllReduce;
        let out = with_host(tensor, self.rank, what, |buf| {
            self.reduce_host(buf, op, what)
        })?;
        unstage_like(out, tensor, self.rank, what)
    }

    fn raw_reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let what = Op::ReduceScatter;
        let rows = scatter_rows(self.rank, self.size, tensor)?;
        let block = tensor.elem_count() / self.size;
        let sys = system_op(op);
        let mut out = with_host(tensor, self.rank, what, |buf| {
            all_ranks_into!(self, what, buf, block, |sc, v, r| {
                self.comm
                    .immediate_reduce_scatter_block_into(sc, v, &mut r[..], sys)
            })
        })?;
        out.finish(op, self.size);
        let mut dims = tensor.dims().to_vec();
        dims[0] = rows;
        unstage(out, dims, tensor.dtype(), tensor.device(), self.rank, what)
    }

    fn raw_all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let what = Op::AllGather;
        let n = tensor.elem_count() * self.size;
        let out = with_host(tensor, self.rank, what, |buf| {
            all_ranks_into!(self, what, buf, n, |sc, v, r| {
                self.comm.immediate_all_gather_into(sc, v, &mut r[..])
            })
        })?;
        let dims = gathered_shape(tensor.dims(), self.size);
        unstage(out, dims, tensor.dtype(), tensor.device(), self.rank, what)
    }

    fn raw_broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let what = Op::Broadcast;
        check_peer(self.rank, self.size, root, what)?;
        let mut buf = stage(tensor, self.rank, what)?;
        let process = self.comm.process_at_rank(root as i32);
        let peer = format!("rank {root}");
        match &mut buf {
            HostBuf::F32(v) => mpi::request::scope(|sc| {
                self.complete(
                    process.immediate_broadcast_into(sc, &mut v[..]),
                    what,
                    &peer,
                )
            }),
            HostBuf::F64(v) => mpi::request::scope(|sc| {
                self.complete(
                    process.immediate_broadcast_into(sc, &mut v[..]),
                    what,
                    &peer,
                )
            }),
        }
        unstage_like(buf, tensor, self.rank, what)
    }

    fn raw_send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()> {
        let what = Op::Send;
        check_peer(self.rank, self.size, to, what)?;
        check_tag(self.rank, tag, what)?;
        let dims = tensor.dims();
        if dims.len() > MAX_DIMS {
            return Err(CommError::InvalidArgument {
                rank: self.rank,
                op: what,
                message: format!("{} dimensions, at most {MAX_DIMS} can be sent", dims.len()),
            });
        }
        let mut header = [0u64; MAX_DIMS + 2];
        header[0] = dtype_code(tensor.dtype());
        header[1] = dims.len() as u64;
        for (h, &d) in header[2..].iter_mut().zip(dims) {
            *h = d as u64;
        }
        let process = self.comm.process_at_rank(to as i32);
        let tag = tag as i32;
        // Dtype checked before the header goes out, so that the peer never waits for data.
        crate::host::wire_dtype(tensor.dtype(), self.rank, what)?;
        self.reap(false);
        let now = Instant::now();
        let sent = send_copy(&process, &header[..], tag, now, InFlight::Header);
        self.in_flight.borrow_mut().push(sent);
        with_host(tensor, self.rank, what, |buf| {
            let sent = match buf {
                HostSlice::F32(v) => send_copy(&process, v, tag, now, InFlight::F32),
                HostSlice::F64(v) => send_copy(&process, v, tag, now, InFlight::F64),
            };
            self.in_flight.borrow_mut().push(sent);
        })
    }

    fn raw_recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
        let what = Op::Recv;
        check_peer(self.rank, self.size, from, what)?;
        check_tag(self.rank, tag, what)?;
        let process = self.comm.process_at_rank(from as i32);
        let (tag, peer) = (tag as i32, format!("rank {from}"));
        let mut header = [0u64; MAX_DIMS + 2];
        mpi::request::scope(|sc| {
            let req = process.immediate_receive_into_with_tag(sc, &mut header[..], tag);
            self.complete(req, what, &peer)
        });
        let bad = |message: String| CommError::Mismatch {
            rank: self.rank,
            op: what,
            peer: from,
            message,
        };
        let dtype = dtype_from_code(header[0])
            .ok_or_else(|| bad(format!("unknown dtype code {} in the header", header[0])))?;
        let ndim = usize::try_from(header[1]).unwrap_or(usize::MAX);
        if ndim > MAX_DIMS {
            return Err(bad(format!("{ndim} dimensions in the header")));
        }
        let dims: Vec<usize> = header[2..2 + ndim].iter().map(|&d| d as usize).collect();
        let n: usize = dims.iter().product();
        let buf = match crate::host::wire_dtype(dtype, self.rank, what)? {
            candle_core::DType::F64 => {
                let mut v = vec![0f64; n];
                mpi::request::scope(|sc| {
                    let req = process.immediate_receive_into_with_tag(sc, &mut v[..], tag);
                    self.complete(req, what, &peer)
                });
                HostBuf::F64(v)
            }
            _ => {
                let mut v = vec![0f32; n];
                mpi::request::scope(|sc| {
                    let req = process.immediate_receive_into_with_tag(sc, &mut v[..], tag);
                    self.complete(req, what, &peer)
                });
                HostBuf::F32(v)
            }
        };
        unstage(buf, dims, dtype, device, self.rank, what)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    group_wrapped_ops!();

    fn barrier(&self) -> Result<()> {
        self.complete(self.comm.immediate_barrier(), Op::Barrier, "all ranks");
        Ok(())
    }

    fn split_named(&self, name: &str, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_group(name, color, key)?))
    }

    fn abort(&self, reason: &str) {
        self.fatal(reason)
    }
}
