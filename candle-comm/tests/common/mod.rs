//! Checks shared by the thread-backend tests and the MPI examples (included with `#[path]`):
//! they take any `Communicator`, so the same code runs on threads and under `mpirun`.
#![allow(dead_code)]

use anyhow::{ensure, Result};
use candle_comm::{broadcast_vars, ensure_in_sync, Communicator, GradBuckets, ReduceOp};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{linear, AdamW, Linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};

/// The dtypes every collective is checked in.
pub const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// `rows x cols` tensor with element `i` equal to `scale * i` (small integers: exact in every
/// dtype checked, and their sums too).
fn ramp(rows: usize, cols: usize, scale: f64, dtype: DType) -> Result<Tensor> {
    let v: Vec<f64> = (0..rows * cols).map(|i| scale * i as f64).collect();
    Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?.to_dtype(dtype)?)
}

/// Every collective of `comm`, with exact expected values (integers), in `dtype`.
pub fn check_collectives<C: Communicator + ?Sized>(comm: &C, dtype: DType) -> Result<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let (rows, cols) = (2 * n, 3);
    let t = ramp(rows, cols, (r + 1) as f64, dtype)?;
    let tri = (n * (n + 1) / 2) as f64;
    let idx: Vec<f64> = (0..rows * cols).map(|i| i as f64).collect();

    let sum = comm.all_reduce(&t, ReduceOp::Sum)?;
    ensure!(
        sum.dtype() == dtype && sum.dims() == [rows, cols],
        "all_reduce shape/dtype"
    );
    let want: Vec<f64> = idx.iter().map(|i| i * tri).collect();
    ensure!(values(&sum)? == want, "rank {r}: all_reduce sum {dtype:?}");
    let want: Vec<f64> = idx.iter().map(|i| i * tri / n as f64).collect();
    ensure!(
        values(&comm.all_reduce_mean(&t)?)? == want,
        "rank {r}: all_reduce mean {dtype:?}"
    );
    let want: Vec<f64> = idx.iter().map(|i| i * n as f64).collect();
    ensure!(
        values(&comm.all_reduce(&t, ReduceOp::Max)?)? == want,
        "rank {r}: max {dtype:?}"
    );
    ensure!(
        values(&comm.all_reduce(&t, ReduceOp::Min)?)? == idx,
        "rank {r}: min {dtype:?}"
    );

    // Views: a row range (contiguous, at an offset into its storage) and a transpose (strided).
    let want: Vec<f64> = idx[cols..].iter().map(|i| i * tri).collect();
    let view = comm.all_reduce_sum(&t.narrow(0, 1, rows - 1)?)?;
    ensure!(
        values(&view)? == want,
        "rank {r}: all_reduce of a narrowed view {dtype:?}"
    );
    let tr = comm.all_reduce_sum(&t.t()?)?;
    ensure!(tr.dims() == [cols, rows], "rank {r}: transposed shape");
    ensure!(
        values(&tr)? == values(&sum.t()?)?,
        "rank {r}: all_reduce of a transpose {dtype:?}"
    );

    let block = comm.reduce_scatter(&t, ReduceOp::Sum)?;
    ensure!(
        block.dims() == [2, cols],
        "rank {r}: reduce_scatter shape {:?}",
        block.dims()
    );
    let want: Vec<f64> = idx[r * 2 * cols..(r + 1) * 2 * cols]
        .iter()
        .map(|i| i * tri)
        .collect();
    ensure!(
        values(&block)? == want,
        "rank {r}: reduce_scatter {dtype:?}"
    );

    let mine = Tensor::full(r as f32, (2, cols), &Device::Cpu)?.to_dtype(dtype)?;
    let all = comm.all_gather(&mine)?;
    ensure!(
        all.dims() == [2 * n, cols],
        "rank {r}: all_gather shape {:?}",
        all.dims()
    );
    let want: Vec<f64> = (0..2 * n * cols).map(|i| (i / (2 * cols)) as f64).collect();
    ensure!(values(&all)? == want, "rank {r}: all_gather {dtype:?}");
    let scalar = Tensor::new(r as f32 + 1.0, &Device::Cpu)?.to_dtype(dtype)?;
    let want: Vec<f64> = (1..=n).map(|i| i as f64).collect();
    ensure!(
        values(&comm.all_gather(&scalar)?)? == want,
        "rank {r}: all_gather of scalars"
    );

    let root = n - 1;
    let mine = if r == root {
        ramp(rows, cols, 7.0, dtype)?
    } else {
        t.zeros_like()?
    };
    let got = comm.broadcast(&mine, root)?;
    let want: Vec<f64> = idx.iter().map(|i| i * 7.0).collect();
    ensure!(
        values(&got)? == want,
        "rank {r}: broadcast from {root} {dtype:?}"
    );

    // Ring: two messages on tag 5 (order kept) and one on tag 9, received first.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    comm.send(
        &Tensor::full(r as f32, (r + 1, 2), &Device::Cpu)?.to_dtype(dtype)?,
        next,
        5,
    )?;
    comm.send(
        &Tensor::full(10.0 + r as f32, 3, &Device::Cpu)?.to_dtype(dtype)?,
        next,
        5,
    )?;
    comm.send(
        &Tensor::full(20.0 + r as f32, 1, &Device::Cpu)?.to_dtype(dtype)?,
        next,
        9,
    )?;
    let c = comm.recv(prev, 9, &Device::Cpu)?;
    let a = comm.recv(prev, 5, &Device::Cpu)?;
    let b = comm.recv(prev, 5, &Device::Cpu)?;
    ensure!(
        a.dtype() == dtype && a.dims() == [prev + 1, 2],
        "rank {r}: recv shape {:?}",
        a.dims()
    );
    ensure!(
        values(&a)? == vec![prev as f64; 2 * (prev + 1)],
        "rank {r}: recv 1"
    );
    ensure!(
        values(&b)? == vec![10.0 + prev as f64; 3],
        "rank {r}: recv 2 (order)"
    );
    ensure!(
        values(&c)? == vec![20.0 + prev as f64],
        "rank {r}: recv tag 9"
    );
    comm.barrier()?;
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

/// Largest `|a - b|` over all elements, and the largest `|b|`.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let m = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((d, m))
}

/// Relative tolerance of data-parallel gradients against the full-batch gradients: the two sum
/// the same f32 terms in a different order (per-rank means, then the mean over ranks, vs one
/// mean over the whole batch), which changes the last bits: ~1e-7 relative per reordering.
pub const GRAD_RTOL: f32 = 1e-5;
/// Relative tolerance of data-parallel weights against the full-batch run after the updates
/// (the gradient differences above, carried through 10 optimizer steps).
pub const WEIGHT_RTOL: f32 = 1e-4;

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
                let (d, m) = max_diff(g, g_ref)?;
                ensure!(
                    d <= GRAD_RTOL * m.max(1e-6),
                    "rank {r}: gradient differs by {d} (max {m})"
                );
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
        let (d, m) = max_diff(v.as_tensor(), w.as_tensor())?;
        ensure!(
            d <= WEIGHT_RTOL * m.max(1e-6),
            "rank {r}: weights differ by {d} (max {m})"
        );
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
    check_collectives(sub.as_ref(), DType::F32)?;
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
