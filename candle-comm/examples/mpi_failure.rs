//! A failing rank under MPI: `mpirun -np 2 target/release/examples/mpi_failure <mode>` must make
//! every process exit non-zero quickly, with a message naming the failed rank.
//!
//! Modes (rank 1 misbehaves at step 3 of a loop of all-reduces; rank 0 keeps reducing):
//! - `error`: rank 1 gets an error and passes it through `or_abort` (MPI_Abort with a message);
//! - `panic`: rank 1 panics (its `MpiComm` aborts the job while unwinding);
//! - `hang`: rank 1 stops responding; rank 0's 3 s timeout aborts the job.

use std::time::Duration;

use candle_comm::{or_abort, Communicator, MpiComm};
use candle_core::{DType, Device, Tensor};

fn main() -> anyhow::Result<()> {
    let mode = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "error".to_string());
    let comm = MpiComm::init()?.with_timeout(Duration::from_secs(3));
    let t = Tensor::ones(1024, DType::F32, &Device::Cpu)?;
    for step in 0..10 {
        if comm.rank() == 1 && step == 3 {
            match mode.as_str() {
                "panic" => panic!("simulated panic at step {step}"),
                "hang" => std::thread::sleep(Duration::from_secs(120)),
                _ => {
                    let failed: Result<(), String> =
                        Err(format!("simulated failure at step {step}"));
                    or_abort(&comm, failed).map_err(anyhow::Error::msg)?;
                }
            }
        }
        comm.all_reduce_sum(&t)?;
    }
    println!(
        "rank {}: mpi_failure finished without a failure (mode {mode})",
        comm.rank()
    );
    Ok(())
}
