//! A world of N ranks in one process: one thread per rank, connected by channels.
//!
//! Collectives gather to rank 0 (or from the broadcast root), which reduces in rank order and
//! sends the result back, so every rank gets bit-identical results. It exists to test algorithms
//! built on [`Communicator`] in a plain `cargo test`; it is not fast.
//!
//! [`ThreadComm::split_group`] makes sub-communicators: rank 0 of the split communicator creates
//! a fresh set of channels for every group and hands each rank its endpoint in a message.

use std::cell::{Cell, RefCell};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::comm::{check_peer, check_tag, scatter_rows, Communicator, ReduceOp};
use crate::error::{CandleContext, CommError, Op, Result};
use crate::group::{group_wrapped_ops, plan, Membership};
use crate::host::{gathered_shape, stage, unstage, unstage_like, HostBuf};

/// Default time a rank waits for a peer before [`CommError::Timeout`].
pub const DEFAULT_THREAD_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Collective(u64),
    Tagged(u32),
}

#[derive(Debug)]
enum Body {
    Data {
        buf: HostBuf,
        dims: Vec<usize>,
        dtype: DType,
    },
    Abort(String),
    /// The sender's endpoint was dropped: nothing more will come from it.
    Gone,
    /// The receiver's endpoint of a sub-communicator ([`ThreadComm::split_group`]).
    Endpoint(Endpoint),
}

/// The channels of one rank of a sub-communicator.
#[derive(Debug)]
struct Endpoint {
    peers: Vec<Sender<Msg>>,
    inbox: Receiver<Msg>,
}

#[derive(Debug)]
struct Msg {
    from: usize,
    key: Key,
    body: Body,
}

/// What one rank contributed to a collective.
struct Part {
    buf: HostBuf,
    dims: Vec<usize>,
    dtype: DType,
}

/// One rank of an in-process world (see the documentation of its module, `threads`).
///
/// Endpoints are `Send`: move each into its own thread, e.g. with [`run_threads`]. Dropping an
/// endpoint while its thread panics tells the other ranks that this one failed. A
/// sub-communicator ([`ThreadComm::split_group`]) is a `ThreadComm` with its own channels; its
/// errors name the rank in the world and in the group ([`CommError::InGroup`]).
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    peers: Vec<Sender<Msg>>,
    inbox: Receiver<Msg>,
    pending: RefCell<Vec<Msg>>,
    failed: RefCell<Option<(usize, String)>>,
    gone: RefCell<Vec<bool>>,
    seq: Cell<u64>,
    timeout: Duration,
    group: Membership,
}

impl ThreadComm {
    /// Connected endpoints of a world of `n` ranks; endpoint `r` is rank `r`. Each waits at most
    /// [`DEFAULT_THREAD_TIMEOUT`] for a peer.
    pub fn world(n: usize) -> Vec<ThreadComm> {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
        receivers
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| ThreadComm {
                rank,
                peers: senders.clone(),
                inbox,
                pending: RefCell::new(Vec::new()),
                failed: RefCell::new(None),
                gone: RefCell::new(vec![false; n]),
                seq: Cell::new(0),
                timeout: DEFAULT_THREAD_TIMEOUT,
                group: Membership::default(),
            })
            .collect()
    }

    /// [`Communicator::split_named`] as a `ThreadComm` (which, unlike the boxed result, is
    /// `Send`): every rank calls it; ranks with the same `color` form a group ordered by `key`,
    /// then by rank. The new communicator waits as long as this one.
    pub fn split_group(&self, name: &str, color: usize, key: usize) -> Result<ThreadComm> {
        self.group.wrap(self.raw_split(name, color, key))
    }

    fn raw_split(&self, name: &str, color: usize, key: usize) -> Result<ThreadComm> {
        let (rank, op) = (self.rank, Op::Split);
        let gather = |t: &Tensor| self.raw_all_gather(t);
        let p = plan(
            rank,
            self.world_size(),
            &self.group,
            name,
            color,
            key,
            gather,
        )?;
        let seq = self.next_seq();
        let endpoint = if rank == 0 {
            let mut mine = None;
            for members in &p.groups {
                let (senders, inboxes): (Vec<_>, Vec<_>) =
                    members.iter().map(|_| channel()).unzip();
                for (&r, inbox) in members.iter().zip(inboxes) {
                    let ep = Endpoint {
                        peers: senders.clone(),
                        inbox,
                    };
                    if r == rank {
                        mine = Some(ep);
                    } else {
                        self.post(r, Key::Collective(seq), Body::Endpoint(ep), op)?;
                    }
                }
            }
            mine
        } else {
            match self.wait_body(0, Key::Collective(seq), op)? {
                Body::Endpoint(ep) => Some(ep),
                _ => None,
            }
        };
        let Endpoint { peers, inbox } = endpoint.ok_or_else(|| CommError::Mismatch {
            rank,
            op,
            peer: 0,
            message: "no sub-communicator endpoint arrived for this rank".to_string(),
        })?;
        let size = peers.len();
        Ok(ThreadComm {
            rank: p.rank,
            peers,
            inbox,
            pending: RefCell::new(Vec::new()),
            failed: RefCell::new(None),
            gone: RefCell::new(vec![false; size]),
            seq: Cell::new(0),
            timeout: self.timeout,
            group: p.membership,
        })
    }

    /// Sets how long this rank waits for a peer before [`CommError::Timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn next_seq(&self) -> u64 {
        let s = self.seq.get();
        self.seq.set(s + 1);
        s
    }

    /// Sends to `to`. If its endpoint is gone, a failure some rank reported before (an abort
    /// message already in this rank's inbox) is returned in preference: a rank that aborts and
    /// then ends is reported with its reason, whichever this rank notices first.
    fn post(&self, to: usize, key: Key, body: Body, op: Op) -> Result<()> {
        let msg = Msg {
            from: self.rank,
            key,
            body,
        };
        if self.peers[to].send(msg).is_ok() {
            return Ok(());
        }
        while let Ok(m) = self.inbox.try_recv() {
            match m.body {
                Body::Abort(message) => {
                    self.failed.borrow_mut().get_or_insert((m.from, message));
                }
                Body::Gone => self.gone.borrow_mut()[m.from] = true,
                _ => self.pending.borrow_mut().push(m),
            }
        }
        let (peer, message) = self.failed.borrow().clone().unwrap_or_else(|| {
            (
                to,
                "its endpoint is gone (the rank's thread ended)".to_string(),
            )
        });
        Err(CommError::PeerFailed {
            rank: self.rank,
            op,
            peer,
            message,
        })
    }

    /// Waits for the tensor `key` from `from`, keeping other messages for later.
    fn wait(&self, from: usize, key: Key, op: Op) -> Result<Part> {
        match self.wait_body(from, key, op)? {
            Body::Data { buf, dims, dtype } => Ok(Part { buf, dims, dtype }),
            _ => Err(CommError::Mismatch {
                rank: self.rank,
                op,
                peer: from,
                message: "a communicator endpoint arrived where a tensor was expected".to_string(),
            }),
        }
    }

    /// Waits for the message `key` from `from`, keeping the others for later.
    fn wait_body(&self, from: usize, key: Key, op: Op) -> Result<Body> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some((peer, message)) = self.failed.borrow().clone() {
                return Err(CommError::PeerFailed {
                    rank: self.rank,
                    op,
                    peer,
                    message,
                });
            }
            let found = {
                let mut pending = self.pending.borrow_mut();
                let pos = pending.iter().position(|m| m.from == from && m.key == key);
                pos.map(|p| pending.remove(p))
            };
            if let Some(msg) = found {
                return Ok(msg.body);
            }
            if self.gone.borrow()[from] {
                return Err(CommError::PeerFailed {
                    rank: self.rank,
                    op,
                    peer: from,
                    message: "its endpoint was dropped (the rank returned or exited)".to_string(),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(left) {
                Ok(Msg {
                    from: peer,
                    body: Body::Abort(message),
                    ..
                }) => {
                    *self.failed.borrow_mut() = Some((peer, message));
                }
                Ok(Msg {
                    from: peer,
                    body: Body::Gone,
                    ..
                }) => self.gone.borrow_mut()[peer] = true,
                Ok(msg) => self.pending.borrow_mut().push(msg),
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::Timeout {
                        rank: self.rank,
                        op,
                        peer: from,
                        after: self.timeout,
                    })
                }
            }
        }
    }

    /// Fails (and tells the others) when a peer's part differs from this rank's.
    fn check_part(&self, mine: &Part, theirs: &Part, peer: usize, op: Op) -> Result<()> {
        let same = if op == Op::AllReduce || op == Op::ReduceScatter || op == Op::AllGather {
            mine.dims == theirs.dims && mine.dtype == theirs.dtype
        } else {
            mine.buf.same_layout(&theirs.buf)
        };
        if same {
            return Ok(());
        }
        let message = format!(
            "rank {} passed {:?} {:?}, rank {peer} passed {:?} {:?}",
            self.rank, mine.dtype, mine.dims, theirs.dtype, theirs.dims
        );
        self.abort(&format!("{op}: {message}"));
        Err(CommError::Mismatch {
            rank: self.rank,
            op,
            peer,
            message,
        })
    }

    /// Gathers every rank's part at rank 0 (in rank order); `None` on the other ranks.
    fn gather(&self, seq: u64, mine: Part, op: Op) -> Result<Option<Vec<Part>>> {
        if self.rank != 0 {
            let body = Body::Data {
                buf: mine.buf,
                dims: mine.dims,
                dtype: mine.dtype,
            };
            self.post(0, Key::Collective(seq), body, op)?;
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(self.peers.len());
        for peer in 1..self.peers.len() {
            let part = self.wait(peer, Key::Collective(seq), op)?;
            self.check_part(&mine, &part, peer, op)?;
            parts.push(part);
        }
        parts.insert(0, mine);
        Ok(Some(parts))
    }

    /// Sends `buf` from `root` to every rank; returns it everywhere.
    fn bcast(&self, seq: u64, root: usize, buf: Option<HostBuf>, op: Op) -> Result<HostBuf> {
        match buf {
            Some(buf) if self.rank == root => {
                for peer in (0..self.peers.len()).filter(|&p| p != root) {
                    let body = Body::Data {
                        buf: buf.clone(),
                        dims: Vec::new(),
                        dtype: DType::F32,
                    };
                    self.post(peer, Key::Collective(seq), body, op)?;
                }
                Ok(buf)
            }
            _ => Ok(self.wait(root, Key::Collective(seq), op)?.buf),
        }
    }

    fn reduce(&self, tensor: &Tensor, op: ReduceOp, what: Op) -> Result<HostBuf> {
        let mine = self.part(tensor, what)?;
        let seq = self.next_seq();
        let reduced = self.gather(seq, mine, what)?.map(|parts| {
            let mut it = parts.into_iter();
            let mut acc = it.next().map(|p| p.buf).unwrap_or(HostBuf::F32(Vec::new()));
            for p in it {
                acc.combine(&p.buf, op);
            }
            acc.finish(op, self.peers.len());
            acc
        });
        self.bcast(seq, 0, reduced, what)
    }

    fn part(&self, tensor: &Tensor, op: Op) -> Result<Part> {
        Ok(Part {
            buf: stage(tensor, self.rank, op)?,
            dims: tensor.dims().to_vec(),
            dtype: tensor.dtype(),
        })
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("panicked");
            return;
        }
        for (peer, tx) in self.peers.iter().enumerate() {
            if peer != self.rank {
                let msg = Msg {
                    from: self.rank,
                    key: Key::Collective(u64::MAX),
                    body: Body::Gone,
                };
                let _ = tx.send(msg);
            }
        }
    }
}

/// The collectives without group context (the trait methods add it).
impl ThreadComm {
    fn raw_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let buf = self.reduce(tensor, op, Op::AllReduce)?;
        unstage_like(buf, tensor, self.rank, Op::AllReduce)
    }

    fn raw_reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let rows = scatter_rows(self.rank, self.world_size(), tensor)?;
        let full = self.reduce(tensor, op, Op::ReduceScatter)?;
        let block = full.len() / self.world_size();
        let mut dims = tensor.dims().to_vec();
        dims[0] = rows;
        let mine = full.slice(self.rank * block, block);
        unstage(
            mine,
            dims,
            tensor.dtype(),
            tensor.device(),
            self.rank,
            Op::ReduceScatter,
        )
    }

    fn raw_all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let mine = self.part(tensor, Op::AllGather)?;
        let seq = self.next_seq();
        let gathered = self
            .gather(seq, mine, Op::AllGather)?
            .map(|parts| HostBuf::concat(&parts.into_iter().map(|p| p.buf).collect::<Vec<_>>()));
        let buf = self.bcast(seq, 0, gathered, Op::AllGather)?;
        let dims = gathered_shape(tensor.dims(), self.world_size());
        unstage(
            buf,
            dims,
            tensor.dtype(),
            tensor.device(),
            self.rank,
            Op::AllGather,
        )
    }

    fn raw_broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        check_peer(self.rank, self.world_size(), root, Op::Broadcast)?;
        let seq = self.next_seq();
        if self.rank == root {
            let buf = stage(tensor, self.rank, Op::Broadcast)?;
            self.bcast(seq, root, Some(buf), Op::Broadcast)?;
            return tensor.copy().at(self.rank, Op::Broadcast);
        }
        let buf = self.bcast(seq, root, None, Op::Broadcast)?;
        let expected = crate::host::wire_dtype(tensor.dtype(), self.rank, Op::Broadcast)?;
        let ok_type = matches!(
            (&buf, expected),
            (HostBuf::F32(_), DType::F32) | (HostBuf::F64(_), DType::F64)
        );
        if !ok_type || buf.len() != tensor.elem_count() {
            return Err(CommError::Mismatch {
                rank: self.rank,
                op: Op::Broadcast,
                peer: root,
                message: format!(
                    "root sent {} elements, this rank expected {:?} {:?}",
                    buf.len(),
                    tensor.dtype(),
                    tensor.dims()
                ),
            });
        }
        unstage_like(buf, tensor, self.rank, Op::Broadcast)
    }

    fn raw_send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()> {
        check_peer(self.rank, self.world_size(), to, Op::Send)?;
        check_tag(self.rank, tag, Op::Send)?;
        let Part { buf, dims, dtype } = self.part(tensor, Op::Send)?;
        self.post(
            to,
            Key::Tagged(tag),
            Body::Data { buf, dims, dtype },
            Op::Send,
        )
    }

    fn raw_recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
        check_peer(self.rank, self.world_size(), from, Op::Recv)?;
        check_tag(self.rank, tag, Op::Recv)?;
        let Part { buf, dims, dtype } = self.wait(from, Key::Tagged(tag), Op::Recv)?;
        unstage(buf, dims, dtype, device, self.rank, Op::Recv)
    }

    fn raw_barrier(&self) -> Result<()> {
        let seq = self.next_seq();
        let mine = Part {
            buf: HostBuf::F32(Vec::new()),
            dims: vec![0],
            dtype: DType::F32,
        };
        let done = self
            .gather(seq, mine, Op::Barrier)?
            .map(|_| HostBuf::F32(Vec::new()));
        self.bcast(seq, 0, done, Op::Barrier).map(|_| ())
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.peers.len()
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    group_wrapped_ops!();

    fn barrier(&self) -> Result<()> {
        self.group.wrap(self.raw_barrier())
    }

    fn split_named(&self, name: &str, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_group(name, color, key)?))
    }

    fn abort(&self, reason: &str) {
        for (peer, tx) in self.peers.iter().enumerate() {
            if peer != self.rank {
                let body = Body::Abort(reason.to_string());
                let _ = tx.send(Msg {
                    from: self.rank,
                    key: Key::Collective(u64::MAX),
                    body,
                });
            }
        }
    }
}

/// Runs `f` on `n` threads, each with its own rank of a [`ThreadComm::world`] waiting at most
/// `timeout` for a peer; returns each rank's outcome in rank order (`Err` if it panicked).
pub fn run_threads<T, F>(n: usize, timeout: Duration, f: F) -> Vec<std::thread::Result<T>>
where
    T: Send,
    F: Fn(ThreadComm) -> T + Sync,
{
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::world(n)
            .into_iter()
            .map(|c| s.spawn(move || f(c.with_timeout(timeout))))
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    })
}
