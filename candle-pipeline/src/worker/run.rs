//! Running one worker's action list for a step: receiving the tensors an action needs (from
//! the mailbox or the transport), ordering every hand-off between workers with fences, the stage
//! math of each forward and backward, and sending what it produces.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result as CResult, Tensor, Var};

use super::{Handoffs, PipelineWorker, WorkerStep};
use crate::action::Action;
use crate::error::{PipelineError, Result};
use crate::fence::{self, Fence, FenceBoard};
use crate::microbatch::Microbatches;
use crate::report::Span;
use crate::schedule::Schedule;
use crate::stage::{Call, StageBackward, StageForward};
use crate::transport::{Envelope, Expected, Message, Payload, Transport};

impl PipelineWorker {
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
