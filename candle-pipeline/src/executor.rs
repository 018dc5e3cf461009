//! Running a [`Schedule`]: one OS thread per worker, each with its device and (on CPU) its own
//! rayon thread pool, exchanging activations and gradients through a [`Transport`].

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result as CResult, Tensor, Var};

use crate::error::{PipelineError, Result};
use crate::microbatch::Microbatches;
use crate::report::{Span, Timeline};
use crate::schedule::{Action, Schedule};
use crate::simulator::{simulate, Costs, Prediction};
use crate::stage::Stage;
use crate::transport::{Envelope, InProcess, Message, Payload, Transport};

/// Loss function evaluated on the worker of the last stage: `(output, target) -> scalar`.
/// It should reduce as declared in [`crate::LossReduction`] (mean or sum over the microbatch).
pub type LossFn = dyn Fn(&Tensor, &Tensor) -> CResult<Tensor> + Send + Sync;

/// A model split into virtual stages placed on workers, with the loss of the last stage.
///
/// Virtual stage `vs` runs on worker `vs % workers` and its parameters must live on that
/// worker's device.
pub struct Pipeline {
    stages: Vec<Box<dyn Stage>>,
    devices: Vec<Device>,
    pools: Vec<Option<rayon::ThreadPool>>,
    loss: Arc<LossFn>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stages.len())
            .field("devices", &self.devices)
            .field(
                "pools",
                &self
                    .pools
                    .iter()
                    .map(|p| p.as_ref().map(|p| p.current_num_threads()))
                    .collect::<Vec<_>>(),
            )
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

struct WorkerOut {
    grads: GradStore,
    loss: f64,
    spans: Vec<Span>,
    peak: usize,
    times: Vec<(Action, f64)>,
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
        let pools = devices.iter().map(|_| None).collect();
        Ok(Self {
            stages,
            devices,
            pools,
            loss: Arc::new(loss),
        })
    }

    /// Gives every CPU worker its own rayon pool of `threads` threads. Candle's matmul (`gemm`)
    /// runs its parallel loops in the current rayon pool, so this bounds it per worker.
    ///
    /// Candle's element-wise kernels use a separate, process-wide pool sized by the environment
    /// variable `CANDLE_NUM_THREADS` (default: physical cores) which no rayon pool bounds: set
    /// `CANDLE_NUM_THREADS=1` before the first Candle op when workers share the cores. This
    /// function initialises that pool (`candle_core::utils::barrier_pool`) to check its size and
    /// logs a warning when it has extra threads and there are several CPU workers.
    pub fn with_cpu_threads(mut self, threads: usize) -> Result<Self> {
        let cpu_workers = self.devices.iter().filter(|d| d.is_cpu()).count();
        for (w, d) in self.devices.iter().enumerate() {
            if d.is_cpu() {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads.max(1))
                    .thread_name(move |i| format!("pipeline-w{w}-{i}"))
                    .build()
                    .map_err(|e| PipelineError::Config(format!("thread pool: {e}")))?;
                self.pools[w] = Some(pool);
            }
        }
        let shared = candle_core::utils::barrier_pool().n_workers();
        if cpu_workers > 1 && shared > 0 {
            tracing::warn!(
                "Candle's element-wise pool has {shared} extra threads shared by all {cpu_workers} CPU workers; \
                 set CANDLE_NUM_THREADS=1 to keep each worker within its own pool"
            );
        }
        Ok(self)
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.devices.len()
    }

    /// Number of virtual stages.
    pub fn stages(&self) -> usize {
        self.stages.len()
    }

    /// Device of worker `w`.
    pub fn device(&self, w: usize) -> Option<&Device> {
        self.devices.get(w)
    }

    /// Runs one step (forward and backward of every microbatch) with in-process channels.
    pub fn step(&self, schedule: &Schedule, batch: &Microbatches) -> Result<StepOutput> {
        self.step_with(schedule, batch, InProcess::endpoints(self.workers()))
    }

    /// Runs one step with the given transport endpoints (endpoint `w` for worker `w`).
    ///
    /// The schedule is validated first (a schedule that could deadlock is an error, not a hang).
    pub fn step_with<T: Transport>(
        &self,
        schedule: &Schedule,
        batch: &Microbatches,
        transports: Vec<T>,
    ) -> Result<StepOutput> {
        if schedule.workers != self.workers()
            || schedule.stages != self.stages()
            || schedule.microbatches != batch.len()
            || transports.len() != self.workers()
        {
            return Err(PipelineError::Config(format!(
                "schedule ({} workers, {} stages, {} microbatches) does not match the pipeline \
                 ({} workers, {} stages, {} transports) and batch ({} microbatches)",
                schedule.workers,
                schedule.stages,
                schedule.microbatches,
                self.workers(),
                self.stages(),
                transports.len(),
                batch.len()
            )));
        }
        // The fields of a schedule are public: re-check it so a hand-made one cannot hang.
        schedule.validate()?;
        let t0 = Instant::now();
        let results: Vec<Result<WorkerOut>> = std::thread::scope(|scope| {
            let handles: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(w, t)| {
                    std::thread::Builder::new()
                        .name(format!("pipeline-worker-{w}"))
                        .spawn_scoped(scope, move || {
                            let run = move || self.run_worker(w, schedule, batch, t, t0);
                            match &self.pools[w] {
                                Some(pool) => pool.install(run),
                                None => run(),
                            }
                        })
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
        self.merge(results)
    }

    fn merge(&self, results: Vec<Result<WorkerOut>>) -> Result<StepOutput> {
        // Report the root cause: a stage failure before transport errors before aborts.
        let rank = |e: &PipelineError| match e {
            PipelineError::Stage { .. } | PipelineError::Panic { .. } => 0,
            PipelineError::Aborted { .. } => 3,
            PipelineError::Transport { .. } => 2,
            _ => 1,
        };
        let mut outs = Vec::with_capacity(results.len());
        let mut first_err: Option<PipelineError> = None;
        for r in results {
            match r {
                Ok(o) => outs.push(o),
                Err(e) => {
                    if first_err.as_ref().is_none_or(|f| rank(&e) < rank(f)) {
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let n = self.stages();
        let (mut fsum, mut bsum, mut cnt_f, mut cnt_b) =
            (vec![0.0; n], vec![0.0; n], vec![0usize; n], vec![0usize; n]);
        let mut grads = GradStore::default();
        let mut loss = 0.0;
        let mut spans = vec![];
        let mut peaks = vec![];
        for o in outs {
            grads.extend(o.grads)?;
            loss += o.loss;
            spans.push(o.spans);
            peaks.push(o.peak);
            for (a, t) in o.times {
                let st = a.stage();
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
        })
    }

    fn run_worker<T: Transport>(
        &self,
        w: usize,
        schedule: &Schedule,
        batch: &Microbatches,
        transport: T,
        t0: Instant,
    ) -> Result<WorkerOut> {
        let mut worker = Worker {
            w,
            p: self,
            schedule,
            batch,
            transport: &transport,
            mailbox: HashMap::new(),
            stash: HashMap::new(),
            vars: HashMap::new(),
            out: WorkerOut {
                grads: GradStore::default(),
                loss: 0.0,
                spans: vec![],
                peak: 0,
                times: vec![],
            },
        };
        for &action in &schedule.actions[w] {
            if let Err(e) = worker.run(action, t0) {
                if !matches!(e, PipelineError::Aborted { .. }) {
                    tracing::error!("pipeline worker {w} failed: {e}");
                    transport.abort();
                }
                return Err(e);
            }
        }
        Ok(worker.out)
    }
}

struct Worker<'a, T: Transport> {
    w: usize,
    p: &'a Pipeline,
    schedule: &'a Schedule,
    batch: &'a Microbatches,
    transport: &'a T,
    mailbox: HashMap<(Payload, usize, usize), Tensor>,
    /// `(mb, stage)` -> (input leaf, stage output or weighted loss).
    stash: HashMap<(usize, usize), (Option<Var>, Tensor)>,
    vars: HashMap<usize, Vec<Var>>,
    out: WorkerOut,
}

impl<T: Transport> Worker<'_, T> {
    fn run(&mut self, action: Action, t0: Instant) -> Result<()> {
        while let Some(env) = self.transport.try_recv()? {
            self.accept(env)?;
        }
        let (mb, st) = (action.mb(), action.stage());
        let n = self.p.stages();
        let needed = match action {
            Action::Forward { .. } if st > 0 => Some((Payload::Activation, mb, st)),
            Action::Backward { .. } if st + 1 < n => Some((Payload::Gradient, mb, st)),
            _ => None,
        };
        let received = match needed {
            Some(key) => Some(self.wait(key)?),
            None => None,
        };
        let start = Instant::now();
        let w = self.w;
        let r = catch_unwind(AssertUnwindSafe(|| self.compute(action, received)));
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
            let to = self.schedule.worker_of(msg.stage);
            if to == self.w {
                self.mailbox
                    .insert((msg.payload, msg.mb, msg.stage), msg.tensor);
            } else {
                self.transport.send(to, msg)?;
            }
        }
        let end = Instant::now();
        self.out.spans.push(Span {
            action,
            start: start.duration_since(t0).as_secs_f64(),
            end: end.duration_since(t0).as_secs_f64(),
        });
        self.out
            .times
            .push((action, end.duration_since(start).as_secs_f64()));
        Ok(())
    }

    fn accept(&mut self, env: Envelope) -> Result<()> {
        match env {
            Envelope::Data(m) => {
                self.mailbox.insert((m.payload, m.mb, m.stage), m.tensor);
                Ok(())
            }
            Envelope::Abort { from } => Err(PipelineError::Aborted {
                worker: self.w,
                cause: from,
            }),
        }
    }

    fn wait(&mut self, key: (Payload, usize, usize)) -> Result<Tensor> {
        loop {
            if let Some(t) = self.mailbox.remove(&key) {
                return Ok(t);
            }
            let env = self.transport.recv()?;
            self.accept(env)?;
        }
    }

    fn stage_vars(&mut self, st: usize) -> &[Var] {
        let p = self.p;
        self.vars.entry(st).or_insert_with(|| p.stages[st].vars())
    }

    /// Runs the stage math of `action`; returns the message to send, if any.
    fn compute(&mut self, action: Action, received: Option<Tensor>) -> CResult<Option<Message>> {
        let (mb, st) = (action.mb(), action.stage());
        let n = self.p.stages();
        let dev = &self.p.devices[self.w];
        match action {
            Action::Forward { .. } => {
                let (leaf, x) = match received {
                    None => (None, self.batch.input(mb).to_device(dev)?),
                    Some(x) => {
                        let v = Var::from_tensor(&x.to_device(dev)?)?;
                        let t = v.as_tensor().clone();
                        (Some(v), t)
                    }
                };
                let y = self.p.stages[st].forward(&x)?;
                let mut msg = None;
                let kept = if st + 1 == n {
                    let target = self.batch.target(mb).to_device(dev)?;
                    let l = (self.p.loss)(&y, &target)?;
                    if l.elem_count() != 1 {
                        candle_core::bail!("the loss must be a scalar, got shape {:?}", l.shape());
                    }
                    let lw = l.reshape(())?.affine(self.batch.weight(mb), 0.0)?;
                    self.out.loss += lw.to_dtype(DType::F64)?.to_scalar::<f64>()?;
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
                self.stash.insert((mb, st), (leaf, kept));
                self.out.peak = self.out.peak.max(self.stash.len());
                Ok(msg)
            }
            Action::Backward { .. } => {
                let Some((leaf, out)) = self.stash.remove(&(mb, st)) else {
                    candle_core::bail!("no stored forward for microbatch {mb} on stage {st}");
                };
                let surrogate = match received {
                    None => out,
                    Some(g) => (out * g.to_device(dev)?.detach())?.sum_all()?,
                };
                let grads = surrogate.backward()?;
                drop(surrogate);
                // Candle's backward leaves op graphs on parameter gradients (e.g. `grad * x`
                // records `x` when `x` is tracked), which keep this microbatch's activations
                // alive: detach before storing, or every microbatch's graph stays in memory.
                for v in self.stage_vars(st).to_vec() {
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
