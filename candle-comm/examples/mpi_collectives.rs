//! Every collective under MPI with exact expected values, in f32, f64, bf16 and f16.
//!
//! Then the same inside sub-communicators (`Communicator::split`: groups by parity, a nested
//! split), with errors naming the world and group ranks.
//!
//! `mpirun -np 2 target/release/examples/mpi_collectives` (any number of ranks works).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use candle_comm::{or_abort, Communicator, MpiComm};
use candle_core::Device;

fn main() -> anyhow::Result<()> {
    let comm = MpiComm::init()?.with_timeout(Duration::from_secs(60));
    for dtype in common::DTYPES {
        or_abort(&comm, common::check_collectives(&comm, &Device::Cpu, dtype))?;
    }
    or_abort(&comm, common::check_split(&comm))?;
    if comm.rank() == 0 {
        println!(
            "mpi_collectives: all collectives exact on {} ranks (f32, f64, bf16, f16), and in \
             sub-communicators (split by parity, nested split)",
            comm.world_size()
        );
    }
    Ok(())
}
