//! Moving activations and gradients between workers.
//!
//! The executor only talks to a [`Transport`] endpoint per worker, so a multi-process transport
//! (MPI between CPU hosts, NCCL between GPUs) can replace [`InProcess`] without touching the
//! schedules or the executor. When it waits, the executor says what it waits for
//! ([`Transport::recv_expected`]): transports whose receives must name the sender and the message
//! (tagged point-to-point, MPI) need no receive-from-any.

use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};

use candle_core::Tensor;

use crate::error::{PipelineError, Result};

/// What a [`Message`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Payload {
    /// Output of a forward, input of the next stage's forward.
    Activation,
    /// Gradient of the loss with respect to a stage's output.
    Gradient,
}

/// A tensor sent from one worker to another.
#[derive(Debug, Clone)]
pub struct Message {
    /// Activation or gradient.
    pub payload: Payload,
    /// Microbatch index.
    pub mb: usize,
    /// Virtual stage that consumes the tensor.
    pub stage: usize,
    /// The data (the receiver moves it to its own device).
    pub tensor: Tensor,
}

/// What a worker can receive.
#[derive(Debug, Clone)]
pub enum Envelope {
    /// A tensor.
    Data(Message),
    /// Worker `from` failed: stop.
    Abort {
        /// The failed worker.
        from: usize,
    },
}

/// The message a worker waits for, known from its action list: the input activation of
/// `Forward { mb, stage }` comes from the worker of `stage - 1`, the output gradient of
/// `Backward { mb, stage }` from the worker of `stage + 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Expected {
    /// The worker that sends it.
    pub from: usize,
    /// Activation or gradient.
    pub payload: Payload,
    /// Microbatch index.
    pub mb: usize,
    /// Virtual stage that consumes it (the receiver's stage).
    pub stage: usize,
}

/// One worker's endpoint of the communication between pipeline workers.
///
/// Endpoints need not be `Send`: [`Pipeline::step_with`](crate::Pipeline::step_with) (which moves
/// each into a thread) asks for it, [`PipelineWorker::step`](crate::PipelineWorker::step) (one
/// worker per process) does not.
pub trait Transport {
    /// Index of this worker.
    fn rank(&self) -> usize;
    /// Number of workers connected.
    fn size(&self) -> usize;
    /// Sends `msg` to worker `to` without waiting for it to be received.
    fn send(&self, to: usize, msg: Message) -> Result<()>;
    /// Blocks until a message for this worker arrives.
    fn recv(&self) -> Result<Envelope>;
    /// Returns a message if one is already waiting.
    fn try_recv(&self) -> Result<Option<Envelope>>;
    /// Tells every other worker to stop (best effort, never blocks).
    fn abort(&self);

    /// Blocks until a message arrives, knowing that the executor waits for `expected`.
    ///
    /// The executor keeps any other message that arrives first for later, so a transport may
    /// return any message; one whose receives must name the sender (tagged send / recv) returns
    /// exactly `expected`. Aborts must still come through (as [`Envelope::Abort`] or an error).
    /// The default calls [`Transport::recv`].
    fn recv_expected(&self, expected: &Expected) -> Result<Envelope> {
        let _ = expected;
        self.recv()
    }

    /// [`Transport::abort`] with the reason (the failing worker's error), for transports that
    /// can report it. The default calls [`Transport::abort`].
    fn abort_with(&self, reason: &str) {
        let _ = reason;
        self.abort()
    }
}

/// The channels of `n` in-process workers (`std::sync::mpsc`, unbounded): for each worker, in
/// order, its index, the senders to every worker (itself included, by index) and its own
/// receiver. [`InProcess::endpoints`] is made of it; a transport of one's own can be too.
pub fn channel_mesh<T>(n: usize) -> impl Iterator<Item = (usize, Vec<Sender<T>>, Receiver<T>)> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
    receivers
        .into_iter()
        .enumerate()
        .map(move |(rank, inbox)| (rank, senders.clone(), inbox))
}

/// In-process transport over `std::sync::mpsc` channels (unbounded, so sends never block).
#[derive(Debug)]
pub struct InProcess {
    rank: usize,
    peers: Vec<Sender<Envelope>>,
    inbox: Receiver<Envelope>,
}

impl InProcess {
    /// Connected endpoints for `n` workers; endpoint `w` belongs to worker `w`.
    pub fn endpoints(n: usize) -> Vec<InProcess> {
        channel_mesh(n)
            .map(|(rank, peers, inbox)| InProcess { rank, peers, inbox })
            .collect()
    }

    fn closed(&self, what: &str) -> PipelineError {
        PipelineError::Transport {
            worker: self.rank,
            message: format!("channel closed ({what})"),
        }
    }
}

impl Transport for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.peers.len()
    }

    fn send(&self, to: usize, msg: Message) -> Result<()> {
        let peer = self.peers.get(to).ok_or_else(|| PipelineError::Transport {
            worker: self.rank,
            message: format!("no worker {to}"),
        })?;
        peer.send(Envelope::Data(msg))
            .map_err(|_| self.closed(&format!("worker {to} is gone")))
    }

    fn recv(&self) -> Result<Envelope> {
        self.inbox.recv().map_err(|_| self.closed("no sender left"))
    }

    fn try_recv(&self) -> Result<Option<Envelope>> {
        match self.inbox.try_recv() {
            Ok(e) => Ok(Some(e)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(self.closed("no sender left")),
        }
    }

    fn abort(&self) {
        for (w, p) in self.peers.iter().enumerate() {
            if w != self.rank {
                let _ = p.send(Envelope::Abort { from: self.rank });
            }
        }
    }
}
