//! One worker's part of a pipeline step: its virtual stages, its action list, its transport
//! endpoint.
//!
//! [`Pipeline::step`](crate::Pipeline::step) runs every worker of a pipeline on a thread of one
//! process, each through [`PipelineWorker`]'s executor. A multi-process run (one worker per rank,
//! possibly on different hosts) builds one [`PipelineWorker`] per process and calls
//! [`PipelineWorker::step`] with a transport endpoint that reaches the other processes.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result as CResult, Tensor, Var};

use crate::action::Action;
use crate::error::{PipelineError, Result};
use crate::fence::{self, Fence, FenceBoard};
use crate::microbatch::Microbatches;
use crate::report::Span;
use crate::schedule::Schedule;
use crate::stage::{Call, Stage, StageBackward, StageForward};
use crate::transport::{Envelope, Expected, Message, Payload, Transport};

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

    /// Runs the action list (each action's math inside this worker's pool, if any); no
    /// validation. `shared`: the in-process step's fence board, the caller's entry fence and
    /// every device of the step; `None` for a worker run alone. Returns this worker's output and
    /// its exit fence (recorded after its last action, for the caller to wait on).
    pub(crate) fn run<T: Transport + ?Sized>(
        &self,
        schedule: &Schedule,
        batch: &Microbatches,
        transport: &T,
        t0: Instant,
        shared: Option<(&FenceBoard, &Fence, &[Device])>,
    ) -> Result<(WorkerStep, Fence)> {
        let fail = |e: PipelineError| {
            tracing::error!("pipeline worker {} failed: {e}", self.worker);
            transport.abort_with(&e.to_string());
            e
        };
        let stage_err = |source: candle_core::Error| match schedule.actions[self.worker].first() {
            Some(&action) => PipelineError::Stage {
                worker: self.worker,
                action,
                source,
            },
            None => PipelineError::Transport {
                worker: self.worker,
                message: format!("ordering the step's GPU work: {source}"),
            },
        };
        let (board, devices) = match shared {
            Some((board, entry, devices)) => {
                // The caller's work on the batch and the parameters comes first.
                self.wait_fence(entry, devices)
                    .map_err(|e| fail(stage_err(e)))?;
                (Some(board), devices.to_vec())
            }
            None => {
                let devices = self.step_devices(batch);
                // Alone, the caller is this thread; only a pool's threads need ordering after it.
                if self.pool.is_some() {
                    Fence::record(&devices)
                        .and_then(|f| f.synchronize())
                        .map_err(|e| fail(stage_err(e)))?;
                }
                (None, devices)
            }
        };
        let mut run = Run {
            transport,
            st: State {
                p: self,
                schedule,
                batch,
                board,
                devices,
                mailbox: HashMap::new(),
                stash: HashMap::new(),
                vars: HashMap::new(),
                out: WorkerStep {
                    worker: self.worker,
                    stages: self.stages(),
                    loss: 0.0,
                    microbatch_losses: vec![],
                    grads: GradStore::default(),
                    spans: vec![],
                    peak_in_flight: 0,
                    times: vec![],
                    handoffs: Handoffs::default(),
                },
            },
        };
        for &action in &schedule.actions[self.worker] {
            if let Err(e) = run.run(action, t0) {
                if !matches!(e, PipelineError::Aborted { .. }) {
                    return Err(fail(e));
                }
                return Err(e);
            }
        }
        let exit = Fence::record(&run.st.devices).map_err(|e| fail(stage_err(e)))?;
        Ok((run.st.out, exit))
    }

    /// Makes this worker's compute wait for `fence`: on the GPU for a CUDA worker (its actions
    /// run on this thread), on the host otherwise (a CPU worker's actions may run on any thread
    /// of its pool, and its copies from a GPU are synchronous anyway).
    fn wait_fence(&self, fence: &Fence, devices: &[Device]) -> CResult<()> {
        if self.device.is_cuda() {
            fence.wait_on(devices)
        } else {
            fence.synchronize()
        }
    }
}

/// What a forward keeps for its backward: the input leaf (none on the first stage), the stage
/// output (the weighted loss on the last stage) and the stage's own backward, if any.
type Stashed = (Option<Var>, Tensor, Option<Box<StageBackward>>);

/// One worker during one step: its transport endpoint and its state.
struct Run<'a, T: Transport + ?Sized> {
    transport: &'a T,
    st: State<'a>,
}

/// The state of one worker during one step (`Send`: the math runs in the worker's pool).
struct State<'a> {
    p: &'a PipelineWorker,
    schedule: &'a Schedule,
    batch: &'a Microbatches,
    /// The step's shared fences (in-process runs); `None` for a worker run alone.
    board: Option<&'a FenceBoard>,
    /// Every device the step's tensors live on.
    devices: Vec<Device>,
    mailbox: HashMap<(Payload, usize, usize), Tensor>,
    /// `(mb, stage)` -> (input leaf, stage output or weighted loss, the stage's own backward).
    stash: HashMap<(usize, usize), Stashed>,
    vars: HashMap<usize, Vec<Var>>,
    out: WorkerStep,
}

impl<T: Transport + ?Sized> Run<'_, T> {
    fn run(&mut self, action: Action, t0: Instant) -> Result<()> {
        while let Some(env) = self.transport.try_recv()? {
            self.accept(env)?;
        }
        let (mb, st) = (action.mb(), action.stage());
        let p = self.st.p;
        let n = p.stages();
        let needed = match action {
            Action::Forward { .. } if st > 0 => Some(Expected {
                from: self.st.schedule.worker_of(st - 1),
                payload: Payload::Activation,
                mb,
                stage: st,
            }),
            Action::Backward { .. } if st + 1 < n => Some(Expected {
                from: self.st.schedule.worker_of(st + 1),
                payload: Payload::Gradient,
                mb,
                stage: st,
            }),
            _ => None,
        };
        let received = match needed {
            Some(e) => Some((e, self.wait(&e)?)),
            None => None,
        };
        let start = Instant::now();
        let w = p.worker;
        let state = &mut self.st;
        // Ordering and math run on the same thread (the pool's, if any): its streams are the
        // ones that must wait for a received tensor and that produced the one sent.
        let job = move || catch_unwind(AssertUnwindSafe(|| state.act(action, received)));
        let r = match &p.pool {
            Some(pool) => pool.install(job),
            None => job(),
        };
        let sends = match r {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                return Err(PipelineError::Stage {
                    worker: w,
                    action,
                    source,
                })
            }
            Err(p) => {
                let message = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".into());
                return Err(PipelineError::Panic {
                    worker: w,
                    action,
                    message,
                });
            }
        };
        if let Some(msg) = sends {
            let to = self.st.schedule.worker_of(msg.stage);
            if to == w {
                self.st
                    .mailbox
                    .insert((msg.payload, msg.mb, msg.stage), msg.tensor);
            } else {
                let h = &mut self.st.out.handoffs;
                match msg.payload {
                    Payload::Activation => h.activations_sent += 1,
                    Payload::Gradient => h.gradients_sent += 1,
                }
                self.transport.send(to, msg)?;
            }
        }
        let end = Instant::now();
        self.st.out.spans.push(Span {
            action,
            start: start.duration_since(t0).as_secs_f64(),
            end: end.duration_since(t0).as_secs_f64(),
        });
        self.st
            .out
            .times
            .push((action, end.duration_since(start).as_secs_f64()));
        Ok(())
    }

    fn accept(&mut self, env: Envelope) -> Result<()> {
        match env {
            Envelope::Data(m) => {
                self.st.mailbox.insert((m.payload, m.mb, m.stage), m.tensor);
                Ok(())
            }
            Envelope::Abort { from } => Err(PipelineError::Aborted {
                worker: self.st.p.worker,
                cause: from,
            }),
        }
    }

    /// The tensor `expected` names, from the mailbox or the transport.
    fn wait(&mut self, expected: &Expected) -> Result<Tensor> {
        let key = (expected.payload, expected.mb, expected.stage);
        loop {
            if let Some(t) = self.st.mailbox.remove(&key) {
                if expected.from != self.st.p.worker {
                    self.st.out.handoffs.received += 1;
                }
                return Ok(t);
            }
            let env = self.transport.recv_expected(expected)?;
            self.accept(env)?;
        }
    }
}

impl State<'_> {
    /// One action: orders a tensor received from another worker after its sender, runs the
    /// math, orders the tensor to send after the math. Every hand-off between workers passes
    /// here (the only caller of [`State::compute`]).
    fn act(
        &mut self,
        action: Action,
        received: Option<(Expected, Tensor)>,
    ) -> CResult<Option<Message>> {
        let received = match received {
            Some((e, t)) => {
                if e.from != self.p.worker {
                    self.order_receive(&e, &t)?;
                }
                Some(t)
            }
            None => None,
        };
        let msg = self.compute(action, received)?;
        if let Some(m) = &msg {
            if self.schedule.worker_of(m.stage) != self.p.worker {
                self.order_send(m)?;
            }
        }
        if self.p.pool.is_some() {
            // A pool thread's streams are nobody else's: finish its GPU work (if any) here,
            // which the exit fence, recorded on the worker's thread, would not cover.
            for d in &self.devices {
                if d.is_cuda() {
                    d.synchronize()?;
                }
            }
        }
        Ok(msg)
    }

    /// Records the fence of `msg` on this thread (after the math that made the tensor) and posts
    /// it for the receiver; alone, waits for it on the host, so that the tensor is complete
    /// before any transport sees it.
    fn order_send(&mut self, msg: &Message) -> CResult<()> {
        let fence = Fence::record(&fence::handoff_devices(&msg.tensor, &self.p.device))?;
        match self.board {
            Some(board) => board.post((msg.payload, msg.mb, msg.stage), fence),
            None => fence.synchronize()?,
        }
        self.out.handoffs.ordered_sends += 1;
        Ok(())
    }

    /// Makes this thread wait for the fence the sender recorded for `tensor` before anything
    /// reads it (on the GPU for a CUDA worker, on the host otherwise). Alone, the sender already
    /// waited for it. In an in-process step a tensor without a fence is an error: whatever
    /// delivered it, nothing orders it after its producer.
    fn order_receive(&mut self, e: &Expected, tensor: &Tensor) -> CResult<()> {
        if let Some(board) = self.board {
            let key = (e.payload, e.mb, e.stage);
            let devices = fence::handoff_devices(tensor, &self.p.device);
            let found = if self.p.device.is_cuda() {
                board.wait(&key, &devices)?
            } else {
                board.synchronize(&key)?
            };
            if !found {
                candle_core::bail!(
                    "{:?} of microbatch {} for stage {} arrived from worker {} without its fence",
                    e.payload,
                    e.mb,
                    e.stage,
                    e.from
                );
            }
        }
        self.out.handoffs.ordered_receives += 1;
        Ok(())
    }

    fn stage_vars(&mut self, st: usize) -> CResult<&[Var]> {
        if !self.vars.contains_key(&st) {
            let Some(stage) = self.p.stage(st) else {
                candle_core::bail!("stage {st} is not hosted on worker {}", self.p.worker);
            };
            self.vars.insert(st, stage.vars());
        }
        Ok(self.vars.get(&st).map(|v| v.as_slice()).unwrap_or(&[]))
    }

    /// Runs the stage math of `action`; returns the message to send, if any.
    fn compute(&mut self, action: Action, received: Option<Tensor>) -> CResult<Option<Message>> {
        let (mb, st) = (action.mb(), action.stage());
        let n = self.p.stages();
        let dev = &self.p.device;
        match action {
            Action::Forward { .. } => {
                let Some(stage) = self.p.stage(st) else {
                    candle_core::bail!("stage {st} is not hosted on worker {}", self.p.worker);
                };
                let (leaf, x) = match received {
                    None => (None, self.batch.input(mb).to_device(dev)?),
                    Some(x) => {
                        let v = Var::from_tensor(&x.to_device(dev)?)?;
                        let t = v.as_tensor().clone();
                        (Some(v), t)
                    }
                };
                let call = Call {
                    mb,
                    stage: st,
                    row: self.batch.row(mb),
                    key: self.batch.key(),
                };
                let (y, own_backward) = stage.forward_call(&x, &call)?.into_parts();
                let mut msg = None;
                let kept = if st + 1 == n {
                    let target = self.batch.target(mb).to_device(dev)?;
                    let l = (self.p.loss)(&y, &target)?;
                    if l.elem_count() != 1 {
                        candle_core::bail!("the loss must be a scalar, got shape {:?}", l.shape());
                    }
                    let lw = l.reshape(())?.affine(self.batch.weight(mb), 0.0)?;
                    let value = lw.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    self.out.loss += value;
                    self.out.microbatch_losses.push((mb, value));
                    lw
                } else {
                    msg = Some(Message {
                        payload: Payload::Activation,
                        mb,
                        stage: st + 1,
                        tensor: y.detach(),
                    });
                    y
                };
                self.stash.insert((mb, st), (leaf, kept, own_backward));
                self.out.peak_in_flight = self.out.peak_in_flight.max(self.stash.len());
                Ok(msg)
            }
            Action::Backward { .. } => {
                let Some((leaf, out, own_backward)) = self.stash.remove(&(mb, st)) else {
                    candle_core::bail!("no stored forward for microbatch {mb} on stage {st}");
                };
                let surrogate = match received {
                    None => out,
                    Some(g) => (out * g.to_device(dev)?.detach())?.sum_all()?,
                };
                let grads = StageForward::backward(own_backward, &surrogate)?;
                drop(surrogate);
                // Candle's backward leaves op graphs on parameter gradients (e.g. `grad * x`
                // records `x` when `x` is tracked), which keep this microbatch's activations
                // alive: detach before storing, or every microbatch's graph stays in memory.
                for v in self.stage_vars(st)?.to_vec() {
                    if let Some(g) = grads.get(v.as_tensor()) {
                        let acc = match self.out.grads.get(v.as_tensor()) {
                            Some(prev) => (prev + g)?.detach(),
                            None => g.detach(),
                        };
                        self.out.grads.insert(v.as_tensor(), acc);
                    }
                }
                Ok(match leaf {
                    Some(leaf) => {
                        let g = match grads.get(leaf.as_tensor()) {
                            Some(g) => g.detach(),
                            None => leaf.as_tensor().zeros_like()?,
                        };
                        Some(Message {
                            payload: Payload::Gradient,
                            mb,
                            stage: st - 1,
                            tensor: g,
                        })
                    }
                    None => None,
                })
            }
        }
    }
}
