//! How every op of this crate becomes a Candle graph node, written once.
//!
//! An op is a [`Kernel`]: a CPU forward over the input storages and a backward over the input
//! tensors. [`apply`] wraps it in [`Fused`], which implements Candle's `CustomOp1/2/3` for one,
//! two or three inputs (an optional bias is the third input, or the second) by delegating to it.
//!
//! **The composite fallback.** On a device with no kernel (Metal; CUDA while the Triton
//! kernels are off or do not cover the call), an op computes its output with its composite Candle expression on **detached**
//! inputs, so no intermediate is recorded, and hands it to [`apply`], which attaches it to the
//! graph through the op itself: the op's `cuda_fwd` / `metal_fwd` (and `cpu_fwd`, when the
//! fallback is forced on the CPU) hands back that precomputed storage ([`Precomputed`]). The
//! op's backward is the same on every device, so the graph keeps only the op's inputs, its
//! output and small statistics ([`Saved`]), as with the kernel.
//!
//! **CUDA kernels.** With the `cuda` feature, an op whose Triton kernels apply (switched on,
//! see `cuda_kernels::set_triton`) is applied with nothing precomputed, and its `cuda_fwd`
//! runs [`Kernel::cuda_fwd`]; its `bwd` launches the backward kernels itself (the recipe is in
//! `cuda_kernels/launch.rs`).

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, MetalStorage,
    Result, Shape, Storage, Tensor,
};
use std::sync::Mutex;

#[cfg(feature = "cuda")]
pub(crate) use crate::cuda_kernels::launch::CudaIn;

/// What an op's CUDA forward returns: the output's storage and shape.
#[cfg(feature = "cuda")]
pub(crate) type CudaOut = Result<(CudaStorage, Shape)>;

/// The gradients of an op's inputs, in input order (`None` past the op's arity, or where an
/// input needs none).
pub(crate) type Grads = [Option<Tensor>; 3];

/// A CPU storage of one input and its layout.
pub(crate) type In<'a> = (&'a CpuStorage, &'a Layout);

/// One differentiable op: what its `CustomOp` implementations delegate to.
pub(crate) trait Kernel: Send + Sync + 'static {
    /// The op's name in Candle's graph.
    fn name(&self) -> &'static str;

    /// The output of the CPU kernel for the inputs `ins` (as many as the op was applied to).
    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)>;

    /// The output of the CUDA kernel (Triton, `cuda_kernels::launch`) for the inputs `ins`:
    /// called when the op was applied with nothing precomputed on a CUDA device, which an op
    /// does only where its kernel applies (`cuda_kernels::triton_for` and its own limits).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[CudaIn<'_>]) -> CudaOut {
        let _ = ins;
        bail!("{}: no CUDA kernel", self.name())
    }

    /// The inputs' gradients for the upstream gradient `dy` of the output `y`.
    fn bwd(&self, ins: &[&Tensor], y: &Tensor, dy: &Tensor) -> Result<Grads>;
}

/// In an op's code: when `$on` (the op took its Triton path), returns `$call` (the Triton
/// kernels' launch, the op's `cuda.rs`) from the enclosing function; without the `cuda` feature
/// no op takes that path, and this errors naming the op (`$name`).
macro_rules! triton_path {
    ($on:expr, $name:expr, $call:expr) => {
        if $on {
            #[cfg(feature = "cuda")]
            return $call;
            #[cfg(not(feature = "cuda"))]
            candle_core::bail!("{}: Triton kernels need the `cuda` feature", $name);
        }
    };
}
pub(crate) use triton_path;

/// A [`Kernel`] as a Candle custom op, with the fallback's precomputed output if any.
pub(crate) struct Fused<K> {
    kernel: K,
    pre: Option<Precomputed>,
}

impl<K: Kernel> Fused<K> {
    fn cpu(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        match &self.pre {
            Some(p) => p.cpu(),
            None => self.kernel.cpu_fwd(ins),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, ins: &[CudaIn<'_>]) -> CudaOut {
        match &self.pre {
            Some(p) => p.cuda(),
            None => self.kernel.cuda_fwd(ins),
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(&self, _: &[(&CudaStorage, &Layout)]) -> Result<(CudaStorage, Shape)> {
        self.pre()?.cuda()
    }

    fn pre(&self) -> Result<&Precomputed> {
        match &self.pre {
            Some(p) => Ok(p),
            None => bail!("{}: no kernel for this device", self.kernel.name()),
        }
    }
}

/// Runs `kernel` as a graph node over the inputs `ins` followed by `opt` when given (an
/// optional bias): one to three tensors in all, the op's `CustomOp1/2/3`.
///
/// `pre`: the output computed beforehand by the op's composite expression (devices without a
/// kernel); returned as it is when no input records a graph (no node is needed).
pub(crate) fn apply<K: Kernel>(
    kernel: K,
    ins: &[&Tensor],
    opt: Option<&Tensor>,
    pre: Option<Tensor>,
) -> Result<Tensor> {
    let (n, first) = match ins.first() {
        Some(&t) if ins.len() + usize::from(opt.is_some()) <= 3 => (ins.len(), t),
        _ => bail!("{}: takes one to three inputs", kernel.name()),
    };
    let mut all = [first; 3];
    all[..n].copy_from_slice(ins);
    let all = match opt {
        Some(t) => {
            all[n] = t;
            &all[..n + 1]
        }
        None => &all[..n],
    };
    let pre = match pre {
        Some(y) if !all.iter().any(|t| t.track_op()) => return Ok(y),
        Some(y) => Some(Precomputed::new(y)?),
        None => None,
    };
    let op = Fused { kernel, pre };
    match all {
        [a] => a.apply_op1(op),
        [a, b] => a.apply_op2(b, op),
        [a, b, c] => a.apply_op3(b, c, op),
        _ => bail!("{}: takes one to three inputs", op.kernel.name()),
    }
}

/// Implements Candle's `CustomOpN` for [`Fused`] by delegating to its [`Kernel`]: the trait,
/// the (storage, layout) argument names of its forwards, the input names of its backward, and
/// how the backward's [`Grads`] become the trait's gradients.
macro_rules! custom_op {
    ($op:ident, [$($s:ident $l:ident),+], [$($t:ident),+], $grads:ty, $pat:pat => $out:expr) => {
        impl<K: Kernel> $op for Fused<K> {
            fn name(&self) -> &'static str {
                self.kernel.name()
            }
            fn cpu_fwd(&self, $($s: &CpuStorage, $l: &Layout),+) -> Result<(CpuStorage, Shape)> {
                self.cpu(&[$(($s, $l)),+])
            }
            fn cuda_fwd(&self, $($s: &CudaStorage, $l: &Layout),+) -> Result<(CudaStorage, Shape)> {
                self.cuda(&[$(($s, $l)),+])
            }
            #[allow(unused_variables)]
            fn metal_fwd(
                &self,
                $($s: &MetalStorage, $l: &Layout),+
            ) -> Result<(MetalStorage, Shape)> {
                self.pre()?.metal()
            }
            fn bwd(&self, $($t: &Tensor,)+ y: &Tensor, dy: &Tensor) -> Result<$grads> {
                let $pat = self.kernel.bwd(&[$($t),+], y, dy)?;
                Ok($out)
            }
        }
    };
}

custom_op!(CustomOp1, [s1 l1], [a], Option<Tensor>, [da, _, _] => da);
custom_op!(CustomOp2, [s1 l1, s2 l2], [a, b], (Option<Tensor>, Option<Tensor>), [da, db, _] => (da, db));
custom_op!(
    CustomOp3,
    [s1 l1, s2 l2, s3 l3],
    [a, b, c],
    (Option<Tensor>, Option<Tensor>, Option<Tensor>),
    [da, db, dc] => (da, db, dc)
);

/// An output computed outside the op, waiting for the op's forward to take it.
struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    /// Holds `t` (made contiguous from offset 0, so the storage clone matches the shape).
    fn new(t: Tensor) -> Result<Self> {
        let t = if t.is_contiguous() && t.layout().start_offset() == 0 {
            t
        } else {
            t.force_contiguous()?
        };
        Ok(Self(Mutex::new(Some(t.detach()))))
    }

    /// The output's storage (of the device `pick` selects) and shape.
    fn take<S>(
        &self,
        pick: impl FnOnce(&Storage, &Layout) -> Option<Result<S>>,
    ) -> Result<(S, Shape)> {
        let t = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-fused: poisoned lock".into()))?
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "candle-fused: no precomputed output (op forward run twice?)".into(),
                )
            })?;
        let (s, l) = t.storage_and_layout();
        match pick(&s, l) {
            Some(storage) => Ok((storage?, l.shape().clone())),
            None => bail!("candle-fused: device mismatch in precomputed output"),
        }
    }

    fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        self.take(|s, l| match s {
            Storage::Cpu(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }

    fn cuda(&self) -> Result<(CudaStorage, Shape)> {
        self.take(|s, l| match s {
            Storage::Cuda(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }

    fn metal(&self) -> Result<(MetalStorage, Shape)> {
        self.take(|s, l| match s {
            Storage::Metal(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }
}

/// A slot for statistics a forward computes and its backward reads (row max / log-sum-exp,
/// LayerNorm mean and rstd).
#[derive(Default)]
pub(crate) struct Saved(Mutex<Option<Tensor>>);

impl Saved {
    /// Stores `t`.
    pub(crate) fn set(&self, t: Tensor) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(t);
        }
    }

    /// The stored tensor.
    pub(crate) fn get(&self) -> Result<Tensor> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-fused: poisoned lock".into()))?
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("candle-fused: statistics missing".into()))
    }
}

/// The CPU storage of a tensor's storage guard.
pub(crate) fn cpu_of(s: &Storage) -> Result<&CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        _ => bail!("candle-fused: expected a CPU tensor"),
    }
}

/// Errors unless `t` (called `name`) has the dtype and the device of `x` (called `x_name`), the
/// messages starting with `op`.
pub(crate) fn check_like(
    op: &str,
    (name, t): (&str, &Tensor),
    (x_name, x): (&str, &Tensor),
) -> Result<()> {
    let (dt, dx) = (t.dtype(), x.dtype());
    if dt != dx {
        bail!("{op}: {name} has dtype {dt:?}, {x_name} has {dx:?}")
    }
    if !t.device().same_device(x.device()) {
        bail!("{op}: {name} and {x_name} are on different devices")
    }
    Ok(())
}

/// Errors unless `t` (called `name`) has a float dtype, the message starting with `op`.
pub(crate) fn check_float(op: &str, name: &str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        dt if dt.is_float() => Ok(()),
        dt => bail!("{op}: {name} must be a float tensor, got {dt:?}"),
    }
}

/// The leading dims and the last dim `n` of `t` (called `name`, `[.., n]` with `n > 0`, the
/// last dim called `dim` in the message, which starts with `op`).
pub(crate) fn split_last<'a>(
    op: &str,
    (name, dim): (&str, &str),
    t: &'a Tensor,
) -> Result<(&'a [usize], usize)> {
    match t.dims().split_last() {
        Some((&n, lead)) if n > 0 => Ok((lead, n)),
        _ => bail!(
            "{op}: {name} must be [.., {dim}] with {dim} > 0, got shape {:?}",
            t.shape()
        ),
    }
}

/// The dtype the kernels and composite forms sum in for compute dtype `dt`: f64 for f64, else
/// f32 (16-bit inputs widen).
pub(crate) fn acc_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}
