//! The NCCL backend across processes, one per GPU, joined through a rendezvous file.
//!
//! ```sh
//! # machine with 2 GPUs: one process per GPU (rank r on GPU r), a fresh rendezvous path per run
//! f=/tmp/nccl-rdv-$$
//! for r in 0 1; do target/release/examples/nccl_smoke "$f" $r 2 & done; wait
//! # one GPU: a world of one
//! target/release/examples/nccl_smoke /tmp/nccl-rdv-$$ 0 1
//! # a failing rank: rank 1 aborts after 3 all-reduces; both processes must exit with status 3
//! for r in 0 1; do target/release/examples/nccl_smoke "$f-fail" $r 2 fail & done; wait
//! ```
//!
//! Arguments: `<rendezvous file> <rank> <world> [ok|fail]`; rank `r` uses GPU `r` (set
//! `NCCL_SMOKE_DEVICE` to choose another). Checks every collective and point-to-point transfer
//! on device and host tensors with exact values, gradient buckets on the GPU and data parallel
//! against the full batch, then times an all-reduce of 64 MiB of f32.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_comm::{nccl_version, or_abort, Communicator, NcclComm};
use candle_core::{DType, Device, Tensor};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, rank, world, rest @ ..] = args.as_slice() else {
        bail!("usage: nccl_smoke <rendezvous file> <rank> <world> [ok|fail]");
    };
    let rank: usize = rank.parse().context("rank")?;
    let world: usize = world.parse().context("world")?;
    let mode = rest.first().map_or("ok", String::as_str);
    let ordinal = match std::env::var("NCCL_SMOKE_DEVICE") {
        Ok(d) => d.parse().context("NCCL_SMOKE_DEVICE")?,
        Err(_) => rank,
    };
    let comm = NcclComm::builder(ordinal)
        .timeout(Duration::from_secs(60))
        .connect_file(path, rank, world)?;
    let dev = comm.device().clone();
    if rank == 0 {
        println!(
            "nccl_smoke: {world} ranks, NCCL {:?}, rank 0 on {:?}",
            nccl_version(),
            dev.location()
        );
    }
    if mode == "fail" {
        let t = Tensor::ones(1 << 20, DType::F32, &dev)?;
        for step in 0..100 {
            if rank == 1 && step == 3 {
                let failed: Result<(), String> = Err(format!("simulated failure at step {step}"));
                or_abort(&comm, failed).map_err(anyhow::Error::msg)?;
            }
            comm.all_reduce_sum(&t)?;
        }
        bail!("rank {rank}: still running after rank 1 failed");
    }
    for dtype in common::DTYPES {
        or_abort(&comm, common::check_collectives(&comm, &dev, dtype))?;
        or_abort(&comm, common::check_collectives(&comm, &Device::Cpu, dtype))?;
    }
    or_abort(&comm, common::check_buckets(&comm, &dev))?;
    or_abort(&comm, common::check_data_parallel(&comm, 4, 600))?;

    let n = 16 << 20; // 64 MiB of f32
    let t = Tensor::ones(n, DType::F32, &dev)?;
    comm.all_reduce_sum(&t)?; // warm-up
    let iters = 10;
    let start = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_sum(&t)?;
    }
    let secs = start.elapsed().as_secs_f64() / iters as f64;
    // Bus bandwidth as nccl-tests reports it: 2 (n - 1) / n of the buffer crosses each link.
    let bus = 2.0 * (world as f64 - 1.0) / world as f64 * (4 * n) as f64 / secs / 1e9;
    comm.barrier()?;
    println!(
        "nccl_smoke: rank {rank} of {world} ok (exact collectives f32/f64/bf16/f16, send/recv, \
         buckets, data parallel); all_reduce 64 MiB f32: {:.3} ms, bus {bus:.1} GB/s",
        secs * 1e3
    );
    Ok(())
}
