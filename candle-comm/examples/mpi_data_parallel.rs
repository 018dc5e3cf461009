//! Data parallel under MPI: the bucketed gradient all-reduce over N ranks x 4 rows equals one
//! model on N x 4 rows (within `GRAD_RTOL`), and after 5 SGD + 5 AdamW steps every rank's weights
//! are bit-identical (and within `WEIGHT_RTOL` of the full-batch run).
//!
//! `mpirun -np 2 target/release/examples/mpi_data_parallel`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_comm::{or_abort, Communicator, MpiComm, DEFAULT_BUCKET_BYTES};

fn main() -> anyhow::Result<()> {
    let comm = MpiComm::init()?.with_timeout(Duration::from_secs(60));
    for bucket_bytes in [600, DEFAULT_BUCKET_BYTES, 0] {
        or_abort(&comm, common::check_data_parallel(&comm, 4, bucket_bytes))?;
    }
    if comm.rank() == 0 {
        println!(
            "mpi_data_parallel: {} ranks x 4 rows == 1 x {} rows (gradients within {:e} relative), \
             weights bit-identical on every rank after 10 steps",
            comm.world_size(),
            4 * comm.world_size(),
            common::GRAD_RTOL
        );
    }
    Ok(())
}
