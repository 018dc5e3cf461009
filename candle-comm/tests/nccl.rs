//! The NCCL backend on real GPUs: a world of one rank on GPU 0, and a world of two threads on
//! GPUs 0 and 1 when the machine has two. Each test prints `<test>: skipping: ...` and passes
//! when the GPUs it needs are missing (this file only builds with `--features nccl`).
#![cfg(feature = "nccl")]

mod common;

use std::time::Duration;

use anyhow::Result;
use candle_comm::{run_threads, CommError, Communicator, Local, NcclComm, ReduceOp};
use candle_core::cuda::cudarc::driver::CudaContext;
use candle_core::{DType, Device, Tensor};

/// GPU 0, or `None` when there is no usable CUDA device, with a notice that starts with the
/// test's name (`<test>: skipping: no CUDA device (<reason>)`: a pass then is a skip, which
/// `scripts/gpu/run.sh` and `.ci/build-nccl.sh` look for).
fn gpu0(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let e = e.to_string();
            println!(
                "{test}: skipping: no CUDA device ({})",
                e.lines().next().unwrap_or("")
            );
            None
        }
    }
}

/// A fresh rendezvous path for this test.
fn rendezvous(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("candle-comm-nccl-{}-{name}", std::process::id()))
}

#[test]
fn one_rank_device_collectives() -> Result<()> {
    let Some(dev) = gpu0("one_rank_device_collectives") else {
        return Ok(());
    };
    let path = rendezvous("collectives");
    let comm = NcclComm::from_file(&path, 0, 1, 0)?;
    assert!(
        !path.exists(),
        "rank 0 removes the rendezvous file after setup"
    );
    assert_eq!(
        (comm.backend(), comm.rank(), comm.world_size()),
        ("nccl", 0, 1)
    );
    println!("NCCL version {:?}", candle_comm::nccl_version());
    for dtype in common::DTYPES {
        common::check_collectives(&comm, &dev, dtype)?;
    }
    Ok(())
}

#[test]
fn one_rank_host_tensors() -> Result<()> {
    if gpu0("one_rank_host_tensors").is_none() {
        return Ok(());
    }
    let comm = NcclComm::from_communicator(&Local::new(), 0)?;
    for dtype in common::DTYPES {
        common::check_collectives(&comm, &Device::Cpu, dtype)?;
    }
    Ok(())
}

#[test]
fn one_rank_data_parallel() -> Result<()> {
    let Some(dev) = gpu0("one_rank_data_parallel") else {
        return Ok(());
    };
    let comm = NcclComm::from_communicator(&Local::new(), 0)?;
    common::check_buckets(&comm, &dev)?;
    common::check_data_parallel(&comm, 6, 600)?;
    Ok(())
}

#[test]
fn rejects_bad_input() -> Result<()> {
    let Some(dev) = gpu0("rejects_bad_input") else {
        return Ok(());
    };
    let comm = NcclComm::builder(0)
        .timeout(Duration::from_secs(60))
        .p2p(false)
        .connect_with(&Local::new())?;
    assert!(!comm.has_p2p());
    let ints = Tensor::ones(3, DType::U32, &dev)?;
    let e = comm.all_reduce(&ints, ReduceOp::Sum).unwrap_err();
    assert!(
        matches!(e, CommError::UnsupportedDtype { rank: 0, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("unsupported dtype U32"), "{e}");
    let t = Tensor::ones((2, 3), DType::F32, &dev)?;
    assert!(comm.broadcast(&t, 1).is_err());
    assert!(comm.send(&t, 1, 0).is_err());
    assert!(comm.send(&t, 0, candle_comm::MAX_TAG + 1).is_err());
    let e = comm.recv(0, 3, &dev).unwrap_err();
    assert!(e.to_string().contains("would block forever"), "{e}");
    // Messages to self need no link.
    comm.send(&t, 0, 3)?;
    let back = comm.recv(0, 3, &Device::Cpu)?;
    assert_eq!(back.to_vec2::<f32>()?, vec![vec![1.0; 3]; 2]);
    // Empty tensors never reach NCCL.
    let none = Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?;
    assert_eq!(comm.all_reduce_sum(&none)?.dims(), [0, 3]);
    if CudaContext::device_count().unwrap_or(0) >= 2 {
        let other = Tensor::ones(3, DType::F32, &Device::new_cuda(1)?)?;
        let e = comm.all_reduce_sum(&other).unwrap_err();
        assert!(
            e.to_string().contains("this NCCL communicator on cuda:0"),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn two_gpus_in_threads() {
    if gpu0("two_gpus_in_threads").is_none() {
        return;
    }
    let count = CudaContext::device_count().unwrap_or(0);
    if count < 2 {
        println!("two_gpus_in_threads: skipping: 2 CUDA devices needed, {count} found");
        return;
    }
    let outcomes = run_threads(2, Duration::from_secs(120), |c| -> Result<()> {
        let comm = NcclComm::builder(c.rank())
            .timeout(Duration::from_secs(120))
            .connect_with(&c)?;
        let dev = comm.device().clone();
        for dtype in common::DTYPES {
            common::check_collectives(&comm, &dev, dtype)?;
            common::check_collectives(&comm, &Device::Cpu, dtype)?;
        }
        common::check_buckets(&comm, &dev)?;
        common::check_data_parallel(&comm, 3, 600)?;
        Ok(())
    });
    for (rank, out) in outcomes.into_iter().enumerate() {
        match out {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("rank {rank}: {e:#}"),
            Err(_) => panic!("rank {rank} panicked"),
        }
    }
}
