//! Pipeline × data parallel: a 2D grid of `stages × replicas` ranks.
//!
//! World rank `replica * stages + stage` runs pipeline worker `stage` of replica `replica`. The
//! ranks of one replica form a pipeline group (its [`CommTransport`]); the ranks of one stage
//! form a data-parallel group, over which that stage's gradients are summed after every step.
//! Each replica trains on its share of the global batch with microbatch loss weights relative to
//! the *global* batch ([`Grid2D::replica_batch`]), so the sum over replicas is the global-batch
//! gradient, also when replicas get different numbers of rows.

use candle_comm::{CommError, Communicator, GradBuckets};
use candle_core::{DType, Device, Tensor, Var};
use candle_pipeline::{
    even_sizes, LossReduction, Microbatches, PipelineError, PipelineWorker, Schedule, WorkerStep,
};

use crate::transport::CommTransport;

/// Errors of [`Grid2D`]: a wrong shape, or a failure of the pipeline step or of the
/// data-parallel reduction, with this rank's place in the grid.
#[derive(Debug, thiserror::Error)]
pub enum GridError {
    /// The world, the topology and the pipeline do not fit together.
    #[error("2D grid: {0}")]
    Topology(String),
    /// The pipeline step (or preparing its batch) failed on this rank.
    #[error("stage {stage}, replica {replica}: {source}")]
    Pipeline {
        /// This rank's pipeline stage (worker).
        stage: usize,
        /// This rank's replica.
        replica: usize,
        /// The pipeline error.
        source: Box<PipelineError>,
    },
    /// Splitting the world or the data-parallel reduction failed on this rank.
    #[error("stage {stage}, replica {replica}: {source}")]
    Comm {
        /// This rank's pipeline stage (worker).
        stage: usize,
        /// This rank's replica.
        replica: usize,
        /// The communication error (it names the rank in the world and in its group).
        source: Box<CommError>,
    },
}

/// The shape of a 2D grid: `stages` pipeline workers times `replicas` data-parallel replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    /// Pipeline workers per replica.
    pub stages: usize,
    /// Data-parallel replicas.
    pub replicas: usize,
}

impl Topology {
    /// A grid of `stages × replicas` ranks (both at least 1).
    pub fn new(stages: usize, replicas: usize) -> Result<Self, GridError> {
        if stages == 0 || replicas == 0 {
            return Err(GridError::Topology(format!(
                "{stages} stages x {replicas} replicas: both must be at least 1"
            )));
        }
        Ok(Self { stages, replicas })
    }

    /// Number of ranks: `stages * replicas`.
    pub fn world_size(&self) -> usize {
        self.stages * self.replicas
    }

    /// The world rank of `(stage, replica)`: `replica * stages + stage` (a replica's pipeline on
    /// consecutive ranks, so with ranks placed by node, pipeline neighbours share a node first).
    pub fn rank_of(&self, stage: usize, replica: usize) -> usize {
        replica * self.stages + stage
    }

    /// `(stage, replica)` of world rank `rank`.
    pub fn coords(&self, rank: usize) -> (usize, usize) {
        (rank % self.stages, rank / self.stages)
    }

    /// Replica `replica`'s share of a global batch (`inputs` and `targets`, the same on every
    /// rank): its rows (the global rows split as evenly as possible, the first replicas get one
    /// more) in `microbatches` microbatches whose loss weights are relative to the *global*
    /// batch. With [`LossReduction::Mean`] microbatch `k` of `rows_k` rows gets `rows_k / total
    /// rows`, so that losses and gradients summed over replicas are those of the global batch;
    /// with `Sum` every weight is 1. For a token mean with padding, build the microbatches with
    /// [`Microbatches::with_weights`] and weights `tokens_k / global tokens` instead. Its
    /// microbatches' rows are numbered in the global batch ([`Microbatches::with_first_row`]).
    pub fn replica_batch(
        &self,
        replica: usize,
        inputs: &Tensor,
        targets: &Tensor,
        microbatches: usize,
        reduction: LossReduction,
    ) -> candle_pipeline::Result<Microbatches> {
        let total = inputs.dim(0)?;
        let sizes = even_sizes(total, self.replicas)?;
        let rows = *sizes.get(replica).ok_or_else(|| {
            PipelineError::Config(format!("replica {replica} of {}", self.replicas))
        })?;
        let start: usize = sizes[..replica].iter().sum();
        let (x, t) = (
            inputs.narrow(0, start, rows)?,
            targets.narrow(0, start, rows)?,
        );
        let (mut xs, mut ts, mut ws, mut at) = (vec![], vec![], vec![], 0);
        for n in even_sizes(rows, microbatches)? {
            xs.push(x.narrow(0, at, n)?);
            ts.push(t.narrow(0, at, n)?);
            ws.push(reduction.weight(n, total));
            at += n;
        }
        // Stages see the global batch's row numbers (`Call::row`), as one process would.
        Ok(Microbatches::with_weights(xs, ts, ws)?.with_first_row(start))
    }
}

/// One rank of a 2D grid: its pipeline communicator (ranks of its replica, pipeline worker =
/// stage) and its data-parallel communicator (ranks of its stage, rank = replica).
///
/// Built collectively from the world with [`Grid2D::new`] (two
/// [`Communicator::split_named`] calls, `"pipeline"` and `"dp"`: their errors name the rank in
/// the world and in the group).
pub struct Grid2D {
    topology: Topology,
    world_rank: usize,
    stage: usize,
    replica: usize,
    pipeline: Box<dyn Communicator>,
    dp: Box<dyn Communicator>,
}

impl std::fmt::Debug for Grid2D {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grid2D")
            .field("topology", &self.topology)
            .field("world_rank", &self.world_rank)
            .field("stage", &self.stage)
            .field("replica", &self.replica)
            .field("backend", &self.pipeline.backend())
            .finish()
    }
}

impl Grid2D {
    /// Splits `world` into the grid's pipeline and data-parallel groups. Every rank calls it.
    /// Fails on every rank, before any communication, when the world size is not
    /// `stages * replicas`.
    pub fn new<C: Communicator + ?Sized>(world: &C, topology: Topology) -> Result<Self, GridError> {
        let (rank, n) = (world.rank(), world.world_size());
        if n != topology.world_size() {
            return Err(GridError::Topology(format!(
                "a world of {n} ranks is not {} stages x {} replicas (= {} ranks)",
                topology.stages,
                topology.replicas,
                topology.world_size()
            )));
        }
        let (stage, replica) = topology.coords(rank);
        let comm = |source| GridError::Comm {
            stage,
            replica,
            source: Box::new(source),
        };
        let pipeline = world
            .split_named("pipeline", replica, stage)
            .map_err(comm)?;
        let dp = world.split_named("dp", stage, replica).map_err(comm)?;
        let fits = pipeline.rank() == stage
            && pipeline.world_size() == topology.stages
            && dp.rank() == replica
            && dp.world_size() == topology.replicas;
        if !fits {
            return Err(GridError::Topology(format!(
                "rank {rank}: the split gave pipeline rank {} of {} and data-parallel rank {} of \
                 {}, expected {stage} of {} and {replica} of {}",
                pipeline.rank(),
                pipeline.world_size(),
                dp.rank(),
                dp.world_size(),
                topology.stages,
                topology.replicas
            )));
        }
        Ok(Self {
            topology,
            world_rank: rank,
            stage,
            replica,
            pipeline,
            dp,
        })
    }

    /// The grid's shape.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// This rank in the world.
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// This rank's pipeline stage (its worker in its replica's pipeline).
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// This rank's replica.
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// The communicator of this rank's replica (pipeline worker `w` is its rank `w`).
    pub fn pipeline(&self) -> &dyn Communicator {
        self.pipeline.as_ref()
    }

    /// The communicator of this rank's stage across replicas (its rank is the replica).
    pub fn dp(&self) -> &dyn Communicator {
        self.dp.as_ref()
    }

    /// The pipeline transport of `worker` over this rank's pipeline group.
    pub fn transport<'a>(&'a self, worker: &PipelineWorker) -> CommTransport<&'a dyn Communicator> {
        CommTransport::for_worker(self.pipeline(), worker)
    }

    /// This replica's share of a global batch: [`Topology::replica_batch`] for this rank's
    /// replica.
    pub fn replica_batch(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        microbatches: usize,
        reduction: LossReduction,
    ) -> Result<Microbatches, GridError> {
        self.topology
            .replica_batch(self.replica, inputs, targets, microbatches, reduction)
            .map_err(|e| self.pipe_err(e))
    }

    /// Gradient buckets of `worker`'s parameters (its stages in increasing order, each stage's
    /// variables in order): the same layout on every replica of a stage.
    pub fn buckets(worker: &PipelineWorker, bucket_bytes: usize) -> GradBuckets {
        GradBuckets::new(Self::vars(worker), bucket_bytes)
    }

    /// `worker`'s parameters, in [`Grid2D::buckets`]' order (e.g. for its optimizer).
    pub fn vars(worker: &PipelineWorker) -> Vec<Var> {
        worker
            .local_stages()
            .into_iter()
            .filter_map(|vs| worker.stage(vs).map(|s| s.vars()))
            .flatten()
            .collect()
    }

    /// One training step of this rank: its pipeline worker's part of the step on its replica's
    /// `batch` (from [`Grid2D::replica_batch`]) over the pipeline group, then the sum of its
    /// gradients over the data-parallel group (one all-reduce per bucket of `buckets`, from
    /// [`Grid2D::buckets`]) and, on the last stage, of the loss. The returned step holds the
    /// global-batch gradients of this worker's parameters and, on the last stage, the global
    /// loss (`microbatch_losses` stay this replica's).
    ///
    /// A rank that fails tells both of its groups ([`Communicator::abort`]: with MPI this ends the
    /// job, naming the rank in the world and in the group; with threads the others return errors
    /// naming it).
    pub fn step(
        &self,
        worker: &PipelineWorker,
        schedule: &Schedule,
        batch: &Microbatches,
        buckets: &GradBuckets,
    ) -> Result<WorkerStep, GridError> {
        if worker.workers() != self.topology.stages || worker.worker() != self.stage {
            return Err(GridError::Topology(format!(
                "pipeline worker {} of {} on stage {} of a grid of {} stages",
                worker.worker(),
                worker.workers(),
                self.stage,
                self.topology.stages
            )));
        }
        let mut out = match worker.step(schedule, batch, &self.transport(worker)) {
            Ok(out) => out,
            Err(e) => {
                // A worker that fails while running its actions has told its pipeline group
                // already; errors found before it starts have not.
                let before = matches!(
                    e,
                    PipelineError::Config(_) | PipelineError::InvalidSchedule(_)
                );
                let e = self.pipe_err(e);
                let reason = e.to_string();
                if before {
                    self.pipeline.abort(&reason);
                }
                self.dp.abort(&reason);
                return Err(e);
            }
        };
        if let Err(e) = self.reduce(worker, buckets, &mut out) {
            let e = GridError::Comm {
                stage: self.stage,
                replica: self.replica,
                source: Box::new(e),
            };
            let reason = e.to_string();
            self.dp.abort(&reason);
            self.pipeline.abort(&reason);
            return Err(e);
        }
        Ok(out)
    }

    /// Sums the gradients (and the loss, on the last stage) over the data-parallel group.
    fn reduce(
        &self,
        worker: &PipelineWorker,
        buckets: &GradBuckets,
        out: &mut WorkerStep,
    ) -> candle_comm::Result<()> {
        buckets.all_reduce_sum(self.dp(), &mut out.grads)?;
        if worker.hosts_loss() && self.topology.replicas > 1 {
            let at = |source| CommError::Candle {
                rank: self.dp.rank(),
                op: candle_comm::Op::AllReduce,
                source,
            };
            let loss = Tensor::new(&[out.loss], &Device::Cpu).map_err(at)?;
            let sum = self.dp.all_reduce_sum(&loss)?;
            out.loss = sum
                .to_dtype(DType::F64)
                .and_then(|t| t.to_vec1::<f64>())
                .map_err(at)?
                .first()
                .copied()
                .unwrap_or(f64::NAN);
        }
        Ok(())
    }

    fn pipe_err(&self, source: PipelineError) -> GridError {
        GridError::Pipeline {
            stage: self.stage,
            replica: self.replica,
            source: Box::new(source),
        }
    }
}
