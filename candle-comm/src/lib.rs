#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod comm;
mod dp;
mod error;
mod group;
mod host;
mod local;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod sync;
mod threads;

pub use comm::{or_abort, Communicator, ReduceOp, MAX_TAG};
pub use dp::{all_reduce_gradients, GradBuckets, ReduceStats, DEFAULT_BUCKET_BYTES};
pub use error::{CommError, GroupRank, Op, Result};
pub use group::MAX_COLOR;
pub use local::Local;
#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, DEFAULT_MPI_TIMEOUT};
#[cfg(feature = "nccl")]
pub use nccl::{nccl_version, NcclBuilder, NcclComm, DEFAULT_NCCL_TIMEOUT};
pub use sync::{
    broadcast_vars, check_in_sync, ensure_in_sync, fingerprint, sorted_vars, SyncReport,
};
pub use threads::{run_threads, ThreadComm, DEFAULT_THREAD_TIMEOUT};
