//! The [`Communicator`] operations of [`NcclComm`].

use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView};
use candle_core::cuda::cudarc::nccl::result::NcclError;
use candle_core::cuda::cudarc::nccl::{Comm, ReduceOp as NcclOp};
use candle_core::{DType, Device, Shape, Tensor};
use std::collections::VecDeque;
use std::time::Instant;

use super::buf::{
    decode_header, encode_header, with_elem, with_view, wrap, Elem, Staged, HEADER_LEN, MAX_DIMS,
};
use super::{InFlight, NcclComm};
use crate::comm::{check_peer, check_tag, scatter_rows, Communicator, ReduceOp};
use crate::error::{CandleContext, CommError, Op, Result};
use crate::host::gathered_shape;

impl NcclComm {
    /// One collective into a new buffer of `out_len` elements: `f` enqueues it on the world
    /// communicator, then this rank waits for it.
    fn collective<T: Elem>(
        &self,
        staged: &Staged,
        out_len: usize,
        op: Op,
        f: impl FnOnce(&Comm, &CudaView<'_, T>, &mut CudaSlice<T>) -> std::result::Result<(), NcclError>,
    ) -> Result<CudaSlice<T>> {
        let rank = self.rank;
        let dev_stream = staged.device.cuda_stream();
        let mut out = staged.device.alloc_zeros::<T>(out_len).at(rank, op)?;
        self.join(&self.stream, &dev_stream, op)?;
        with_view::<T, _>(&staged.tensor, rank, op, |view| {
            self.with_comm(op, |c| f(c, &view, &mut out))
        })?;
        self.wait(&self.stream, op, "all ranks")?;
        self.join(&dev_stream, &self.stream, op)?;
        Ok(out)
    }

    /// Receives one message (header, then payload) from `from` on `stream`.
    fn recv_one(&self, from: usize, stream: &CudaStream) -> Result<(u32, Tensor)> {
        let (rank, op, peer) = (self.rank, Op::Recv, format!("rank {from}"));
        let mut header = self.cuda.alloc_zeros::<u64>(HEADER_LEN).at(rank, op)?;
        self.join(stream, &self.stream, op)?;
        self.with_link(from, op, |l| l.recv.comm.recv(&mut header, 0))?;
        self.wait(stream, op, &peer)?;
        let words = self
            .stream
            .clone_dtoh(&header)
            .map_err(|e| self.cuda_error(op, e))?;
        let (tag, dtype, dims) = decode_header(&words).map_err(|message| CommError::Mismatch {
            rank,
            op,
            peer: from,
            message,
        })?;
        let n: usize = dims.iter().product();
        if n == 0 {
            return Ok((tag, empty(dims, dtype, &self.device, rank, op)?));
        }
        let t = with_elem!(dtype, rank, op, T => {
            let mut data = self.cuda.alloc_zeros::<T>(n).at(rank, op)?;
            self.join(stream, &self.stream, op)?;
            self.with_link(from, op, |l| l.recv.comm.recv(&mut data, 0))?;
            self.wait(stream, op, &peer)?;
            Ok(wrap(data, &self.cuda, dims))
        })?;
        Ok((tag, t))
    }
}

/// A tensor without elements (NCCL is not called for those).
fn empty(
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
    rank: usize,
    op: Op,
) -> Result<Tensor> {
    crate::host::wire_dtype(dtype, rank, op)?;
    Tensor::zeros(shape, dtype, device).at(rank, op)
}

/// NCCL's reduction for `op` (Mean is `ncclAvg`).
fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Mean => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (rank, what) = (self.rank, Op::AllReduce);
        let n = tensor.elem_count();
        if n == 0 {
            return empty(tensor.shape(), tensor.dtype(), tensor.device(), rank, what);
        }
        let s = Staged::new(tensor, &self.device, rank, what)?;
        with_elem!(tensor.dtype(), rank, what, T => {
            let out = self.collective::<T>(&s, n, what, |c, v, o| {
                c.all_reduce(v, o, &nccl_op(op)).map(|_| ())
            })?;
            s.finish(out, tensor.shape(), rank, what)
        })
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (rank, what) = (self.rank, Op::ReduceScatter);
        let rows = scatter_rows(rank, self.size, tensor)?;
        let mut dims = tensor.dims().to_vec();
        dims[0] = rows;
        let block = tensor.elem_count() / self.size;
        if block == 0 {
            return empty(dims, tensor.dtype(), tensor.device(), rank, what);
        }
        let s = Staged::new(tensor, &self.device, rank, what)?;
        with_elem!(tensor.dtype(), rank, what, T => {
            let out = self.collective::<T>(&s, block, what, |c, v, o| {
                c.reduce_scatter(v, o, &nccl_op(op)).map(|_| ())
            })?;
            s.finish(out, dims, rank, what)
        })
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let (rank, what) = (self.rank, Op::AllGather);
        let dims = gathered_shape(tensor.dims(), self.size);
        let n = tensor.elem_count();
        if n == 0 {
            return empty(dims, tensor.dtype(), tensor.device(), rank, what);
        }
        let s = Staged::new(tensor, &self.device, rank, what)?;
        with_elem!(tensor.dtype(), rank, what, T => {
            let out = self.collective::<T>(&s, n * self.size, what, |c, v, o| {
                c.all_gather(v, o).map(|_| ())
            })?;
            s.finish(out, dims, rank, what)
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let (rank, what) = (self.rank, Op::Broadcast);
        check_peer(rank, self.size, root, what)?;
        if tensor.elem_count() == 0 {
            return empty(tensor.shape(), tensor.dtype(), tensor.device(), rank, what);
        }
        let s = Staged::new(tensor, &self.device, rank, what)?;
        let root = root as i32; // < world size, which NCCL holds in an i32
        with_elem!(tensor.dtype(), rank, what, T => {
            let out = self.collective::<T>(&s, tensor.elem_count(), what, |c, v, o| {
                c.broadcast(Some(v), o, root).map(|_| ())
            })?;
            s.finish(out, tensor.shape(), rank, what)
        })
    }

    fn send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()> {
        let (rank, what) = (self.rank, Op::Send);
        check_peer(rank, self.size, to, what)?;
        check_tag(rank, tag, what)?;
        if tensor.dims().len() > MAX_DIMS {
            return Err(CommError::InvalidArgument {
                rank,
                op: what,
                message: format!(
                    "{} dimensions, at most {MAX_DIMS} can be sent",
                    tensor.dims().len()
                ),
            });
        }
        if to == rank {
            crate::host::wire_dtype(tensor.dtype(), rank, what)?;
            let copy = tensor.copy().at(rank, what)?;
            let mut mail = self.mailbox.borrow_mut();
            mail.entry((rank, tag)).or_default().push_back(copy);
            return Ok(());
        }
        crate::host::wire_dtype(tensor.dtype(), rank, what)?;
        let send_stream = self.link_stream(to, what, true)?;
        self.reap(false)?;
        // The payload, with a private copy: the caller may overwrite its tensor (`Var::set`)
        // before the peer receives it (host and strided inputs were copied by staging already).
        let (data, dev_stream) = if tensor.elem_count() == 0 {
            (None, self.stream.clone())
        } else {
            let s = Staged::new(tensor, &self.device, rank, what)?;
            let data = if s.from_host || !tensor.is_contiguous() {
                s.tensor.clone()
            } else {
                s.tensor.copy().at(rank, what)?
            };
            (Some(data), s.device.cuda_stream())
        };
        let header = dev_stream
            .clone_htod(&encode_header(tag, tensor.dtype(), tensor.dims())[..])
            .map_err(|e| self.cuda_error(what, e))?;
        self.join(&send_stream, &dev_stream, what)?;
        self.with_link(to, what, |l| l.send.comm.send(&header, 1))?;
        if let Some(data) = &data {
            with_elem!(tensor.dtype(), rank, what, T => {
                with_view::<T, _>(data, rank, what, |v| {
                    self.with_link(to, what, |l| l.send.comm.send(&v, 1))
                })
            })?;
        }
        let done = send_stream
            .record_event(None)
            .map_err(|e| self.cuda_error(what, e))?;
        self.in_flight.borrow_mut().push(InFlight {
            done,
            since: Instant::now(),
            to,
            _header: header,
            _data: data,
        });
        Ok(())
    }

    fn recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
        let (rank, what) = (self.rank, Op::Recv);
        check_peer(rank, self.size, from, what)?;
        check_tag(rank, tag, what)?;
        let queued = self
            .mailbox
            .borrow_mut()
            .get_mut(&(from, tag))
            .and_then(VecDeque::pop_front);
        if let Some(t) = queued {
            return t.to_device(device).at(rank, what);
        }
        if from == rank {
            return Err(CommError::InvalidArgument {
                rank,
                op: what,
                message: format!(
                    "no message with tag {tag} was sent by rank {rank} to itself (would block \
                     forever)"
                ),
            });
        }
        let stream = self.link_stream(from, what, false)?;
        loop {
            let (got, t) = self.recv_one(from, &stream)?;
            if got == tag {
                return t.to_device(device).at(rank, what);
            }
            let mut mail = self.mailbox.borrow_mut();
            mail.entry((from, got)).or_default().push_back(t);
        }
    }

    fn barrier(&self) -> Result<()> {
        let (rank, what) = (self.rank, Op::Barrier);
        let one = Tensor::zeros(1, DType::F32, &self.device).at(rank, what)?;
        let s = Staged::new(&one, &self.device, rank, what)?;
        self.collective::<f32>(&s, 1, what, |c, v, o| {
            c.all_reduce(v, o, &NcclOp::Sum).map(|_| ())
        })?;
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.die(
            &format!("rank {} of {} failed: {reason}", self.rank, self.size),
            Some(reason),
        )
    }
}
