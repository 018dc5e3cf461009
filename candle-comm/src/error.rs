//! Error type of the crate.

use std::fmt;
use std::time::Duration;

use candle_core::DType;

/// The communication operation during which an error happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Setting up the communicator (MPI initialisation, thread world creation).
    Init,
    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce).
    AllReduce,
    /// [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter).
    ReduceScatter,
    /// [`Communicator::all_gather`](crate::Communicator::all_gather).
    AllGather,
    /// [`Communicator::broadcast`](crate::Communicator::broadcast).
    Broadcast,
    /// [`Communicator::send`](crate::Communicator::send).
    Send,
    /// [`Communicator::recv`](crate::Communicator::recv).
    Recv,
    /// [`Communicator::barrier`](crate::Communicator::barrier).
    Barrier,
    /// Bucketed gradient all-reduce ([`GradBuckets`](crate::GradBuckets)).
    GradAllReduce,
    /// Weight fingerprint comparison ([`check_in_sync`](crate::check_in_sync)).
    SyncCheck,
    /// [`Communicator::split`](crate::Communicator::split) into sub-communicators.
    Split,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Op::Init => "init",
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Send => "send",
            Op::Recv => "recv",
            Op::Barrier => "barrier",
            Op::GradAllReduce => "gradient all_reduce",
            Op::SyncCheck => "weight sync check",
            Op::Split => "split",
        };
        f.write_str(s)
    }
}

/// Errors raised by communicators and the data-parallel helpers.
///
/// Every variant names the rank that observed the error and the operation; errors caused by
/// another rank also name that peer.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A Candle operation (staging a tensor through the host, concatenating a bucket, ...) failed.
    #[error("rank {rank}, {op}: {source}")]
    Candle {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// The underlying Candle error.
        #[source]
        source: candle_core::Error,
    },
    /// The tensor's dtype cannot be communicated (only f32, f64, bf16 and f16 can).
    #[error("rank {rank}, {op}: unsupported dtype {dtype:?} (f32, f64, bf16, f16 only)")]
    UnsupportedDtype {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// The offending dtype.
        dtype: DType,
    },
    /// An argument is invalid on this rank (peer or root out of range, tag too large, first
    /// dimension not divisible by the world size, ...).
    #[error("rank {rank}, {op}: {message}")]
    InvalidArgument {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// What is wrong.
        message: String,
    },
    /// Ranks passed inconsistent tensors or layouts to the same collective (different element
    /// counts or dtypes, different gradient bucket layouts).
    #[error("rank {rank}, {op}: mismatch with rank {peer}: {message}")]
    Mismatch {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// A rank whose input differs.
        peer: usize,
        /// What differs.
        message: String,
    },
    /// Another rank failed (returned an error, panicked, or called
    /// [`Communicator::abort`](crate::Communicator::abort)) and told this one to stop.
    #[error("rank {rank}, {op}: rank {peer} failed: {message}")]
    PeerFailed {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// The rank that failed.
        peer: usize,
        /// The failed rank's reason.
        message: String,
    },
    /// Nothing arrived from a peer within the communicator's timeout (it is hung or dead).
    #[error("rank {rank}, {op}: timed out after {after:?} waiting for rank {peer}")]
    Timeout {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// The rank that was waited for.
        peer: usize,
        /// How long this rank waited.
        after: Duration,
    },
    /// The parameters differ across ranks: their fingerprints do not match rank 0's.
    #[error("rank {rank}, {op}: weights differ from rank 0's on ranks {differing:?}")]
    WeightDrift {
        /// Rank that observed the error.
        rank: usize,
        /// Operation in progress.
        op: Op,
        /// Ranks whose parameter fingerprint differs from rank 0's.
        differing: Vec<usize>,
    },
    /// The backend does not implement this operation (e.g. sub-communicators).
    #[error("rank {rank}, {op}: not supported by the {backend} backend")]
    Unsupported {
        /// Rank that observed the error.
        rank: usize,
        /// The operation.
        op: Op,
        /// Name of the backend ([`Communicator::backend`](crate::Communicator::backend)).
        backend: &'static str,
    },
    /// An error on a sub-communicator (made by [`Communicator::split`](crate::Communicator::split)):
    /// `source` names this rank, and any peer, by their ranks in the group; `group` adds this
    /// rank's place in the world, and `peer_world` the world rank of the peer `source` names.
    #[error("{group}: {source}{}", peer_note(.source, .peer_world))]
    InGroup {
        /// This rank in the world and in the group.
        group: GroupRank,
        /// World rank of the peer named by `source` (when it names one).
        peer_world: Option<usize>,
        /// The error, with ranks of the group.
        source: Box<CommError>,
    },
    /// The communicator could not be created.
    #[error("{op}: {message}")]
    Init {
        /// Always [`Op::Init`].
        op: Op,
        /// What went wrong.
        message: String,
    },
}

impl CommError {
    /// The rank that observed the error, when known.
    pub fn rank(&self) -> Option<usize> {
        self.rank_and_op().0
    }

    /// The rank of the world (the communicator that was split) that observed the error: for an
    /// error of a sub-communicator its world rank, otherwise [`CommError::rank`].
    pub fn world_rank(&self) -> Option<usize> {
        match self {
            CommError::InGroup { group, .. } => Some(group.world_rank),
            e => e.rank(),
        }
    }

    /// Where the rank that observed the error sits in the world and in its group, for an error of
    /// a sub-communicator.
    pub fn group(&self) -> Option<&GroupRank> {
        match self {
            CommError::InGroup { group, .. } => Some(group),
            _ => None,
        }
    }

    /// The error without its group context ([`CommError::InGroup`]'s `source`; ranks in it are
    /// ranks of the group), e.g. to match [`CommError::PeerFailed`] on any communicator.
    pub fn inner(&self) -> &CommError {
        match self {
            CommError::InGroup { source, .. } => source.inner(),
            e => e,
        }
    }

    /// The peer another rank's failure or input came from, in the communicator's numbering.
    pub fn peer(&self) -> Option<usize> {
        match self.inner() {
            CommError::Mismatch { peer, .. }
            | CommError::PeerFailed { peer, .. }
            | CommError::Timeout { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// The operation during which the error happened.
    pub fn op(&self) -> Op {
        self.rank_and_op().1
    }

    /// [`rank`](CommError::rank) and [`op`](CommError::op): those of the error itself, or of
    /// [`CommError::InGroup`]'s `source`.
    fn rank_and_op(&self) -> (Option<usize>, Op) {
        match self {
            CommError::Candle { rank, op, .. }
            | CommError::UnsupportedDtype { rank, op, .. }
            | CommError::InvalidArgument { rank, op, .. }
            | CommError::Mismatch { rank, op, .. }
            | CommError::PeerFailed { rank, op, .. }
            | CommError::Timeout { rank, op, .. }
            | CommError::WeightDrift { rank, op, .. }
            | CommError::Unsupported { rank, op, .. } => (Some(*rank), *op),
            CommError::Init { op, .. } => (None, *op),
            CommError::InGroup { source, .. } => source.rank_and_op(),
        }
    }
}

/// Where one rank of a sub-communicator sits: its rank in the world (the communicator first
/// split, e.g. `MPI_COMM_WORLD`) and in its group.
///
/// Displayed as `world rank 3 of 4 (rank 1 of 2 in pipeline 1)`: `pipeline` is the name given to
/// [`Communicator::split_named`](crate::Communicator::split_named) (`group` for
/// [`split`](crate::Communicator::split)) and `1` the color.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupRank {
    /// This rank in the world.
    pub world_rank: usize,
    /// Number of ranks of the world.
    pub world_size: usize,
    /// Name of the kind of group (`"group"`, `"pipeline"`, `"dp"`, ...).
    pub name: String,
    /// The color the group was split with.
    pub color: usize,
    /// This rank in the group.
    pub rank: usize,
    /// Number of ranks of the group.
    pub size: usize,
}

impl fmt::Display for GroupRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "world rank {} of {} (rank {} of {} in {} {})",
            self.world_rank, self.world_size, self.rank, self.size, self.name, self.color
        )
    }
}

/// `" [group rank P is world rank W]"` when `source` names a peer and its world rank is known.
fn peer_note(source: &CommError, peer_world: &Option<usize>) -> String {
    match (source.peer(), *peer_world) {
        (Some(p), Some(w)) => format!(" [group rank {p} is world rank {w}]"),
        _ => String::new(),
    }
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, CommError>;

/// Attaches the rank and operation to a Candle result.
pub(crate) trait CandleContext<T> {
    /// Maps a Candle error to [`CommError::Candle`].
    fn at(self, rank: usize, op: Op) -> Result<T>;
}

impl<T> CandleContext<T> for candle_core::Result<T> {
    fn at(self, rank: usize, op: Op) -> Result<T> {
        self.map_err(|source| CommError::Candle { rank, op, source })
    }
}
