//! Checks shared by the tests and the MPI and NCCL examples (included with `#[path]`): they take
//! any `Communicator` and device, so the same code runs on threads, under `mpirun` and on GPUs.
#![allow(dead_code)]

use anyhow::{ensure, Result};
use candle_comm::{broadcast_vars, ensure_in_sync, Communicator, GradBuckets, ReduceOp};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{linear, AdamW, Linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use test_support::compare::{diff, values, Diff};

/// The dtypes every collective is checked in.
pub const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

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

/// Every collective and point-to-point transfer of `comm` on tensors on `dev` (the CPU or a
/// GPU), in `dtype`, with exact expected values (small integers: exact in every dtype checked,
/// and their sums too).
pub fn check_collectives<C: Communicator + ?Sized>(
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
    ensure!(values(&sum) == want, "{tag}: all_reduce sum");
    let mean = comm.all_reduce_mean(&t)?;
    let want: Vec<f64> = idx.iter().map(|i| i * tri / n as f64).collect();
    ensure!(values(&mean) == want, "{tag}: all_reduce mean");
    let want: Vec<f64> = idx.iter().map(|i| i * n as f64).collect();
    ensure!(
        values(&comm.all_reduce(&t, ReduceOp::Max)?) == want,
        "{tag}: max"
    );
    ensure!(
        values(&comm.all_reduce(&t, ReduceOp::Min)?) == idx,
        "{tag}: min"
    );

    // A view at an offset into its storage, and a strided one.
    let view = comm.all_reduce_sum(&t.narrow(0, 1, rows - 1)?)?;
    let want: Vec<f64> = idx[cols..].iter().map(|i| i * tri).collect();
    ensure!(
        values(&view) == want,
        "{tag}: all_reduce of a narrowed view"
    );
    let tr = comm.all_reduce_sum(&t.t()?)?;
    ensure_on(&tr, dev, dtype, &[cols, rows], "all_reduce of a transpose")?;
    ensure!(
        values(&tr) == values(&sum.t()?),
        "{tag}: all_reduce of a transpose"
    );

    let block = comm.reduce_scatter(&t, ReduceOp::Sum)?;
    ensure_on(&block, dev, dtype, &[2, cols], "reduce_scatter")?;
    let want: Vec<f64> = idx[r * 2 * cols..(r + 1) * 2 * cols]
        .iter()
        .map(|i| i * tri)
        .collect();
    ensure!(values(&block) == want, "{tag}: reduce_scatter");

    let mine = Tensor::full(r as f32, (2, cols), dev)?.to_dtype(dtype)?;
    let all = comm.all_gather(&mine)?;
    ensure_on(&all, dev, dtype, &[2 * n, cols], "all_gather")?;
    let want: Vec<f64> = (0..2 * n * cols).map(|i| (i / (2 * cols)) as f64).collect();
    ensure!(values(&all) == want, "{tag}: all_gather");
    let scalar = Tensor::new(r as f32 + 1.0, dev)?.to_dtype(dtype)?;
    let want: Vec<f64> = (1..=n).map(|i| i as f64).collect();
    ensure!(
        values(&comm.all_gather(&scalar)?) == want,
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
    ensure!(values(&got) == want, "{tag}: broadcast from {root}");

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
        values(&a) == vec![prev as f64; 2 * (prev + 1)],
        "{tag}: recv 1"
    );
    ensure!(
        values(&b) == vec![10.0 + prev as f64; 3],
        "{tag}: recv 2 (order)"
    );
    ensure!(values(&c) == vec![20.0 + prev as f64], "{tag}: recv tag 9");

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
pub fn check_buckets<C: Communicator + ?Sized>(comm: &C, dev: &Device) -> Result<()> {
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
            values(g).iter().all(|&x| x == want),
            "rank {r}: gradient {k} is {:?}, want {want}",
            values(g)
        );
    }
    broadcast_vars(comm, &vars, 0)?;
    for (k, v) in vars.iter().enumerate() {
        ensure!(
            values(v.as_tensor()).iter().all(|&x| x == k as f64),
            "rank {r}: variable {k} not rank 0's after broadcast_vars"
        );
    }
    ensure_in_sync(comm, &vars)?;
    Ok(())
}

/// A two-layer MLP, its variables and a reference copy trained on the whole batch in-process.
pub struct Mlp {
    pub varmap: VarMap,
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    pub fn new() -> Result<Self> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let l1 = linear(8, 16, vb.pp("l1"))?;
        let l2 = linear(16, 4, vb.pp("l2"))?;
        Ok(Self { varmap, l1, l2 })
    }

    pub fn vars(&self) -> Vec<Var> {
        candle_comm::sorted_vars(&self.varmap)
            .into_iter()
            .map(|(_, v)| v)
            .collect()
    }

    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let h = self.l1.forward(x)?.tanh()?;
        Ok(candle_nn::loss::mse(&self.l2.forward(&h)?, y)?)
    }
}

/// The global batch of `rows` rows for `step` (deterministic, the same on every rank).
pub fn batch(step: usize, rows: usize) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..rows * 8)
        .map(|i| ((i * 7 + step * 13) as f32 * 0.37).sin())
        .collect();
    let y: Vec<f32> = (0..rows * 4)
        .map(|i| ((i * 3 + step * 5) as f32 * 0.21).cos())
        .collect();
    Ok((
        Tensor::from_vec(x, (rows, 8), &Device::Cpu)?,
        Tensor::from_vec(y, (rows, 4), &Device::Cpu)?,
    ))
}

/// NaN-aware [`diff`] of `a` against the reference `b`; a NaN is an error here, not a panic
/// (the MPI examples abort the job on an error).
fn diff_of(a: &Tensor, b: &Tensor) -> Result<Diff> {
    diff(&values(a), &values(b)).map_err(anyhow::Error::msg)
}

/// Relative tolerance of data-parallel gradients against the full-batch gradients: the two sum
/// the same f32 terms in a different order (per-rank means, then the mean over ranks, vs one
/// mean over the whole batch), which changes the last bits: ~1e-7 relative per reordering.
pub const GRAD_RTOL: f64 = 1e-5;
/// Relative tolerance of data-parallel weights against the full-batch run after the updates
/// (the gradient differences above, carried through 10 optimizer steps).
pub const WEIGHT_RTOL: f64 = 1e-4;

/// Data parallel over `comm` with `b` rows per rank vs one in-process model on the whole batch:
/// gradients within [`GRAD_RTOL`], then 5 SGD and 5 AdamW steps after which every rank's weights
/// are bit-identical (checked with [`ensure_in_sync`]) and within [`WEIGHT_RTOL`] of the
/// reference. `bucket_bytes` 600 puts the MLP's four tensors in two buckets.
pub fn check_data_parallel<C: Communicator + ?Sized>(
    comm: &C,
    b: usize,
    bucket_bytes: usize,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let dp = Mlp::new()?;
    let reference = Mlp::new()?;
    let vars = dp.vars();
    broadcast_vars(comm, &vars, 0)?;
    for (v, w) in reference.vars().iter().zip(&vars) {
        v.set(w.as_tensor())?;
    }
    let buckets = GradBuckets::from_varmap(&dp.varmap, bucket_bytes);
    buckets.check_layout(comm)?;
    let mut sgd = SGD::new(vars.clone(), 0.1)?;
    let mut sgd_ref = SGD::new(reference.vars(), 0.1)?;
    let params = ParamsAdamW {
        lr: 1e-3,
        ..Default::default()
    };
    let mut adam = AdamW::new(vars.clone(), params.clone())?;
    let mut adam_ref = AdamW::new(reference.vars(), params)?;
    for step in 0..10 {
        let (x, y) = batch(step, n * b)?;
        let mut grads = dp
            .loss(&x.narrow(0, r * b, b)?, &y.narrow(0, r * b, b)?)?
            .backward()?;
        let stats = buckets.all_reduce_mean(comm, &mut grads)?;
        if n > 1 {
            ensure!(
                stats.calls == buckets.num_buckets() + 1 && stats.tensors == 4,
                "{stats:?}"
            );
        }
        let grads_ref = reference.loss(&x, &y)?.backward()?;
        if step == 0 {
            for (v, w) in vars.iter().zip(reference.vars()) {
                let (g, g_ref) = (grads.get(v).unwrap(), grads_ref.get(&w).unwrap());
                let d = diff_of(g, g_ref)?;
                ensure!(d.rel() <= GRAD_RTOL, "rank {r}: gradient: {d}");
            }
        }
        if step < 5 {
            sgd.step(&grads)?;
            sgd_ref.step(&grads_ref)?;
        } else {
            adam.step(&grads)?;
            adam_ref.step(&grads_ref)?;
        }
        ensure_in_sync(comm, &vars)?;
    }
    for (v, w) in vars.iter().zip(reference.vars()) {
        let d = diff_of(v.as_tensor(), w.as_tensor())?;
        ensure!(d.rel() <= WEIGHT_RTOL, "rank {r}: weights: {d}");
    }
    Ok(())
}

/// Sub-communicators of `comm` (any world size): groups by parity of the rank, ordered by
/// decreasing rank (`key = n - r`); every collective inside each group with exact values; the
/// world still works between group operations; a nested split; errors name both ranks; a color
/// above `MAX_COLOR` on one rank fails the split on every rank.
pub fn check_split<C: Communicator + ?Sized>(comm: &C) -> Result<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let color = r % 2;
    let sub = comm.split_named("parity", color, n - r)?;
    // Members of this rank's group in group-rank order: same parity, decreasing world rank.
    let members: Vec<usize> = (0..n).rev().filter(|p| p % 2 == color).collect();
    let want_rank = members.iter().position(|&p| p == r).unwrap_or(usize::MAX);
    ensure!(
        sub.rank() == want_rank && sub.world_size() == members.len(),
        "rank {r}: sub-communicator rank {} of {}, expected {want_rank} of {}",
        sub.rank(),
        sub.world_size(),
        members.len()
    );
    // The group sums world ranks of its members only.
    let mine = Tensor::new(&[r as f32, 1.0], &Device::Cpu)?;
    let got = sub.all_reduce(&mine, ReduceOp::Sum)?.to_vec1::<f32>()?;
    let want = [members.iter().sum::<usize>() as f32, members.len() as f32];
    ensure!(
        got == want,
        "rank {r}: group all_reduce {got:?}, expected {want:?}"
    );
    // The world in between: all ranks.
    let got = comm.all_reduce(&mine, ReduceOp::Sum)?.to_vec1::<f32>()?;
    ensure!(
        got[1] == n as f32,
        "rank {r}: world all_reduce after split {got:?}"
    );
    check_collectives(sub.as_ref(), &Device::Cpu, DType::F32)?;
    // All-gather returns world ranks in group-rank order.
    let ids = sub.all_gather(&Tensor::new(r as f32, &Device::Cpu)?)?;
    let want: Vec<f32> = members.iter().map(|&p| p as f32).collect();
    ensure!(ids.to_vec1::<f32>()? == want, "rank {r}: group all_gather");
    // A ring of sends inside the group (tags repeat what the world might use: separate spaces).
    let (gr, gs) = (sub.rank(), sub.world_size());
    sub.send(&mine, (gr + 1) % gs, 7)?;
    let from = sub
        .recv((gr + gs - 1) % gs, 7, &Device::Cpu)?
        .to_vec1::<f32>()?;
    ensure!(
        from[0] as usize == members[(gr + gs - 1) % gs],
        "rank {r}: ring recv {from:?}"
    );
    // A nested split into singletons: ranks still named in the first world.
    let single = sub.split_named("single", gr, 0)?;
    ensure!(
        single.world_size() == 1 && single.rank() == 0,
        "nested split"
    );
    let e = single.send(&mine, 1, 0).err().map(|e| e.to_string());
    let want = format!("world rank {r} of {n} (rank 0 of 1 in single {gr}): rank 0, send:");
    ensure!(
        e.as_deref().is_some_and(|e| e.starts_with(&want)),
        "rank {r}: nested split error {e:?}, expected it to start with {want:?}"
    );
    // Errors of the group name the world rank and the group rank.
    let e = sub.broadcast(&mine, gs).err().map(|e| e.to_string());
    let want = format!(
        "world rank {r} of {n} (rank {gr} of {gs} in parity {color}): rank {gr}, broadcast:"
    );
    ensure!(
        e.as_deref().is_some_and(|e| e.starts_with(&want)),
        "rank {r}: group error {e:?}, expected it to start with {want:?}"
    );
    // A color out of range on rank 0 fails the split everywhere, naming rank 0.
    let bad = if r == 0 {
        candle_comm::MAX_COLOR + 1
    } else {
        0
    };
    let e = comm.split(bad, 0).err().map(|e| e.to_string());
    ensure!(
        e.as_deref()
            .is_some_and(|e| e.contains("rank 0 passed a color or key above")),
        "rank {r}: bad color gave {e:?}"
    );
    comm.barrier()?;
    Ok(())
}
