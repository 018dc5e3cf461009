//! Checks of a communicator on tensors that live on a GPU (the NCCL backend), shared by
//! `tests/nccl.rs` and `examples/nccl_smoke.rs` (included with `#[path]`).
#![allow(dead_code)]

use anyhow::{ensure, Result};
use candle_comm::{broadcast_vars, ensure_in_sync, Communicator, GradBuckets, ReduceOp};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// `rows x cols` tensor on `dev` with element `i` equal to `scale * i` (exact in every dtype).
fn ramp(rows: usize, cols: usize, scale: f64, dtype: DType, dev: &Device) -> Result<Tensor> {
    let v: Vec<f64> = (0..rows * cols).map(|i| scale * i as f64).collect();
    Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)?)
}

/// Result on `dev`, in `dtype`, with `dims`.
fn ensure_on(t: &Tensor, dev: &Device, dtype: DType, dims: &[usize], what: &str) -> Result<()> {
    ensure!(
        t.device().same_device(dev),
        "{what}: result on {:?}, not on the input's device",
        t.device().location()
    );
    ensure!(t.dtype() == dtype, "{what}: dtype {:?}", t.dtype());
    ensure!(t.dims() == dims, "{what}: shape {:?}", t.dims());
    Ok(())
}

/// Every collective and point-to-point transfer on tensors on `dev`, with exact expected values.
pub fn check_device_collectives<C: Communicator + ?Sized>(
    comm: &C,
    dev: &Device,
    dtype: DType,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let (rows, cols) = (2 * n, 3);
    let t = ramp(rows, cols, (r + 1) as f64, dtype, dev)?;
    let tri = (n * (n + 1) / 2) as f64;
    let idx: Vec<f64> = (0..rows * cols).map(|i| i as f64).collect();
    let tag = format!("rank {r}, {dtype:?}");

    let sum = comm.all_reduce(&t, ReduceOp::Sum)?;
    ensure_on(&sum, dev, dtype, &[rows, cols], "all_reduce")?;
    let want: Vec<f64> = idx.iter().map(|i| i * tri).collect();
    ensure!(values(&sum)? == want, "{tag}: all_reduce sum");
    let mean = comm.all_reduce_mean(&t)?;
    let want: Vec<f64> = idx.iter().map(|i| i * tri / n as f64).collect();
    ensure!(values(&mean)? == want, "{tag}: all_reduce mean");
    let want: Vec<f64> = idx.iter().map(|i| i * n as f64).collect();
    ensure!(
        values(&comm.all_reduce(&t, ReduceOp::Max)?)? == want,
        "{tag}: max"
    );
    ensure!(
        values(&comm.all_reduce(&t, ReduceOp::Min)?)? == idx,
        "{tag}: min"
    );

    // A view at an offset into its storage, and a strided one.
    let view = comm.all_reduce_sum(&t.narrow(0, 1, rows - 1)?)?;
    let want: Vec<f64> = idx[cols..].iter().map(|i| i * tri).collect();
    ensure!(
        values(&view)? == want,
        "{tag}: all_reduce of a narrowed view"
    );
    let tr = comm.all_reduce_sum(&t.t()?)?;
    ensure_on(&tr, dev, dtype, &[cols, rows], "all_reduce of a transpose")?;
    ensure!(
        values(&tr)? == values(&sum.t()?)?,
        "{tag}: all_reduce of a transpose"
    );

    let block = comm.reduce_scatter(&t, ReduceOp::Sum)?;
    ensure_on(&block, dev, dtype, &[2, cols], "reduce_scatter")?;
    let want: Vec<f64> = idx[r * 2 * cols..(r + 1) * 2 * cols]
        .iter()
        .map(|i| i * tri)
        .collect();
    ensure!(values(&block)? == want, "{tag}: reduce_scatter");

    let mine = Tensor::full(r as f32, (2, cols), dev)?.to_dtype(dtype)?;
    let all = comm.all_gather(&mine)?;
    ensure_on(&all, dev, dtype, &[2 * n, cols], "all_gather")?;
    let want: Vec<f64> = (0..2 * n * cols).map(|i| (i / (2 * cols)) as f64).collect();
    ensure!(values(&all)? == want, "{tag}: all_gather");
    let scalar = Tensor::new(r as f32 + 1.0, dev)?.to_dtype(dtype)?;
    let want: Vec<f64> = (1..=n).map(|i| i as f64).collect();
    ensure!(
        values(&comm.all_gather(&scalar)?)? == want,
        "{tag}: all_gather of scalars"
    );

    let root = n - 1;
    let mine = if r == root {
        ramp(rows, cols, 7.0, dtype, dev)?
    } else {
        t.zeros_like()?
    };
    let got = comm.broadcast(&mine, root)?;
    ensure_on(&got, dev, dtype, &[rows, cols], "broadcast")?;
    let want: Vec<f64> = idx.iter().map(|i| i * 7.0).collect();
    ensure!(values(&got)? == want, "{tag}: broadcast from {root}");

    // Ring on the device: two messages on tag 5 (order kept), one on tag 9, received first; the
    // sent tensor is overwritten before it is received (sends must carry a private copy).
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let first = Var::from_tensor(&Tensor::full(r as f32, (r + 1, 2), dev)?.to_dtype(dtype)?)?;
    comm.send(first.as_tensor(), next, 5)?;
    first.set(&first.as_tensor().zeros_like()?)?;
    comm.send(
        &Tensor::full(10.0 + r as f32, 3, dev)?.to_dtype(dtype)?,
        next,
        5,
    )?;
    comm.send(
        &Tensor::full(20.0 + r as f32, 1, dev)?.to_dtype(dtype)?,
        next,
        9,
    )?;
    let c = comm.recv(prev, 9, dev)?;
    let a = comm.recv(prev, 5, dev)?;
    let b = comm.recv(prev, 5, dev)?;
    ensure_on(&a, dev, dtype, &[prev + 1, 2], "recv")?;
    ensure!(
        values(&a)? == vec![prev as f64; 2 * (prev + 1)],
        "{tag}: recv 1"
    );
    ensure!(
        values(&b)? == vec![10.0 + prev as f64; 3],
        "{tag}: recv 2 (order)"
    );
    ensure!(values(&c)? == vec![20.0 + prev as f64], "{tag}: recv tag 9");

    // A device tensor received on the host, and a host tensor received on the device.
    comm.send(&Tensor::new(&[r as f32, 0.5], dev)?, next, 11)?;
    comm.send(&Tensor::new(&[r as f32, 1.5], &Device::Cpu)?, next, 12)?;
    let on_host = comm.recv(prev, 11, &Device::Cpu)?;
    let on_dev = comm.recv(prev, 12, dev)?;
    ensure!(on_host.device().is_cpu(), "{tag}: recv onto the host");
    ensure!(
        on_dev.device().same_device(dev),
        "{tag}: recv onto the device"
    );
    ensure!(
        on_host.to_vec1::<f32>()? == [prev as f32, 0.5]
            && on_dev.to_vec1::<f32>()? == [prev as f32, 1.5],
        "{tag}: host/device round trip"
    );
    comm.barrier()?;
    Ok(())
}

/// Gradient buckets of variables on `dev` (f32 and bf16, several buckets): rank `r` holds
/// gradients `(r + 1) * (k + 1)` for variable `k`, except that rank 0 has none for the last
/// variable; after `all_reduce_mean` every rank holds the exact means, on `dev`. Then the
/// variables are broadcast from rank 0 and checked in sync.
pub fn check_device_buckets<C: Communicator + ?Sized>(comm: &C, dev: &Device) -> Result<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let shapes: [(&[usize], DType); 4] = [
        (&[4, 3], DType::F32),
        (&[5], DType::F32),
        (&[2, 2], DType::BF16),
        (&[3], DType::F32),
    ];
    let mut vars = Vec::new();
    for (k, (dims, dtype)) in shapes.iter().enumerate() {
        let init = Tensor::full((r * 10 + k) as f32, *dims, dev)?.to_dtype(*dtype)?;
        vars.push(Var::from_tensor(&init)?);
    }
    let last = vars.len() - 1;
    let buckets = GradBuckets::new(vars.clone(), 40);
    ensure!(buckets.num_buckets() >= 3, "{:?}", buckets.bucket_sizes());
    buckets.check_layout(comm)?;
    let mut grads = GradStore::default();
    for (k, v) in vars.iter().enumerate() {
        if r == 0 && k == last {
            continue;
        }
        let g = v
            .as_tensor()
            .ones_like()?
            .affine(((r + 1) * (k + 1)) as f64, 0.0)?;
        grads.insert(v.as_tensor(), g);
    }
    let stats = buckets.all_reduce_mean(comm, &mut grads)?;
    if n > 1 {
        ensure!(
            stats.calls == buckets.num_buckets() + 1 && stats.tensors == vars.len(),
            "{stats:?}"
        );
    }
    let others: f64 = (2..=n).map(|x| x as f64).sum();
    for (k, v) in vars.iter().enumerate() {
        let want = if k == last {
            if n == 1 {
                ensure!(
                    grads.get(v.as_tensor()).is_none(),
                    "rank {r}: gradient appeared"
                );
                continue;
            }
            (k + 1) as f64 * others / n as f64
        } else {
            (k + 1) as f64 * (n * (n + 1) / 2) as f64 / n as f64
        };
        let g = grads
            .get(v.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("rank {r}: gradient {k} missing"))?;
        ensure_on(g, dev, v.dtype(), v.dims(), "averaged gradient")?;
        ensure!(
            values(g)?.iter().all(|&x| x == want),
            "rank {r}: gradient {k} is {:?}, want {want}",
            values(g)?
        );
    }
    broadcast_vars(comm, &vars, 0)?;
    for (k, v) in vars.iter().enumerate() {
        ensure!(
            values(v.as_tensor())?.iter().all(|&x| x == k as f64),
            "rank {r}: variable {k} not rank 0's after broadcast_vars"
        );
    }
    ensure_in_sync(comm, &vars)?;
    Ok(())
}
