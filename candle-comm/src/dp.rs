//! Data parallel: averaging gradients over ranks in a few large all-reduce calls.

use candle_core::backprop::GradStore;
use candle_core::{DType, DeviceLocation, Tensor, Var};
use candle_nn::VarMap;

use crate::comm::{Communicator, ReduceOp};
use crate::error::{CandleContext, CommError, Op, Result};
use crate::host::dtype_code;
use crate::sync::{gather_u64, sorted_vars};

/// Default bucket size, 25 MiB (PyTorch DDP's default).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// A group of variables whose gradients travel in one contiguous buffer.
#[derive(Debug, Clone)]
struct Bucket {
    dtype: DType,
    /// Indices into [`GradBuckets::vars`].
    members: Vec<usize>,
    bytes: usize,
}

/// What one [`GradBuckets::all_reduce_mean`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReduceStats {
    /// All-reduce calls made (the buckets sent, plus one small call agreeing on which gradients
    /// exist).
    pub calls: usize,
    /// Gradient tensors averaged.
    pub tensors: usize,
    /// Gradient bytes averaged (in the variables' dtypes).
    pub bytes: usize,
}

/// A fixed assignment of variables to gradient buckets of at most `bucket_bytes` each.
///
/// Variables are taken in the given order (it must be the same on every rank: use
/// [`GradBuckets::from_varmap`], which sorts by name) and grouped by dtype and device; a bucket
/// is closed when the next gradient would make it larger than `bucket_bytes` (a gradient larger
/// than that gets a bucket of its own, and `bucket_bytes == 0` gives one bucket per tensor).
///
/// [`all_reduce_mean`](GradBuckets::all_reduce_mean) then flattens each bucket's gradients into
/// one buffer on their device, makes one [`Communicator::all_reduce`] call per bucket, and puts
/// views of the averaged buffer back into the `GradStore`.
#[derive(Debug, Clone)]
pub struct GradBuckets {
    vars: Vec<Var>,
    buckets: Vec<Bucket>,
    bucket_bytes: usize,
}

impl GradBuckets {
    /// Buckets of at most `bucket_bytes` for `vars`, in this order.
    pub fn new(vars: Vec<Var>, bucket_bytes: usize) -> Self {
        let mut buckets: Vec<Bucket> = Vec::new();
        // Index of the open bucket of each (dtype, device).
        let mut open: Vec<(DType, DeviceLocation, usize)> = Vec::new();
        for (i, v) in vars.iter().enumerate() {
            let (dtype, location) = (v.dtype(), v.device().location());
            let bytes = v.elem_count() * dtype.size_in_bytes();
            let slot = open
                .iter()
                .position(|&(d, l, _)| d == dtype && l == location);
            let fits = slot.map(|s| open[s].2).filter(|&b| {
                let b = &buckets[b];
                !b.members.is_empty() && b.bytes + bytes <= bucket_bytes
            });
            match (fits, slot) {
                (Some(b), _) => {
                    buckets[b].members.push(i);
                    buckets[b].bytes += bytes;
                }
                (None, slot) => {
                    buckets.push(Bucket {
                        dtype,
                        members: vec![i],
                        bytes,
                    });
                    let b = buckets.len() - 1;
                    match slot {
                        Some(s) => open[s].2 = b,
                        None => open.push((dtype, location, b)),
                    }
                }
            }
        }
        Self {
            vars,
            buckets,
            bucket_bytes,
        }
    }

    /// Buckets for every variable of `varmap`, sorted by name (the same order on every rank).
    pub fn from_varmap(varmap: &VarMap, bucket_bytes: usize) -> Self {
        Self::new(
            sorted_vars(varmap).into_iter().map(|(_, v)| v).collect(),
            bucket_bytes,
        )
    }

    /// The variables, in bucket-assignment order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Size of each bucket in bytes.
    pub fn bucket_sizes(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.bytes).collect()
    }

    /// The bucket size limit this assignment was made with.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// Hash of the variables' dtypes and shapes and of the bucket assignment.
    fn layout_hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut mix = |w: u64| h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3);
        for v in &self.vars {
            mix(dtype_code(v.dtype()));
            v.dims().iter().for_each(|&d| mix(d as u64));
        }
        for b in &self.buckets {
            mix(b.members.len() as u64);
        }
        h
    }

    /// Checks (one all-gather) that every rank has the same variables (dtypes, shapes, order)
    /// and bucket assignment; returns [`CommError::Mismatch`] naming the first rank that differs
    /// from rank 0 otherwise. Call it once after building the buckets.
    pub fn check_layout<C: Communicator + ?Sized>(&self, comm: &C) -> Result<()> {
        let all = gather_u64(comm, self.layout_hash(), Op::GradAllReduce)?;
        match (1..all.len()).find(|&r| all[r] != all[0]) {
            None => Ok(()),
            Some(peer) => Err(CommError::Mismatch {
                rank: comm.rank(),
                op: Op::GradAllReduce,
                peer,
                message: format!(
                    "variables or gradient buckets differ from rank 0's ({} variables, {} buckets here)",
                    self.vars.len(),
                    self.buckets.len()
                ),
            }),
        }
    }

    /// Replaces each variable's gradient in `grads` by its average over all ranks.
    ///
    /// Ranks first agree (one small all-reduce) on which variables have a gradient on at least
    /// one rank; a rank without one contributes zeros, and variables without a gradient anywhere
    /// stay without one. Then one all-reduce per bucket. With a world of one, nothing happens.
    pub fn all_reduce_mean<C: Communicator + ?Sized>(
        &self,
        comm: &C,
        grads: &mut GradStore,
    ) -> Result<ReduceStats> {
        self.all_reduce(comm, grads, ReduceOp::Mean)
    }

    /// Like [`all_reduce_mean`](GradBuckets::all_reduce_mean), but replaces each gradient by its
    /// sum over all ranks: for ranks whose losses are already weighted by their share of the
    /// global batch (e.g. a token-mean loss over replicas of different sizes), the sum is the
    /// global gradient.
    pub fn all_reduce_sum<C: Communicator + ?Sized>(
        &self,
        comm: &C,
        grads: &mut GradStore,
    ) -> Result<ReduceStats> {
        self.all_reduce(comm, grads, ReduceOp::Sum)
    }

    fn all_reduce<C: Communicator + ?Sized>(
        &self,
        comm: &C,
        grads: &mut GradStore,
        reduce: ReduceOp,
    ) -> Result<ReduceStats> {
        let mut stats = ReduceStats::default();
        if comm.world_size() == 1 || self.vars.is_empty() {
            return Ok(stats);
        }
        let (rank, op) = (comm.rank(), Op::GradAllReduce);
        let present: Vec<f32> = self
            .vars
            .iter()
            .map(|v| {
                if grads.get(v.as_tensor()).is_some() {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        let n = present.len();
        let present = Tensor::from_vec(present, n, &candle_core::Device::Cpu).at(rank, op)?;
        let anywhere = comm
            .all_reduce(&present, ReduceOp::Max)?
            .to_vec1::<f32>()
            .at(rank, op)?;
        stats.calls += 1;
        for bucket in &self.buckets {
            let members: Vec<usize> = bucket
                .members
                .iter()
                .copied()
                .filter(|&i| anywhere[i] > 0.0)
                .collect();
            if members.is_empty() {
                continue;
            }
            let mut parts = Vec::with_capacity(members.len());
            for &i in &members {
                parts.push(self.flat_grad(i, bucket.dtype, grads, rank)?);
            }
            let flat = Tensor::cat(&parts, 0).at(rank, op)?;
            drop(parts);
            let avg = comm.all_reduce(&flat, reduce)?;
            stats.calls += 1;
            let mut offset = 0;
            for &i in &members {
                let v = &self.vars[i];
                let n = v.elem_count();
                let g = avg
                    .narrow(0, offset, n)
                    .and_then(|g| g.reshape(v.shape()))
                    .at(rank, op)?;
                grads.insert(v.as_tensor(), g);
                offset += n;
                stats.tensors += 1;
                stats.bytes += n * bucket.dtype.size_in_bytes();
            }
        }
        Ok(stats)
    }

    /// Variable `i`'s gradient flattened in `dtype`, or zeros when this rank has none.
    fn flat_grad(&self, i: usize, dtype: DType, grads: &GradStore, rank: usize) -> Result<Tensor> {
        let (v, op) = (&self.vars[i], Op::GradAllReduce);
        match grads.get(v.as_tensor()) {
            None => Tensor::zeros(v.elem_count(), dtype, v.device()).at(rank, op),
            Some(g) if g.elem_count() != v.elem_count() => Err(CommError::InvalidArgument {
                rank,
                op,
                message: format!(
                    "gradient of shape {:?} for a variable of shape {:?}",
                    g.dims(),
                    v.dims()
                ),
            }),
            Some(g) => {
                let g = if g.dtype() == dtype {
                    g.clone()
                } else {
                    g.to_dtype(dtype).at(rank, op)?
                };
                g.flatten_all().at(rank, op)
            }
        }
    }
}

/// Averages every gradient of `grads` for `vars` over all ranks, in buckets of at most
/// `bucket_bytes` (see [`GradBuckets`]; build one once and reuse it in a training loop).
pub fn all_reduce_gradients<C: Communicator + ?Sized>(
    comm: &C,
    vars: &[Var],
    grads: &mut GradStore,
    bucket_bytes: usize,
) -> Result<ReduceStats> {
    GradBuckets::new(vars.to_vec(), bucket_bytes).all_reduce_mean(comm, grads)
}
