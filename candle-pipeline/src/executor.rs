//! Running a [`Schedule`]: one OS thread per worker, each with its device and (on CPU) its own
//! rayon thread pool, exchanging activations and gradients through a [`Transport`].
//!
//! # Ordering GPU work across workers
//!
//! Candle's `Device::new_cuda` queues every kernel, copy, allocation and free of a thread on
//! that thread's own stream (`CU_STREAM_PER_THREAD`), and cudarc's per-buffer events do not
//! order them (they are only active once a context made a second stream, and compare stream
//! handles, which are all the same per-thread handle). Two workers on one GPU (or on two) are
//! thus two unordered streams, and so are a worker and the thread that calls
//! [`Pipeline::step`]. The executor orders every tensor that crosses threads itself:
//!
//! * activations and gradients between workers: the sender records a fence (CUDA events on its
//!   thread's streams of the tensor's and of its own device) once the tensor is complete, and
//!   the receiver makes its streams of the tensor's and of its own device wait for it before the
//!   tensor's first use (a CPU receiver waits on the host). In [`Pipeline::step_with`] the fence
//!   goes from sender to receiver through a board shared by the step's workers, keyed by the
//!   message, so no [`Transport`] can drop or skip it, and a tensor that arrives without its fence
//!   is an error. A [`PipelineWorker::step`] run alone waits for its fence on the host before
//!   handing the tensor to the transport. [`StepOutput::handoffs`] counts every hand-off and
//!   every ordered one;
//! * the caller's batch and parameters: `step_with` records an entry fence on the calling
//!   thread that each worker waits on before its first action, and each worker records an exit
//!   fence after its last one that the calling thread's streams wait on before `step_with`
//!   returns (so the gradients, and the optimizer's writes to the parameters, are ordered after
//!   the step);
//! * frees: a CUDA buffer is freed on the stream of the thread that drops its last reference
//!   (cudarc's `CudaSlice::drop`: `cuMemFreeAsync` on the slice's stream handle, the per-thread
//!   handle, so the dropping thread's stream). This is ordered after every other thread's use:
//!   a sender keeps each activation it sent (for its backward) and drops it only after waiting on
//!   the fence of the gradient for the same microbatch, which the receiver recorded after copying
//!   the activation into its own leaf (`Var::from_tensor` copies) and dropping its reference; a
//!   gradient is sent without the sender keeping a reference, so the receiver frees it after its
//!   own uses and after the fence that follows the sender's; what the caller gets back or lent is
//!   freed on its streams after they waited on every exit fence. After a failed step the workers
//!   drop what they hold without this ordering: no received buffer is ever written, so a stale
//!   read can only affect results that are discarded.

use std::sync::Arc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Result as CResult, Tensor};

use crate::error::{PipelineError, Result};
use crate::fence::{self, Fence, FenceBoard};
use crate::microbatch::Microbatches;
use crate::report::Timeline;
use crate::schedule::Schedule;
use crate::simulator::{simulate, Costs, Prediction};
use crate::stage::Stage;
use crate::transport::{InProcess, Transport};
use crate::worker::{Handoffs, LossFn, PipelineWorker, WorkerStep};

/// A model split into virtual stages placed on workers, with the loss of the last stage.
///
/// Virtual stage `vs` runs on worker `vs % workers` and its parameters must live on that
/// worker's device.
pub struct Pipeline {
    /// `parts[w]`: worker `w`'s stages, device, pool and the shared loss.
    parts: Vec<PipelineWorker>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stages())
            .field("workers", &self.parts)
            .finish()
    }
}

/// Result of one pipeline step.
#[derive(Debug)]
pub struct StepOutput {
    /// `sum_k weight_k * loss_k`: the full-batch loss.
    pub loss: f64,
    /// Accumulated gradients of every stage parameter (Candle's own store, keyed by `Var`).
    pub grads: GradStore,
    /// Measured timeline, in seconds from the start of the step (compute only: waiting for a
    /// message counts as idle).
    pub timeline: Timeline,
    /// Peak number of `(microbatch, stage)` activations held per worker.
    pub peak_in_flight: Vec<usize>,
    /// Mean measured forward time per virtual stage (seconds).
    pub forward_time: Vec<f64>,
    /// Mean measured backward time per virtual stage (seconds).
    pub backward_time: Vec<f64>,
    /// Activations and gradients that crossed between workers, and how many the executor
    /// ordered (all of them; see the [module docs](crate::executor)).
    pub handoffs: Handoffs,
}

impl StepOutput {
    /// Simulates `schedule` with the per-stage times measured in this step, for comparing the
    /// measured bubble with the predicted one.
    pub fn predicted(&self, schedule: &Schedule) -> Result<Prediction> {
        let n = self.forward_time.len();
        let costs = Costs {
            forward: self.forward_time.clone(),
            backward: self.backward_time.clone(),
            comm: 0.0,
            activation_bytes: vec![0.0; n],
        };
        simulate(schedule, &costs)
    }

    /// Text report: busy / idle time per worker, measured bubble and the ASCII timeline.
    pub fn report(&self, width: usize) -> String {
        let mut s = String::new();
        for (w, (b, i)) in self
            .timeline
            .busy()
            .iter()
            .zip(self.timeline.idle())
            .enumerate()
        {
            s.push_str(&format!(
                "worker {w}: busy {:.4}s idle {:.4}s peak in flight {}\n",
                b, i, self.peak_in_flight[w]
            ));
        }
        s.push_str(&self.timeline.ascii(width));
        s
    }
}

impl Pipeline {
    /// A pipeline of `stages` (virtual stages in model order) on `devices.len()` workers.
    /// `stages.len()` must be a multiple of the number of workers (`v` stages per worker).
    pub fn new<L>(stages: Vec<Box<dyn Stage>>, devices: Vec<Device>, loss: L) -> Result<Self>
    where
        L: Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync + 'static,
    {
        if devices.is_empty() || stages.is_empty() || stages.len() % devices.len() != 0 {
            return Err(PipelineError::Config(format!(
                "{} stages cannot be spread evenly over {} workers",
                stages.len(),
                devices.len()
            )));
        }
        let workers = devices.len();
        let loss: Arc<LossFn> = Arc::new(loss);
        let mut per_worker: Vec<Vec<Box<dyn Stage>>> = (0..workers).map(|_| vec![]).collect();
        for (vs, stage) in stages.into_iter().enumerate() {
            per_worker[vs % workers].push(stage);
        }
        let parts = per_worker
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(w, (stages, device))| {
                PipelineWorker::with_shared_loss(w, workers, stages, device, loss.clone())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { parts })
    }

    /// Gives every CPU worker its own rayon pool of `threads` threads. Candle's matmul (`gemm`)
    /// runs its parallel loops in the current rayon pool, so this bounds it per worker.
    ///
    /// Candle's element-wise kernels use a separate, process-wide pool sized by the environment
    /// variable `CANDLE_NUM_THREADS` (default: physical cores) which no rayon pool bounds, and
    /// which runs one parallel section at a time for all workers (so do kernels built on it,
    /// such as `candle-fused`'s): set `CANDLE_NUM_THREADS=1` before the first Candle op when
    /// workers share the cores, and each worker runs those kernels on its own thread. This
    /// function initialises that pool (`candle_core::utils::barrier_pool`) to check its size and
    /// logs a warning when it has extra threads and there are several CPU workers.
    pub fn with_cpu_threads(self, threads: usize) -> Result<Self> {
        let cpu_workers = self.parts.iter().filter(|p| p.device().is_cpu()).count();
        let parts = self
            .parts
            .into_iter()
            .map(|p| p.with_cpu_threads(threads))
            .collect::<Result<Vec<_>>>()?;
        let shared = candle_core::utils::barrier_pool().n_workers();
        if cpu_workers > 1 && shared > 0 {
            tracing::warn!(
                "Candle's element-wise pool has {shared} extra threads shared by all {cpu_workers} CPU workers; \
                 set CANDLE_NUM_THREADS=1 to keep each worker within its own pool"
            );
        }
        Ok(Self { parts })
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.parts.len()
    }

    /// Number of virtual stages.
    pub fn stages(&self) -> usize {
        self.parts.iter().map(|p| p.local_stages().len()).sum()
    }

    /// Device of worker `w`.
    pub fn device(&self, w: usize) -> Option<&Device> {
        self.parts.get(w).map(|p| p.device())
    }

    /// Worker `w`'s part of the pipeline (run it alone with [`PipelineWorker::step`]).
    pub fn worker(&self, w: usize) -> Option<&PipelineWorker> {
        self.parts.get(w)
    }

    /// Splits the pipeline into its workers, in worker order.
    pub fn into_workers(self) -> Vec<PipelineWorker> {
        self.parts
    }

    /// Keeps only worker `w`'s part (its stages; the others are dropped). For multi-process
    /// runs: every process builds the same pipeline and keeps the worker of its rank.
    pub fn into_worker(self, w: usize) -> Result<PipelineWorker> {
        let n = self.parts.len();
        self.parts
            .into_iter()
            .nth(w)
            .ok_or_else(|| PipelineError::Config(format!("no worker {w} in a pipeline of {n}")))
    }

    /// Runs one step (forward and backward of every microbatch) with in-process channels.
    pub fn step(&self, schedule: &Schedule, batch: &Microbatches) -> Result<StepOutput> {
        self.step_with(schedule, batch, InProcess::endpoints(self.workers()))
    }

    /// Runs one step with the given transport endpoints (endpoint `w` for worker `w`), one
    /// thread per worker, each running [`PipelineWorker`]'s executor.
    ///
    /// The schedule is validated first (a schedule that could deadlock is an error, not a hang).
    pub fn step_with<T: Transport + Send>(
        &self,
        schedule: &Schedule,
        batch: &Microbatches,
        transports: Vec<T>,
    ) -> Result<StepOutput> {
        if transports.len() != self.workers() {
            return Err(PipelineError::Config(format!(
                "{} transports for a pipeline of {} workers",
                transports.len(),
                self.workers()
            )));
        }
        for p in &self.parts {
            p.check(schedule, batch)?;
        }
        // The fields of a schedule are public: re-check it so a hand-made one cannot hang.
        schedule.validate()?;
        let devices = fence::distinct(
            self.parts
                .iter()
                .flat_map(|p| p.step_devices(batch))
                .collect::<Vec<_>>()
                .iter(),
        );
        // The caller's work on the batch and the parameters, for the workers to wait on.
        let entry = Fence::record(&devices).map_err(|e| PipelineError::Transport {
            worker: 0,
            message: format!("ordering the step after the caller's GPU work: {e}"),
        })?;
        let board = FenceBoard::default();
        let t0 = Instant::now();
        let results: Vec<Result<(WorkerStep, Fence)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = transports
                .into_iter()
                .zip(&self.parts)
                .enumerate()
                .map(|(w, (t, part))| {
                    let shared = Some((&board, &entry, devices.as_slice()));
                    std::thread::Builder::new()
                        .name(format!("pipeline-worker-{w}"))
                        .spawn_scoped(scope, move || part.run(schedule, batch, &t, t0, shared))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(w, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(PipelineError::Transport {
                            worker: w,
                            message: "worker thread panicked outside an action".into(),
                        })
                    }),
                    Err(e) => Err(PipelineError::Config(format!("spawning worker {w}: {e}"))),
                })
                .collect()
        });
        let mut outs = Vec::with_capacity(results.len());
        let mut exits = Vec::with_capacity(results.len());
        let mut first_err: Option<PipelineError> = None;
        for r in results {
            match r {
                Ok((o, exit)) => {
                    outs.push(o);
                    exits.push(exit);
                }
                Err(e) => {
                    if first_err
                        .as_ref()
                        .is_none_or(|f| severity(&e) < severity(f))
                    {
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        // The caller's next work (the optimizer on these gradients and parameters) comes after
        // every worker's.
        for (w, exit) in exits.iter().enumerate() {
            exit.wait_on(&devices)
                .map_err(|e| PipelineError::Transport {
                    worker: w,
                    message: format!("ordering the caller after the step's GPU work: {e}"),
                })?;
        }
        drop(board);
        StepOutput::merge(outs)
    }
}

/// Orders errors by how close they are to the root cause: a stage failure before transport
/// errors before aborts.
fn severity(e: &PipelineError) -> u8 {
    match e {
        PipelineError::Stage { .. } | PipelineError::Panic { .. } => 0,
        PipelineError::Aborted { .. } => 3,
        PipelineError::Transport { .. } => 2,
        _ => 1,
    }
}

impl StepOutput {
    /// Combines every worker's [`WorkerStep`] (one per worker, any order) into the step's
    /// output: losses summed, gradient stores joined, spans in worker order.
    pub fn merge(mut parts: Vec<WorkerStep>) -> Result<StepOutput> {
        parts.sort_by_key(|p| p.worker);
        let n = parts.first().map(|p| p.stages).unwrap_or(0);
        if parts
            .iter()
            .enumerate()
            .any(|(w, p)| p.worker != w || p.stages != n)
        {
            return Err(PipelineError::Config(
                "merging worker outputs: need exactly one output per worker of one pipeline".into(),
            ));
        }
        let (mut fsum, mut bsum, mut cnt_f, mut cnt_b) =
            (vec![0.0; n], vec![0.0; n], vec![0usize; n], vec![0usize; n]);
        let mut grads = GradStore::default();
        let mut loss = 0.0;
        let mut spans = vec![];
        let mut peaks = vec![];
        let mut handoffs = Handoffs::default();
        for o in parts {
            handoffs.add(&o.handoffs);
            grads.extend(o.grads)?;
            loss += o.loss;
            spans.push(o.spans);
            peaks.push(o.peak_in_flight);
            for (a, t) in o.times {
                let st = a.stage();
                if st >= n {
                    continue;
                }
                if a.is_forward() {
                    fsum[st] += t;
                    cnt_f[st] += 1;
                } else {
                    bsum[st] += t;
                    cnt_b[st] += 1;
                }
            }
        }
        let mean = |s: Vec<f64>, c: Vec<usize>| {
            s.into_iter()
                .zip(c)
                .map(|(s, c)| s / c.max(1) as f64)
                .collect::<Vec<_>>()
        };
        Ok(StepOutput {
            loss,
            grads,
            timeline: Timeline::new(spans),
            peak_in_flight: peaks,
            forward_time: mean(fsum, cnt_f),
            backward_time: mean(bsum, cnt_b),
            handoffs,
        })
    }
}
