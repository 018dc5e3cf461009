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
        match self {
            CommError::Candle { rank, .. }
            | CommError::UnsupportedDtype { rank, .. }
            | CommError::InvalidArgument { rank, .. }
            | CommError::Mismatch { rank, .. }
            | CommError::PeerFailed { rank, .. }
            | CommError::Timeout { rank, .. }
            | CommError::WeightDrift { rank, .. } => Some(*rank),
            CommError::Init { .. } => None,
        }
    }

    /// The operation during which the error happened.
    pub fn op(&self) -> Op {
        match self {
            CommError::Candle { op, .. }
            | CommError::UnsupportedDtype { op, .. }
            | CommError::InvalidArgument { op, .. }
            | CommError::Mismatch { op, .. }
            | CommError::PeerFailed { op, .. }
            | CommError::Timeout { op, .. }
            | CommError::WeightDrift { op, .. }
            | CommError::Init { op, .. } => *op,
        }
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
