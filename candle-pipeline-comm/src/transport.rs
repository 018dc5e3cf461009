//! [`CommTransport`]: pipeline messages over a candle-comm communicator.

use candle_comm::{CommError, Communicator, MAX_TAG};
use candle_core::Device;
use candle_pipeline::{
    Envelope, Expected, Message, Payload, PipelineError, PipelineWorker, Result, Transport,
};

/// A pipeline worker's [`Transport`] endpoint over a [`Communicator`]: pipeline worker `w` is
/// rank `w` of the communicator.
///
/// Every message is one tagged [`Communicator::send`] of the tensor (its shape and dtype travel
/// with it); the tag encodes the payload kind, the microbatch and the consuming stage (see
/// [`CommTransport::tag`]). Receives name their sender and tag: they come from
/// [`Transport::recv_expected`], which the executor calls with what its action list waits for.
#[derive(Debug)]
pub struct CommTransport<C> {
    comm: C,
    stages: usize,
    device: Device,
}

impl<C: Communicator> CommTransport<C> {
    /// The endpoint of `comm`'s rank in a pipeline of `stages` virtual stages; received tensors
    /// are placed on `device` (the worker's device).
    pub fn new(comm: C, stages: usize, device: Device) -> Self {
        Self {
            comm,
            stages,
            device,
        }
    }

    /// The endpoint for `worker` (its number of stages and its device).
    pub fn for_worker(comm: C, worker: &PipelineWorker) -> Self {
        Self::new(comm, worker.stages(), worker.device().clone())
    }

    /// The communicator (e.g. to all-reduce losses or gradients after the step).
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// Gives the communicator back.
    pub fn into_inner(self) -> C {
        self.comm
    }

    /// The tag of `(payload, mb, stage)`: `2 * (mb * stages + stage) + p` with `p = 0` for
    /// activations and `1` for gradients. It must be at most [`MAX_TAG`], so
    /// `2 * microbatches * stages <= 32768` (e.g. 8 stages and 2048 microbatches).
    pub fn tag(&self, payload: Payload, mb: usize, stage: usize) -> Result<u32> {
        let p = match payload {
            Payload::Activation => 0,
            Payload::Gradient => 1,
        };
        mb.checked_mul(self.stages)
            .and_then(|x| x.checked_add(stage))
            .and_then(|x| x.checked_mul(2))
            .and_then(|x| x.checked_add(p))
            .and_then(|t| u32::try_from(t).ok())
            .filter(|&t| stage < self.stages && t <= MAX_TAG)
            .ok_or_else(|| PipelineError::Transport {
                worker: self.comm.rank(),
                message: format!(
                    "{payload:?} of microbatch {mb} for stage {stage} has no tag: need stage < \
                     {} and 2 * (mb * stages + stage) + 1 <= {MAX_TAG} (fewer microbatches or \
                     stages per step)",
                    self.stages
                ),
            })
    }

    /// A failed peer becomes [`PipelineError::Aborted`] naming it; other errors are transport
    /// errors.
    /// A failed peer (also on a sub-communicator, [`CommError::inner`]) is the pipeline worker
    /// of its rank.
    fn error(&self, e: CommError) -> PipelineError {
        match e.inner() {
            // The failed peer reports its own error (with MPI, its line on stderr).
            CommError::PeerFailed { peer, .. } => PipelineError::Aborted {
                worker: self.comm.rank(),
                cause: *peer,
            },
            _ => PipelineError::Transport {
                worker: self.comm.rank(),
                message: e.to_string(),
            },
        }
    }
}

impl<C: Communicator> Transport for CommTransport<C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// Sends `msg.tensor` with [`CommTransport::tag`]; a peer known to have failed gives
    /// [`PipelineError::Aborted`] naming it.
    fn send(&self, to: usize, msg: Message) -> Result<()> {
        let tag = self.tag(msg.payload, msg.mb, msg.stage)?;
        self.comm
            .send(&msg.tensor, to, tag)
            .map_err(|e| self.error(e))
    }

    /// Always an error: a communicator receives from a named rank and tag only, which
    /// [`Transport::recv_expected`] knows.
    fn recv(&self) -> Result<Envelope> {
        Err(PipelineError::Transport {
            worker: self.comm.rank(),
            message: "CommTransport cannot receive from any worker: use recv_expected".into(),
        })
    }

    /// Always `None`: messages stay in the communicator until their receive is posted.
    fn try_recv(&self) -> Result<Option<Envelope>> {
        Ok(None)
    }

    /// [`Communicator::abort`] naming this pipeline worker (with MPI this ends the job).
    fn abort(&self) {
        self.abort_with("pipeline worker failed");
    }

    /// Receives exactly `expected` from its sender. A failed peer (it called
    /// [`Communicator::abort`], or its endpoint is gone) becomes [`PipelineError::Aborted`]
    /// naming it.
    fn recv_expected(&self, expected: &Expected) -> Result<Envelope> {
        let tag = self.tag(expected.payload, expected.mb, expected.stage)?;
        match self.comm.recv(expected.from, tag, &self.device) {
            Ok(tensor) => Ok(Envelope::Data(Message {
                payload: expected.payload,
                mb: expected.mb,
                stage: expected.stage,
                tensor,
            })),
            Err(e) => Err(self.error(e)),
        }
    }

    /// [`Communicator::abort`] with `reason` prefixed by the pipeline worker.
    fn abort_with(&self, reason: &str) {
        self.comm
            .abort(&format!("pipeline worker {}: {reason}", self.comm.rank()));
    }
}
