//! One worker's part of a pipeline step: its virtual stages, its action list, its transport
//! endpoint.
//!
//! [`Pipeline::step`](crate::Pipeline::step) runs every worker of a pipeline on a thread of one
//! process, each through [`PipelineWorker`]'s executor. A multi-process run (one worker per rank,
//! possibly on different hosts) builds one [`PipelineWorker`] per process and calls
//! [`PipelineWorker::step`] with a transport endpoint that reaches the other processes.

mod run;

use std::sync::Arc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Result as CResult, Tensor, Var};

use crate::action::Action;
use crate::error::{PipelineError, Result};
use crate::fence;
use crate::microbatch::Microbatches;
use crate::report::Span;
use crate::schedule::Schedule;
use crate::stage::Stage;
use crate::transport::Transport;

/// Loss function evaluated on the worker of the last stage: `(output, target) -> scalar`.
/// It should reduce as declared in [`crate::LossReduction`] (mean or sum over the microbatch).
pub type LossFn = dyn Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync;

/// One worker of a pipeline: the virtual stages it hosts (`worker, worker + workers, ...`), its
/// device, its optional rayon pool and the loss (evaluated only when it hosts the last stage).
///
/// Get one from [`Pipeline::into_worker`](crate::Pipeline::into_worker) (every process builds
/// the same pipeline and keeps its own part) or build it with [`PipelineWorker::new`].
pub struct PipelineWorker {
    worker: usize,
    workers: usize,
    /// `stages[i]` is virtual stage `worker + i * workers`.
    stages: Vec<Box<dyn Stage>>,
    device: Device,
    pool: Option<rayon::ThreadPool>,
    loss: Arc<LossFn>,
}

impl std::fmt::Debug for PipelineWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineWorker")
            .field("worker", &self.worker)
            .field("workers", &self.workers)
            .field("stages", &self.local_stages())
            .field("device", &self.device)
            .field(
                "threads",
                &self.pool.as_ref().map(|p| p.current_num_threads()),
            )
            .finish()
    }
}

/// What one worker produced in a step.
#[derive(Debug)]
pub struct WorkerStep {
    /// The worker.
    pub worker: usize,
    /// Number of virtual stages of the whole pipeline.
    pub stages: usize,
    /// `sum_k weight_k * loss_k` over the microbatches whose last stage ran here (the full-batch
    /// loss on the worker of the last stage, 0 elsewhere).
    pub loss: f64,
    /// `(microbatch, weight * loss)` in execution order; empty unless this worker hosts the last
    /// stage.
    pub microbatch_losses: Vec<(usize, f64)>,
    /// Accumulated gradients of this worker's stage parameters.
    pub grads: GradStore,
    /// Measured spans of this worker's actions (seconds from the start of the step).
    pub spans: Vec<Span>,
    /// Peak number of `(microbatch, stage)` activations held at once.
    pub peak_in_flight: usize,
    /// Measured duration of every action (seconds).
    pub times: Vec<(Action, f64)>,
    /// The tensors this worker sent to and received from other workers, and how many of them
    /// went through the executor's ordering (see [`Handoffs`]).
    pub handoffs: Handoffs,
}

/// Counts of the tensors that crossed between workers in a step, and of those the executor
/// ordered.
///
/// A worker's thread has its own CUDA stream (Candle's `Device::new_cuda` uses
/// `CU_STREAM_PER_THREAD`), so a tensor made on one worker's thread and read on another's must be
/// ordered explicitly: the sender records a fence after the tensor is complete and the receiver
/// waits on it before its first use (see the [`executor`](crate::executor) docs). Every send
/// and every receive goes through that ordering whatever the device (on the CPU it is a no-op),
/// so `ordered_sends == activations_sent + gradients_sent` and `ordered_receives == received`;
/// summed over the workers of a step, each equals the number of activations and gradients the
/// schedule moves between workers. Hand-offs between two stages of one worker stay on its thread
/// and are not counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Handoffs {
    /// Activations given to the transport.
    pub activations_sent: usize,
    /// Gradients given to the transport.
    pub gradients_sent: usize,
    /// Tensors received through the transport and used by an action.
    pub received: usize,
    /// Sends that recorded a fence before the tensor went to the transport.
    pub ordered_sends: usize,
    /// Receives that waited on the sender's fence before the tensor was used.
    pub ordered_receives: usize,
}

impl Handoffs {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Handoffs) {
        self.activations_sent += other.activations_sent;
        self.gradients_sent += other.gradients_sent;
        self.received += other.received;
        self.ordered_sends += other.ordered_sends;
        self.ordered_receives += other.ordered_receives;
    }
}

impl PipelineWorker {
    /// Worker `worker` of `workers`, hosting `stages` (its virtual stages in increasing order:
    /// `stages[i]` is virtual stage `worker + i * workers`, so the pipeline has
    /// `stages.len() * workers` virtual stages). `loss` is evaluated on the worker that hosts the
    /// last stage; other workers never call it. The stages' parameters must live on `device`.
    pub fn new<L>(
        worker: usize,
        workers: usize,
        stages: Vec<Box<dyn Stage>>,
        device: Device,
        loss: L,
    ) -> Result<Self>
    where
        L: Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync + 'static,
    {
        Self::with_shared_loss(worker, workers, stages, device, Arc::new(loss))
    }

    pub(crate) fn with_shared_loss(
        worker: usize,
        workers: usize,
        stages: Vec<Box<dyn Stage>>,
        device: Device,
        loss: Arc<LossFn>,
    ) -> Result<Self> {
        if workers == 0 || worker >= workers || stages.is_empty() {
            return Err(PipelineError::Config(format!(
                "worker {worker} of {workers} with {} stages: need worker < workers and at least \
                 one stage",
                stages.len()
            )));
        }
        Ok(Self {
            worker,
            workers,
            stages,
            device,
            pool: None,
            loss,
        })
    }

    /// Runs this worker's actions inside its own rayon pool of `threads` threads when its device
    /// is the CPU (see [`Pipeline::with_cpu_threads`](crate::Pipeline::with_cpu_threads)).
    pub fn with_cpu_threads(mut self, threads: usize) -> Result<Self> {
        if self.device.is_cpu() {
            let w = self.worker;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads.max(1))
                .thread_name(move |i| format!("pipeline-w{w}-{i}"))
                .build()
                .map_err(|e| PipelineError::Config(format!("thread pool: {e}")))?;
            self.pool = Some(pool);
        }
        Ok(self)
    }

    /// Index of this worker.
    pub fn worker(&self) -> usize {
        self.worker
    }

    /// Number of workers of the pipeline.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Number of virtual stages of the whole pipeline.
    pub fn stages(&self) -> usize {
        self.stages.len() * self.workers
    }

    /// The virtual stages hosted here, in increasing order.
    pub fn local_stages(&self) -> Vec<usize> {
        (0..self.stages.len())
            .map(|i| self.worker + i * self.workers)
            .collect()
    }

    /// True when this worker hosts the last stage (and so computes the loss).
    pub fn hosts_loss(&self) -> bool {
        self.worker == self.workers - 1
    }

    /// Device of this worker.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The stage object of virtual stage `vs`, if it is hosted here.
    pub fn stage(&self, vs: usize) -> Option<&dyn Stage> {
        if vs % self.workers != self.worker {
            return None;
        }
        self.stages.get(vs / self.workers).map(|s| s.as_ref())
    }

    /// Runs this worker's part of one step: the actions `schedule.actions[worker]`, receiving
    /// stage inputs and output gradients from the other workers and sending its own through
    /// `transport` (whose rank must be this worker). Every other worker must run the same step
    /// with the same schedule and microbatch layout at the same time (the inputs are read on the
    /// first stage's worker, the targets and weights on the last stage's).
    ///
    /// On failure this worker calls [`Transport::abort_with`] so that the others stop too, and
    /// returns the error; a worker stopped by another's failure returns
    /// [`PipelineError::Aborted`] naming it.
    pub fn step<T: Transport + ?Sized>(
        &self,
        schedule: &Schedule,
        batch: &Microbatches,
        transport: &T,
    ) -> Result<WorkerStep> {
        self.check(schedule, batch)?;
        if transport.rank() != self.worker || transport.size() != self.workers {
            return Err(PipelineError::Config(format!(
                "transport endpoint is rank {} of {}, the worker is {} of {}",
                transport.rank(),
                transport.size(),
                self.worker,
                self.workers
            )));
        }
        schedule.validate()?;
        let t0 = Instant::now();
        self.run(schedule, batch, transport, t0, None)
            .map(|(out, _exit)| out)
    }

    /// Every device this worker's step touches: its own, its parameters', the batch's.
    pub(crate) fn step_devices(&self, batch: &Microbatches) -> Vec<Device> {
        let vars: Vec<Var> = self.stages.iter().flat_map(|s| s.vars()).collect();
        let batch_tensors = (0..batch.len()).flat_map(|k| [batch.input(k), batch.target(k)]);
        fence::distinct(
            std::iter::once(&self.device)
                .chain(vars.iter().map(|v| v.device()))
                .chain(batch_tensors.map(|t| t.device())),
        )
    }

    pub(crate) fn check(&self, schedule: &Schedule, batch: &Microbatches) -> Result<()> {
        if schedule.workers != self.workers
            || schedule.stages != self.stages()
            || schedule.microbatches != batch.len()
        {
            return Err(PipelineError::Config(format!(
                "schedule ({} workers, {} stages, {} microbatches) does not match the pipeline \
                 ({} workers, {} stages) and batch ({} microbatches)",
                schedule.workers,
                schedule.stages,
                schedule.microbatches,
                self.workers,
                self.stages(),
                batch.len()
            )));
        }
        Ok(())
    }
}
