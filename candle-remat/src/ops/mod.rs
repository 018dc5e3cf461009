//! Memory-lean ops with their own backward (selective recompute at op level).
//!
//! # How they are built, and why it is device-generic
//!
//! Candle's [`candle_core::CustomOp1`]/[`candle_core::CustomOp3`] hand the forward raw,
//! per-backend storages, which would force one kernel per device. Instead each op here
//! 1. computes its output with ordinary (device-generic) tensor ops on **detached** inputs, so
//!    no intermediate is recorded, keeping only small statistics (softmax row max/sum,
//!    LayerNorm mean/rstd);
//! 2. attaches that output to the graph through a custom op whose forward merely hands back a
//!    copy of the precomputed output storage (one `try_clone` per backend: CPU, CUDA, Metal, no
//!    kernel of ours), so the graph node keeps only the op's inputs, its output and the stats;
//! 3. implements `bwd` with ordinary tensor ops that recompute what is needed from the saved
//!    tensors (the attention probabilities, the normalised input, the GELU derivative).
//!
//! Cost of the scheme: one extra copy of each op's output in the forward.

pub mod attention;
pub mod gelu;
pub mod layer_norm;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, MetalStorage, Shape, Storage, Tensor};
use std::sync::Mutex;

/// Holds a precomputed output until the custom op's forward takes it.
pub(crate) struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    pub(crate) fn new(t: Tensor) -> candle_core::Result<Self> {
        // A fresh contiguous buffer starting at offset 0, so that the storage clone handed back
        // by the forward matches a contiguous layout of `t`'s shape.
        let t = if t.is_contiguous() && t.layout().start_offset() == 0 {
            t
        } else {
            t.force_contiguous()?.detach()
        };
        Ok(Self(Mutex::new(Some(t.detach()))))
    }

    fn take(&self) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-remat: poisoned lock".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("candle-remat: op forward run twice".into()))
    }

    pub(crate) fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cpu(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("candle-remat: device mismatch in precomputed output"),
        }
    }

    pub(crate) fn cuda(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cuda(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("candle-remat: device mismatch in precomputed output"),
        }
    }

    pub(crate) fn metal(&self) -> candle_core::Result<(MetalStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Metal(c) => Ok((c.try_clone(l)?, l.shape().clone())),
            _ => candle_core::bail!("candle-remat: device mismatch in precomputed output"),
        }
    }
}

/// Whether any of the tensors records a graph (so attaching a custom op node is useful).
pub(crate) fn tracks(ts: &[&Tensor]) -> bool {
    ts.iter().any(|t| t.track_op())
}
