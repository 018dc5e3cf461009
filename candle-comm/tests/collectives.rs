//! Every collective and the data-parallel gradient all-reduce on `Local` and on worlds of 2-4
//! threads (the same checks run under `mpirun` in the `mpi_*` examples).

mod common;

use std::time::Duration;

use anyhow::Result;
use candle_comm::{run_threads, Communicator, GradBuckets, Local, ReduceOp, ThreadComm};
use candle_core::{DType, Device, Tensor, Var};

fn on_threads(n: usize, f: impl Fn(&ThreadComm) -> Result<()> + Sync) {
    for (rank, out) in run_threads(n, Duration::from_secs(30), |c| f(&c))
        .into_iter()
        .enumerate()
    {
        match out {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("world {n}, rank {rank}: {e:#}"),
            Err(_) => panic!("world {n}, rank {rank} panicked"),
        }
    }
}

#[test]
fn local_collectives() -> Result<()> {
    for dtype in common::DTYPES {
        common::check_collectives(&Local::new(), &Device::Cpu, dtype)?;
    }
    Ok(())
}

#[test]
fn thread_collectives() {
    for n in [1, 2, 3, 4] {
        on_threads(n, |c| {
            for dtype in common::DTYPES {
                common::check_collectives(c, &Device::Cpu, dtype)?;
            }
            Ok(())
        });
    }
}

#[test]
fn local_rejects_bad_arguments() -> Result<()> {
    let c = Local::new();
    let t = Tensor::ones(3, DType::F32, &Device::Cpu)?;
    assert!(c.send(&t, 1, 0).is_err());
    assert!(c.send(&t, 0, candle_comm::MAX_TAG + 1).is_err());
    assert!(
        c.recv(0, 4, &Device::Cpu).is_err(),
        "empty queue must fail, not block"
    );
    assert!(c.broadcast(&t, 2).is_err());
    let ints = Tensor::ones(3, DType::U32, &Device::Cpu)?;
    let e = c.all_reduce(&ints, ReduceOp::Sum).unwrap_err();
    assert!(e.to_string().contains("unsupported dtype U32"), "{e}");
    Ok(())
}

#[test]
fn thread_reduce_scatter_needs_divisible_rows() {
    on_threads(2, |c| {
        let t = Tensor::ones((3, 2), DType::F32, &Device::Cpu)?;
        let e = c.reduce_scatter(&t, ReduceOp::Sum).unwrap_err();
        anyhow::ensure!(e.to_string().contains("not divisible"), "{e}");
        Ok(())
    });
}

#[test]
fn data_parallel_matches_full_batch() {
    for n in [2, 3] {
        on_threads(n, |c| common::check_data_parallel(c, 3, 600));
    }
    common::check_data_parallel(&Local::new(), 6, 600).unwrap();
}

#[test]
fn buckets_group_by_size_and_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let v = |n: usize, dtype| Var::zeros(n, dtype, &dev);
    // 400 B, 400 B, 200 B (f64), 400 B, 2000 B, 4 B.
    let vars = vec![
        v(100, DType::F32)?,
        v(100, DType::F32)?,
        v(25, DType::F64)?,
        v(100, DType::F32)?,
        v(500, DType::F32)?,
        v(1, DType::F32)?,
    ];
    let b = GradBuckets::new(vars.clone(), 1000);
    assert_eq!(b.bucket_sizes(), vec![800, 200, 400, 2000, 4]);
    assert_eq!(GradBuckets::new(vars.clone(), 0).num_buckets(), 6);
    assert_eq!(
        GradBuckets::new(vars, 1 << 20).bucket_sizes(),
        vec![3204, 200]
    );
    Ok(())
}

#[test]
fn missing_gradients_are_agreed_on() {
    // Rank 1 has no gradient for `a`: it contributes zeros; `b` has a gradient nowhere and stays
    // absent; `c` is averaged normally.
    on_threads(2, |comm| {
        let dev = Device::Cpu;
        let (a, b, c) = (
            Var::ones(4, DType::F32, &dev)?,
            Var::ones(2, DType::F32, &dev)?,
            Var::ones(3, DType::F32, &dev)?,
        );
        let r = comm.rank() as f32;
        let loss = if comm.rank() == 0 {
            ((a.as_tensor().sum_all()? * 2.0)? + (c.as_tensor().sum_all()? * (r + 1.0) as f64)?)?
        } else {
            (c.as_tensor().sum_all()? * (r + 1.0) as f64)?
        };
        let mut grads = loss.backward()?;
        let buckets = GradBuckets::new(vec![a.clone(), b.clone(), c.clone()], 1 << 20);
        let stats = buckets.all_reduce_mean(comm, &mut grads)?;
        anyhow::ensure!(stats.tensors == 2 && stats.calls == 2, "{stats:?}");
        anyhow::ensure!(grads.get(b.as_tensor()).is_none());
        anyhow::ensure!(grads.get(a.as_tensor()).unwrap().to_vec1::<f32>()? == vec![1.0; 4]);
        anyhow::ensure!(grads.get(c.as_tensor()).unwrap().to_vec1::<f32>()? == vec![1.5; 3]);
        Ok(())
    });
}
