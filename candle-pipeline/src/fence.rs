//! Ordering GPU work across the threads of a pipeline step.
//!
//! Candle's `Device::new_cuda(n)` launches every kernel, copy, allocation and free on
//! `CU_STREAM_PER_THREAD` (candle-core 0.11.1 `cuda_backend/device.rs:398`, cudarc 0.19
//! `driver/safe/core.rs:691`, handle `0x2`): one `CudaDevice` shared by several threads is one
//! stream *per thread*, and two threads' streams are not ordered with each other. cudarc's
//! per-slice read/write events would order uses across streams, but they are only active in
//! "multi-stream mode" (`is_managing_stream_synchronization`, core.rs:466, set only by
//! `new_stream`/`fork`, never by `per_thread_stream`), and even then they compare stream
//! handles, which are all `0x2`. So a tensor produced on worker `a`'s thread and read on worker
//! `b`'s thread is read by kernels that nothing orders after its producer.
//!
//! The executor therefore orders every tensor that crosses threads, in one place:
//!
//! * a hand-off between workers (activation or gradient) records a [`Fence`] on the sender's
//!   thread, after the tensor is complete, and the receiver waits on it before its first use
//!   (`Run::wait`, in `worker.rs`). The fence is recorded on the streams of the tensor's device and
//!   of the sender's device, and waited on the streams of the tensor's device and of the
//!   receiver's device (`to_device` copies on the destination's stream); on the CPU it is empty
//!   and every step is a no-op, but it is still counted ([`crate::Handoffs`]);
//! * in [`Pipeline::step_with`](crate::Pipeline::step_with) the fence travels through a
//!   [`FenceBoard`] shared by the step's workers and keyed by the message, not through the
//!   [`Transport`](crate::Transport): a transport only moves the tensor and cannot drop or skip
//!   the ordering. A received tensor without its fence is an error, never a silent race;
//! * [`PipelineWorker::step`](crate::PipelineWorker::step) run alone (one worker per process) has
//!   no board: the sender waits on the host for its fence before handing the tensor to the
//!   transport, so the tensor is complete whatever the transport does with it;
//! * the step's inputs, targets and parameters are written by the caller's thread before the step
//!   and the gradients read by it after: `step_with` records an entry fence on the caller's
//!   streams that every worker waits on first, and every worker records an exit fence that the
//!   caller's streams wait on before `step_with` returns.
//!
//! Freeing: a CUDA buffer is freed by whichever thread drops the last reference, with
//! `cuMemFreeAsync` on *that* thread's stream (cudarc core.rs:855-873; the events it waits on are
//! inactive, see above). Stream-ordered frees are safe when every use of the buffer on other
//! streams is ordered before the free. In this executor:
//!
//! * an activation `y` is kept by its sender (the stage's stash, for the backward) and copied by
//!   the receiver into a fresh leaf `Var` (`Var::from_tensor` copies, Candle's `make_var`), after
//!   which the receiver drops its reference; the sender drops `y` in its backward, after it
//!   received and waited on the gradient fence of that microbatch, which the receiver recorded
//!   after its forward (and so after the copy). The last reference is the sender's and its free
//!   is ordered after the receiver's read;
//! * a gradient is sent without the sender keeping a reference (its `GradStore` is dropped when
//!   the backward returns): the receiver holds the last reference, and its free comes after its
//!   own uses and after its wait on the fence, which follows every use on the sender's stream;
//! * whatever the caller gets back (gradients) or lent (batch, parameters) is freed on the
//!   caller's streams after they waited on every worker's exit fence.
//!
//! When a step fails, the workers drop what they hold without this ordering; a stale read then
//! only affects a step whose results are discarded (no received buffer is ever written).

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{Device, Result as CResult, Tensor};

use crate::transport::Payload;

/// Events recorded on one thread's streams (one per CUDA device it was recorded for), to be
/// waited on by another thread's streams. Empty on the CPU.
#[derive(Default)]
pub(crate) struct Fence {
    #[cfg(feature = "cuda")]
    events: Vec<candle_core::cuda::cudarc::driver::CudaEvent>,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        #[cfg(feature = "cuda")]
        let n = self.events.len();
        #[cfg(not(feature = "cuda"))]
        let n = 0usize;
        f.debug_struct("Fence").field("events", &n).finish()
    }
}

/// The distinct devices among `devices` (Candle's `same_device`: a CUDA device is one
/// `CudaDevice`, so two devices opened on one GPU are two entries).
pub(crate) fn distinct<'a>(devices: impl IntoIterator<Item = &'a Device>) -> Vec<Device> {
    let mut out: Vec<Device> = vec![];
    for d in devices {
        if !out.iter().any(|o| o.same_device(d)) {
            out.push(d.clone());
        }
    }
    out
}

impl Fence {
    /// Records the work queued so far by the calling thread on the streams of `devices`.
    pub(crate) fn record(devices: &[Device]) -> CResult<Fence> {
        #[cfg(feature = "cuda")]
        {
            let mut events = vec![];
            for d in devices {
                if let Device::Cuda(c) = d {
                    // `None`: an event without timing (cudarc's default), the cheap kind.
                    let e = c
                        .cuda_stream()
                        .record_event(None)
                        .map_err(candle_core::Error::wrap)?;
                    events.push(e);
                }
            }
            Ok(Fence { events })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = devices;
            Ok(Fence {})
        }
    }

    /// Makes the calling thread's streams of `devices` wait (on the GPU, the host does not block)
    /// for the recorded work. Waiting across devices is allowed by CUDA.
    pub(crate) fn wait_on(&self, devices: &[Device]) -> CResult<()> {
        #[cfg(feature = "cuda")]
        for d in devices {
            if let Device::Cuda(c) = d {
                let s = c.cuda_stream();
                for e in &self.events {
                    s.wait(e).map_err(candle_core::Error::wrap)?;
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = devices;
        Ok(())
    }

    /// Blocks the calling thread until the recorded work is done.
    pub(crate) fn synchronize(&self) -> CResult<()> {
        #[cfg(feature = "cuda")]
        for e in &self.events {
            e.synchronize().map_err(candle_core::Error::wrap)?;
        }
        Ok(())
    }
}

/// The devices a hand-off of `tensor` touches on a worker whose device is `worker`.
pub(crate) fn handoff_devices(tensor: &Tensor, worker: &Device) -> Vec<Device> {
    distinct([tensor.device(), worker])
}

/// Key of a hand-off: what the message carries, its microbatch, the stage that consumes it.
pub(crate) type Key = (Payload, usize, usize);

/// The fences of one step's hand-offs, shared by its workers (in-process runs only).
///
/// A fence is posted before its message is given to the transport, so it is on the board by the
/// time any transport delivers the message. Fences stay here until the step ends (the board is
/// dropped after the caller waited on the workers' exit fences).
#[derive(Debug, Default)]
pub(crate) struct FenceBoard {
    fences: Mutex<HashMap<Key, Fence>>,
}

impl FenceBoard {
    pub(crate) fn post(&self, key: Key, fence: Fence) {
        self.fences
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, fence);
    }

    /// Waits (on the calling thread's streams of `devices`) on the fence of `key`; `false` when
    /// there is none.
    pub(crate) fn wait(&self, key: &Key, devices: &[Device]) -> CResult<bool> {
        let fences = self.fences.lock().unwrap_or_else(|e| e.into_inner());
        match fences.get(key) {
            Some(f) => f.wait_on(devices).map(|_| true),
            None => Ok(false),
        }
    }

    /// Blocks the calling thread until the work of the fence of `key` is done; `false` when
    /// there is none.
    pub(crate) fn synchronize(&self, key: &Key) -> CResult<bool> {
        let fences = self.fences.lock().unwrap_or_else(|e| e.into_inner());
        match fences.get(key) {
            Some(f) => f.synchronize().map(|_| true),
            None => Ok(false),
        }
    }
}
