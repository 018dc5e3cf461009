//! Data parallelism over a [`candle_comm::Communicator`]: every rank trains a replica on its
//! shard of each batch, gradients are averaged in buckets, and the replicas stay identical.
//!
//! The scheme keeps `world_size` ranks × `batch_size` rows equal to one rank × `world_size ·
//! batch_size` rows, up to the order of f32 sums:
//!
//! - Every rank draws the same **global** batch (`world_size · batch_size` rows) from the same
//!   sampler state and keeps rows `rank · batch_size ..`: the data stream, the sampler state in
//!   checkpoints and a resume are those of one process.
//! - A rank's loss is the objective's mean over its shard's units (counted tokens for
//!   cross-entropy); it is weighted by `world_size · units_rank / units_global`, so the
//!   average over ranks of the weighted gradients is the gradient of the global batch's mean
//!   (masked tasks give ranks different token counts).
//! - Gradients are averaged with one all-reduce per bucket ([`GradBuckets`]) after the last
//!   micro-batch (accumulation stays local), so clipping, the non-finite check and the
//!   optimiser see the same gradients on every rank and apply the same update.
//!
//! A world of one ([`DataParallel::single`]) is the disabled component: every method is a
//! no-op, so the trainer has one step for one process and for many.

use candle_comm::{Communicator, GradBuckets, Local, DEFAULT_BUCKET_BYTES};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::data::Batch;
use crate::{Error, Result};

/// This process's place in a data-parallel group, and the gradient buckets it reduces.
pub struct DataParallel {
    comm: Box<dyn Communicator>,
    buckets: GradBuckets,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("backend", &self.comm.backend())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("buckets", &self.buckets.num_buckets())
            .finish()
    }
}

impl DataParallel {
    /// One process: nothing is communicated.
    pub fn single() -> Self {
        DataParallel {
            comm: Box::new(Local::new()),
            buckets: GradBuckets::new(Vec::new(), DEFAULT_BUCKET_BYTES),
        }
    }

    /// Rank `comm.rank()` of `comm.world_size()` replicas of the model whose parameters are
    /// `vars` (in the same order on every rank). Checks that every rank built the same buckets.
    pub fn new(comm: Box<dyn Communicator>, vars: Vec<Var>) -> Result<Self> {
        let buckets = GradBuckets::new(vars, DEFAULT_BUCKET_BYTES);
        if comm.world_size() > 1 {
            buckets.check_layout(comm.as_ref())?;
        }
        Ok(DataParallel { comm, buckets })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of replicas.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Whether this rank writes the run's files (metrics, checkpoints, logs): rank 0.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// The communicator.
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// This rank's rows of a global batch of `world_size · per_rank` rows, and the weight of
    /// its mean loss from the objective's units of the global batch's rows (`units`, see
    /// [`crate::objective::Objective::row_units`] and the module documentation; 1 when every
    /// rank holds the same units).
    pub fn shard(&self, global: Batch, per_rank: usize, units: &[f64]) -> Result<(Batch, f64)> {
        let w = self.world_size();
        if w == 1 {
            return Ok((global, 1.0));
        }
        let start = self.rank() * per_rank;
        let total: f64 = units.iter().sum();
        let mine: f64 = units[start..start + per_rank].iter().sum();
        let weight = if total > 0.0 {
            w as f64 * mine / total
        } else {
            1.0
        };
        Ok((global.narrow(start, per_rank)?, weight))
    }

    /// Averages `grads` over the ranks and returns the global loss from this rank's
    /// `weighted_loss` (its loss times its shard weight; see [`DataParallel::shard`]).
    pub fn reduce(&self, grads: &mut GradStore, weighted_loss: f32) -> Result<f32> {
        if self.world_size() == 1 {
            return Ok(weighted_loss);
        }
        self.buckets.all_reduce_mean(self.comm.as_ref(), grads)?;
        let loss = Tensor::new(&[weighted_loss], &candle_core::Device::Cpu)?;
        let mean = self.comm.all_reduce_mean(&loss)?.to_vec1::<f32>()?;
        Ok(mean[0])
    }

    /// Each of `metrics` averaged over the ranks (every rank logs the same names, from the
    /// same objective, over as many rows a step), in f32.
    pub(crate) fn mean_metrics(&self, metrics: Vec<(String, f64)>) -> Result<Vec<(String, f64)>> {
        if self.world_size() == 1 || metrics.is_empty() {
            return Ok(metrics);
        }
        let values: Vec<f32> = metrics.iter().map(|(_, v)| *v as f32).collect();
        let t = Tensor::new(values.as_slice(), &candle_core::Device::Cpu)?;
        let mean = self.comm.all_reduce_mean(&t)?.to_vec1::<f32>()?;
        Ok(metrics
            .into_iter()
            .zip(mean)
            .map(|((name, _), m)| (name, f64::from(m)))
            .collect())
    }

    /// Whether any rank asked to stop (a signal reaches the ranks at different steps; they must
    /// stop at the same one).
    pub fn any(&self, flag: bool) -> Result<bool> {
        if self.world_size() == 1 {
            return Ok(flag);
        }
        let t = Tensor::new(&[f32::from(u8::from(flag))], &candle_core::Device::Cpu)?;
        let all = self.comm.all_reduce_sum(&t)?.to_vec1::<f32>()?;
        Ok(all[0] > 0.0)
    }

    /// Errors if the replicas' weights differ (one 64-bit hash per rank, compared by one small
    /// all-gather).
    pub(crate) fn ensure_in_sync(&self, vars: &[Var]) -> Result<()> {
        if self.world_size() > 1 {
            candle_comm::ensure_in_sync(self.comm.as_ref(), vars)?;
        }
        Ok(())
    }

    /// Makes every rank's `vars` equal to rank 0's.
    pub(crate) fn broadcast_from_main(&self, vars: &[Var]) -> Result<()> {
        if self.world_size() > 1 {
            candle_comm::broadcast_vars(self.comm.as_ref(), vars, 0)?;
        }
        Ok(())
    }

    /// Tells the other ranks that this one failed with `error` (MPI: aborts the job after
    /// printing it, so no rank waits for this one until its timeout).
    pub fn abort(&self, error: &Error) {
        if self.world_size() > 1 {
            self.comm.abort(&error.to_string());
        }
    }
}

/// Ranks announced by the environment of an MPI launcher: Open MPI's `OMPI_COMM_WORLD_SIZE`,
/// MPICH/Hydra's `PMI_SIZE`, or Slurm/PMIx's `PMIX_SIZE`... (1 when started without one).
pub(crate) fn world_size_from_env() -> usize {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_SIZE",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .filter_map(|v| std::env::var(v).ok())
    .find_map(|s| s.trim().parse::<usize>().ok())
    .unwrap_or(1)
}

/// The communicator this process was started with: MPI's world when an MPI launcher started
/// more than one process (`mpirun -np N trainer train ...`, which needs the `mpi` feature),
/// else a world of one.
pub fn communicator_from_env() -> Result<Box<dyn Communicator>> {
    let world = world_size_from_env();
    if world <= 1 {
        return Ok(Box::new(Local::new()));
    }
    #[cfg(feature = "mpi")]
    {
        Ok(Box::new(candle_comm::MpiComm::init()?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(Error::Config(format!(
            "started by an MPI launcher with {world} processes, but this trainer was built \
             without MPI: build it with `--features mpi` (see candle-comm's README)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objective::{CrossEntropy, Objective};
    use candle_comm::ThreadComm;
    use candle_core::Device;

    #[test]
    fn shards_are_weighted_by_their_counted_tokens() {
        let dev = Device::Cpu;
        // Rows count 1, 2, 3 and 2 tokens: rank 0 holds 3 of 8, rank 1 holds 5 of 8.
        let mask = Tensor::new(
            &[[1f32, 0., 0.], [1., 1., 0.], [1., 1., 1.], [0., 1., 1.]],
            &dev,
        )
        .unwrap();
        let x = Tensor::arange(0u32, 12, &dev)
            .unwrap()
            .reshape((4, 3))
            .unwrap();
        let global = Batch::new(x.clone(), x).with_mask(Some(mask));
        for (comm, want_weight, want_rows) in ThreadComm::world(2)
            .into_iter()
            .zip([0.75, 1.25])
            .zip([[0u32, 3], [6, 9]])
            .map(|((c, w), r)| (c, w, r))
        {
            let dp = DataParallel {
                comm: Box::new(comm),
                buckets: GradBuckets::new(Vec::new(), DEFAULT_BUCKET_BYTES),
            };
            let units = CrossEntropy.row_units(&global).unwrap();
            let (shard, weight) = dp.shard(global.clone(), 2, &units).unwrap();
            assert_eq!(weight, want_weight, "rank {}", dp.rank());
            let first: Vec<u32> = shard
                .x
                .narrow(1, 0, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(first, want_rows);
            assert_eq!(shard.mask.unwrap().dims(), &[2, 3]);
        }
        // A world of one keeps the batch and weighs it 1.
        let units = CrossEntropy.row_units(&global).unwrap();
        let (same, w) = DataParallel::single()
            .shard(global.clone(), 4, &units)
            .unwrap();
        assert_eq!((same.x.dims(), w), (global.x.dims(), 1.0));
    }
}
