//! Pipeline × data parallel over MPI: `mpirun -np 4 target/release/examples/mpi_pipeline_2d
//! [mode]`.
//!
//! The 4 processes form a 2D grid of 2 pipeline stages × 2 data-parallel replicas
//! (`Grid2D` over `MpiComm`: world rank `replica * 2 + stage`, sub-communicators from
//! `MPI_Comm_split`). For GPipe, 1F1B and interleaved 1F1B, with SGD and with AdamW, every rank
//! trains 3 steps on its replica's share of a global batch, then checks against single-process
//! computations done locally: its loss (last stage) and the gradients of its parameters at every
//! step, and its weights at the end, bit-identical to one process doing the same sums in the
//! same order, and within 2e-6 relative of the plain model on the global batch at the same
//! weights (only the order of f32 sums differs). A mismatch exits non-zero.
//!
//! Mode `fail`: on replica 1, stage 1's layer fails at its second forward; the job must end
//! non-zero with candle-comm's `world rank 3 of 4 (rank 1 of 2 in pipeline 1) failed: ...` line.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use anyhow::{bail, Context};
use candle_comm::{or_abort, Communicator, MpiComm};
use candle_pipeline_comm::Topology;
use common::grid::{for_worker, train_emulated, train_grid, Kind, Opt, STEPS, TOL};
use common::rel_err;

fn main() -> anyhow::Result<()> {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "check".into());
    let comm = MpiComm::init()?.with_timeout(Duration::from_secs(60));
    let rank = comm.rank();
    let topology = Topology::new(2, 2)?;
    if comm.world_size() != topology.world_size() {
        bail!(
            "run with mpirun -np {} (world size {})",
            topology.world_size(),
            comm.world_size()
        );
    }
    let (stage, replica) = topology.coords(rank);
    if mode == "fail" {
        let r = train_grid(&comm, topology, Kind::OneFOneB, Opt::Sgd, Some((1, 1, 1)));
        // World rank 3 aborts the job from inside the pipeline step; no rank gets here.
        bail!("rank {rank}: the failing run returned: {r:?}");
    }
    for kind in Kind::ALL {
        for opt in [Opt::Sgd, Opt::AdamW] {
            let what = format!("rank {rank} (stage {stage}, replica {replica}), {kind:?} {opt:?}");
            let trace =
                train_grid(&comm, topology, kind, opt, None).with_context(|| what.clone())?;
            let (emulated, plain) = train_emulated(topology, kind, opt)?;
            let want = for_worker(&emulated, topology.stages, kind.v(), stage)?;
            let near = for_worker(&plain, topology.stages, kind.v(), stage)?;
            let check = || -> anyhow::Result<f64> {
                let mut worst: f64 = 0.0;
                for step in 0..STEPS {
                    if trace.grads[step] != want.grads[step] {
                        bail!("{what}, step {step}: gradients differ from one process");
                    }
                    let gerr = rel_err(&trace.grads[step], &near.grads[step]);
                    if gerr > TOL {
                        bail!("{what}, step {step}: gradient error {gerr:e} vs the plain model");
                    }
                    worst = worst.max(gerr);
                    if stage + 1 == topology.stages {
                        let (l, e, p) = (trace.losses[step], want.losses[step], near.losses[step]);
                        if l.to_bits() != e.to_bits() {
                            bail!("{what}, step {step}: loss {l} vs one process {e}");
                        }
                        let lerr = (l - p).abs() / p.abs();
                        if lerr > TOL {
                            bail!("{what}, step {step}: loss {l} vs the plain model {p}");
                        }
                        worst = worst.max(lerr);
                    }
                }
                if trace.weights != want.weights {
                    bail!("{what}: weights after {STEPS} steps differ from one process");
                }
                Ok(worst)
            };
            let worst = or_abort(&comm, check().map_err(|e| format!("{e:#}")))
                .map_err(anyhow::Error::msg)?;
            println!(
                "{what}: {STEPS} steps, gradients, loss and weights bit-identical to one \
                 process, {worst:.1e} from the plain model"
            );
        }
    }
    comm.barrier()?;
    if rank == 0 {
        println!(
            "mpi_pipeline_2d: 2 stages x 2 replicas on 4 ranks == 1 process on the global batch \
             for gpipe, 1f1b, interleaved with SGD and AdamW"
        );
    }
    Ok(())
}
