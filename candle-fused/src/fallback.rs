//! The composite fallback for devices without a kernel.
//!
//! On a device with no kernel (CUDA and Metal until their kernels land), an op computes its
//! output with ordinary Candle ops on **detached** inputs, so no intermediate is recorded, and
//! attaches that output to the graph through the op itself: its `cuda_fwd` / `metal_fwd` hands
//! back the precomputed storage ([`Precomputed`]). The op's `bwd` is the same on every device,
//! so the graph keeps only the op's inputs, its output and small statistics, as with the kernel.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, MetalStorage, Shape, Storage, Tensor};
use std::sync::Mutex;

/// An output computed outside the op, waiting for the op's forward to take it.
#[derive(Default)]
pub struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    /// Holds `t` (made contiguous from offset 0, so the storage clone matches the shape).
    pub fn new(t: Tensor) -> candle_core::Result<Self> {
        let t = if t.is_contiguous() && t.layout().start_offset() == 0 {
            t
        } else {
            t.force_contiguous()?
        };
        Ok(Self(Mutex::new(Some(t.detach()))))
    }

    /// Nothing precomputed (the kernel computes the output).
    pub fn none() -> Self {
        Self(Mutex::new(None))
    }

    fn take(&self) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-fused: poisoned lock".into()))?
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "candle-fused: no precomputed output (op forward run twice?)".into(),
                )
            })
    }

    /// The output as a CPU storage.
    pub fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cpu(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("candle-fused: device mismatch in precomputed output"),
        }
    }

    /// The output as a CUDA storage.
    pub fn cuda(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cuda(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("candle-fused: device mismatch in precomputed output"),
        }
    }

    /// The output as a Metal storage.
    pub fn metal(&self) -> candle_core::Result<(MetalStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Metal(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("candle-fused: device mismatch in precomputed output"),
        }
    }
}

/// Whether any of the tensors records a graph (so attaching an op node is useful).
pub fn tracks(ts: &[&Tensor]) -> bool {
    ts.iter().any(|t| t.track_op())
}

/// A slot for statistics a forward computes and its backward reads (row max / log-sum-exp,
/// LayerNorm mean and rstd).
#[derive(Default)]
pub struct Saved(Mutex<Option<Tensor>>);

impl Saved {
    /// Stores `t`.
    pub fn set(&self, t: Tensor) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(t);
        }
    }

    /// The stored tensor.
    pub fn get(&self) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-fused: poisoned lock".into()))?
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("candle-fused: statistics missing".into()))
    }
}
