//! The [`Communicator`] trait: collectives and point-to-point transfers over Candle tensors.

use std::fmt;

use candle_core::{Device, Tensor};

use crate::error::{CommError, Op, Result};

/// Largest tag accepted by [`Communicator::send`] / [`Communicator::recv`] (the smallest upper
/// bound the MPI standard guarantees for `MPI_TAG_UB`).
pub const MAX_TAG: u32 = 32_767;

/// How [`Communicator::all_reduce`] and [`Communicator::reduce_scatter`] combine the ranks'
/// tensors element-wise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks divided by the world size (divided on the host in f32/f64, before the
    /// result is narrowed back to bf16/f16).
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// One rank's endpoint of a group of `world_size` ranks that exchange Candle tensors.
///
/// Every rank must call the same collectives in the same order with tensors of the same shape
/// and dtype (the thread backend checks this and returns [`CommError::Mismatch`]; MPI does not).
/// Tensors may be f32, f64, bf16 or f16 on any [`Device`]: backends stage them through the host,
/// and bf16/f16 travel and are reduced as f32 (exact round trip, one rounding at the end).
/// Results are new tensors with the input's dtype, on the input's device.
///
/// Failure behaviour: a rank that fails should call [`Communicator::abort`] (or use
/// [`or_abort`]) so that every other rank stops with an error naming it instead of waiting
/// forever; waits are also bounded by the backend's timeout. See the crate documentation.
pub trait Communicator {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Short name of the backend (`"local"`, `"threads"`, `"mpi"`).
    fn backend(&self) -> &'static str;

    /// Element-wise reduction of `tensor` over all ranks; every rank gets the same result.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// [`all_reduce`](Communicator::all_reduce) with [`ReduceOp::Sum`].
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor> {
        self.all_reduce(tensor, ReduceOp::Sum)
    }

    /// [`all_reduce`](Communicator::all_reduce) with [`ReduceOp::Mean`] (gradient averaging).
    fn all_reduce_mean(&self, tensor: &Tensor) -> Result<Tensor> {
        self.all_reduce(tensor, ReduceOp::Mean)
    }

    /// Reduces `tensor` (first dimension `world_size() * k`) over all ranks and returns this
    /// rank's block of `k` rows of the result: rows `rank * k .. (rank + 1) * k`.
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Concatenates every rank's `tensor` (same shape everywhere) along the first dimension, in
    /// rank order; a scalar becomes a vector of `world_size()` elements.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor>;

    /// Returns rank `root`'s `tensor` on every rank. Non-root ranks pass a tensor of the same
    /// shape and dtype (its values are ignored); the result lands on their tensor's device.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor>;

    /// Sends `tensor` to rank `to` with `tag` (at most [`MAX_TAG`]). The shape and dtype travel
    /// with it. Returns without waiting for the receiver (the thread backend queues the message;
    /// MPI sends a copy with `MPI_Isend` and completes it later), so two ranks may send to each
    /// other before either receives, whatever the message size.
    fn send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()>;

    /// Receives the tensor sent by rank `from` with `tag` and places it on `device`. Messages
    /// with the same `(from, tag)` arrive in the order they were sent.
    fn recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;

    /// Splits the ranks of this communicator into disjoint groups, one sub-communicator per group
    /// (`MPI_Comm_split`): ranks that pass the same `color` form a group, ordered by `key`, then
    /// by their rank here. Every rank must call it (it is a collective) and gets the
    /// communicator of its own group; colors and keys are at most [`MAX_COLOR`](crate::MAX_COLOR).
    ///
    /// Errors of the sub-communicator are [`CommError::InGroup`]: they name this rank in the
    /// world (the communicator first split) and in the group, and the world rank of a peer they
    /// name. [`split_named`](Communicator::split_named) names the kind of group in them.
    ///
    /// Backends without sub-communicators return [`CommError::Unsupported`] (the default).
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        self.split_named("group", color, key)
    }

    /// [`split`](Communicator::split), naming the kind of group (`"pipeline"`, `"dp"`, ...) in the
    /// sub-communicator's errors and abort lines: `world rank 3 of 4 (rank 1 of 2 in dp 1)`.
    fn split_named(&self, name: &str, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        let _ = (name, color, key);
        Err(CommError::Unsupported {
            rank: self.rank(),
            op: Op::Split,
            backend: self.backend(),
        })
    }

    /// Tells every rank to stop because this rank failed with `reason`.
    ///
    /// - `mpi`: writes `candle-comm: rank R failed: <reason>` to stderr and calls `MPI_Abort`,
    ///   which terminates every process of the job (this call does not return);
    /// - `threads`: the other ranks' pending and next operations return
    ///   [`CommError::PeerFailed`] naming this rank;
    /// - `local`: nothing to tell.
    ///
    /// On a sub-communicator (see [`split`](Communicator::split)): MPI still ends the whole job
    /// (the line names the rank in the world and in the group); threads tell the group's ranks.
    fn abort(&self, reason: &str);
}

/// Implements [`Communicator`] for a pointer type by forwarding every method to its target.
macro_rules! forward_communicator {
    ($(#[$doc:meta])* $ty:ty) => {
        $(#[$doc])*
        impl<C: Communicator + ?Sized> Communicator for $ty {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn backend(&self) -> &'static str {
                (**self).backend()
            }
            fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
                (**self).all_reduce(tensor, op)
            }
            fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
                (**self).reduce_scatter(tensor, op)
            }
            fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
                (**self).all_gather(tensor)
            }
            fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
                (**self).broadcast(tensor, root)
            }
            fn send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()> {
                (**self).send(tensor, to, tag)
            }
            fn recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
                (**self).recv(from, tag, device)
            }
            fn barrier(&self) -> Result<()> {
                (**self).barrier()
            }
            fn split_named(
                &self,
                name: &str,
                color: usize,
                key: usize,
            ) -> Result<Box<dyn Communicator>> {
                (**self).split_named(name, color, key)
            }
            fn abort(&self, reason: &str) {
                (**self).abort(reason)
            }
        }
    };
}

forward_communicator!(
    /// Forwards every method, so that `Box<dyn Communicator>` (what
    /// [`split`](Communicator::split) returns) and boxed backends are communicators.
    Box<C>
);
forward_communicator!(
    /// Forwards every method, so that a borrowed communicator can be lent to code that takes
    /// one by value (e.g. a transport that owns its communicator).
    &C
);

/// Passes `result` through, calling [`Communicator::abort`] with the error's text first when it
/// is an error, so that no other rank waits for this one forever.
///
/// ```
/// use candle_comm::{or_abort, Communicator, Local};
/// let comm = Local::new();
/// let r: Result<u32, String> = or_abort(&comm, Ok(3));
/// assert_eq!(r, Ok(3));
/// ```
pub fn or_abort<C, T, E>(comm: &C, result: std::result::Result<T, E>) -> std::result::Result<T, E>
where
    C: Communicator + ?Sized,
    E: fmt::Display,
{
    if let Err(e) = &result {
        comm.abort(&e.to_string());
    }
    result
}

/// Checks that `peer` is a rank of the world.
pub(crate) fn check_peer(rank: usize, world: usize, peer: usize, op: Op) -> Result<()> {
    if peer >= world {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            message: format!("rank {peer} is out of range for a world of {world}"),
        });
    }
    Ok(())
}

/// Checks that `tag` is at most [`MAX_TAG`].
pub(crate) fn check_tag(rank: usize, tag: u32, op: Op) -> Result<()> {
    if tag > MAX_TAG {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            message: format!("tag {tag} is larger than {MAX_TAG}"),
        });
    }
    Ok(())
}

/// Checks that `tensor`'s first dimension splits into `world` equal blocks; returns the block
/// length in rows.
pub(crate) fn scatter_rows(rank: usize, world: usize, tensor: &Tensor) -> Result<usize> {
    let dims = tensor.dims();
    match dims.first() {
        Some(&d0) if d0 % world == 0 => Ok(d0 / world),
        _ => Err(CommError::InvalidArgument {
            rank,
            op: Op::ReduceScatter,
            message: format!(
                "first dimension of shape {dims:?} is not divisible by the world size {world}"
            ),
        }),
    }
}
