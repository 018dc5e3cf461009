//! A world of one rank.

use std::cell::RefCell;
use std::collections::VecDeque;

use candle_core::{Device, Tensor};

use crate::comm::{check_peer, check_tag, scatter_rows, Communicator, ReduceOp};
use crate::error::{CandleContext, CommError, Op, Result};
use crate::group::{plan, Membership};
use crate::host::{gathered_shape, wire_dtype};

/// The communicator of a single process: rank 0 of a world of 1.
///
/// Collectives return a copy of their input (a reduction over one rank is the identity), so code
/// written against [`Communicator`] runs unchanged without MPI. `send` to rank 0 queues the
/// tensor and `recv` from rank 0 takes it back (an empty queue is an error, not a hang).
/// [`Local::split_group`] gives another `Local`: a group of one.
#[derive(Debug, Default)]
pub struct Local {
    queue: RefCell<VecDeque<(u32, Tensor)>>,
    group: Membership,
}

impl Local {
    /// The communicator of a world of one rank.
    pub fn new() -> Self {
        Self::default()
    }

    /// [`Communicator::split_named`] as a `Local`: the group of one of this rank. Its errors also
    /// name the world rank (0) and the group.
    pub fn split_group(&self, name: &str, color: usize, key: usize) -> Result<Local> {
        let gather = |t: &Tensor| self.identity(t, Op::Split);
        let p = self
            .group
            .wrap(plan(0, 1, &self.group, name, color, key, gather))?;
        Ok(Local {
            queue: RefCell::default(),
            group: p.membership,
        })
    }

    /// A copy of `tensor`, after checking that its dtype can be communicated.
    fn identity(&self, tensor: &Tensor, op: Op) -> Result<Tensor> {
        wire_dtype(tensor.dtype(), 0, op)?;
        tensor.copy().at(0, op)
    }

    fn raw_recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
        check_peer(0, 1, from, Op::Recv)?;
        check_tag(0, tag, Op::Recv)?;
        let mut queue = self.queue.borrow_mut();
        let Some(pos) = queue.iter().position(|(t, _)| *t == tag) else {
            return Err(CommError::InvalidArgument {
                rank: 0,
                op: Op::Recv,
                message: format!(
                    "no message with tag {tag} was sent to rank 0 (would block forever)"
                ),
            });
        };
        let (_, t) = queue
            .remove(pos)
            .ok_or_else(|| CommError::InvalidArgument {
                rank: 0,
                op: Op::Recv,
                message: "message queue changed while receiving".to_string(),
            })?;
        t.to_device(device).at(0, Op::Recv)
    }
}

impl Communicator for Local {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn all_reduce(&self, tensor: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        self.group.wrap(self.identity(tensor, Op::AllReduce))
    }

    fn reduce_scatter(&self, tensor: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        self.group
            .wrap(scatter_rows(0, 1, tensor).and_then(|_| self.identity(tensor, Op::ReduceScatter)))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let out = self.identity(tensor, Op::AllGather).and_then(|out| {
            out.reshape(gathered_shape(tensor.dims(), 1))
                .at(0, Op::AllGather)
        });
        self.group.wrap(out)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let out = check_peer(0, 1, root, Op::Broadcast)
            .and_then(|_| self.identity(tensor, Op::Broadcast));
        self.group.wrap(out)
    }

    fn send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()> {
        let queued = check_peer(0, 1, to, Op::Send)
            .and_then(|_| check_tag(0, tag, Op::Send))
            .and_then(|_| self.identity(tensor, Op::Send))
            .map(|t| self.queue.borrow_mut().push_back((tag, t)));
        self.group.wrap(queued)
    }

    fn recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
        self.group.wrap(self.raw_recv(from, tag, device))
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn split_named(&self, name: &str, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_group(name, color, key)?))
    }

    fn abort(&self, _reason: &str) {}
}
