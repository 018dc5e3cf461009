//! Pipeline workers as MPI ranks: `mpirun -np 2 target/release/examples/mpi_pipeline [mode]`.
//!
//! Every process builds the same 2-worker pipeline (deterministic weights), keeps the worker of
//! its rank and runs its part of a step over `CommTransport<MpiComm>`, for GPipe, 1F1B and
//! interleaved 1F1B. Each rank then checks its outputs against the single-process
//! `Pipeline::step` (computed locally, in threads): loss (on rank 1) and gradients of its own
//! parameters bit-identical, and against the plain model within 1e-5 relative.
//!
//! Mode `fail`: rank 1's stage fails at its second forward; the job must end non-zero with
//! candle-comm's `rank 1 of 2 failed: pipeline worker 1: ...` line.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use anyhow::{bail, Context};
use candle_comm::{Communicator, MpiComm};
use candle_pipeline_comm::CommTransport;
use common::*;

const WORKERS: usize = 2;
const TOL: f64 = 1e-5;

fn main() -> anyhow::Result<()> {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "check".into());
    let mut comm = MpiComm::init()?.with_timeout(Duration::from_secs(30));
    let rank = comm.rank();
    if comm.world_size() != WORKERS {
        bail!(
            "run with mpirun -np {WORKERS} (world size {})",
            comm.world_size()
        );
    }
    let fail_at = (mode == "fail").then_some((1, 1));
    let (_, _, batch) = batch()?;
    for (sched, v) in schedules(WORKERS)? {
        let worker = pipeline(WORKERS, v, fail_at)?.into_worker(rank)?;
        let transport = CommTransport::for_worker(comm, &worker);
        let out = worker
            .step(&sched, &batch, &transport)
            .with_context(|| format!("rank {rank}, {}", sched.name))?;
        comm = transport.into_inner();
        let grads = worker_grads(&worker, &out.grads)?;

        let single = pipeline(WORKERS, v, None)?;
        let reference = single.step(&sched, &batch)?;
        let part = single.worker(rank).context("worker")?;
        if grads != worker_grads(part, &reference.grads)? {
            bail!(
                "rank {rank}, {}: gradients differ from Pipeline::step",
                sched.name
            );
        }
        let (plain_loss, plain_grads) = plain(WORKERS * v)?;
        let gerr = rel_err(&grads, &plain_for_worker(&plain_grads, &worker));
        if gerr > TOL {
            bail!(
                "rank {rank}, {}: gradient error {gerr:e} vs the plain model",
                sched.name
            );
        }
        let mut line = format!(
            "rank {rank}: {} ({} stages): gradients of stages {:?} bit-identical to Pipeline::step, \
             {gerr:.1e} from the plain model",
            sched.name,
            sched.stages,
            worker.local_stages()
        );
        if worker.hosts_loss() {
            if out.loss.to_bits() != reference.loss.to_bits() {
                bail!(
                    "rank {rank}, {}: loss {} vs {}",
                    sched.name,
                    out.loss,
                    reference.loss
                );
            }
            let lerr = (out.loss - plain_loss).abs() / plain_loss.abs();
            if lerr > TOL {
                bail!(
                    "rank {rank}, {}: loss {} vs plain {plain_loss}",
                    sched.name,
                    out.loss
                );
            }
            line.push_str(&format!("; loss {:.6} bit-identical", out.loss));
        }
        println!("{line}");
    }
    comm.barrier()?;
    if rank == 0 {
        println!("mpi_pipeline: 2 ranks == 1 process for gpipe, 1f1b, interleaved");
    }
    Ok(())
}
