//! Inverted dropout from the counter-based [`philox`](crate::philox) generator.
//!
//! Element `index` (the flat row-major index of the tensor being dropped) is dropped iff
//! `key.uniform(index) < p`; kept elements are scaled by `1 / (1 - p)`. The mask is a pure
//! function of the [`RngKey`], the shape and `p`, so:
//!
//! * the CPU kernel draws the uniforms inside the kernel, chunk by chunk, and the result is
//!   identical for any thread count;
//! * the backward regenerates the mask from the key: the graph saves nothing but the key
//!   (no mask tensor is kept alive between forward and backward);
//! * a recomputed forward (activation checkpointing) with the same key drops the same elements.
//!
//! The output is `x * mask` with `mask` in `{0, 1/(1-p)}` (the scale rounded to `x`'s dtype),
//! exactly what the composite [`dropout_composite`] computes, bit for bit. Like PyTorch, the op
//! **multiplies** by the mask, so a NaN (or an infinity) in a dropped position stays NaN in the
//! output (`NaN * 0 = NaN`), and a dropped `-x` gives `-0.0`.
//!
//! On CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`), the forward and
//! the backward run the Triton kernel (`dropout/cuda.rs`), which draws the mask **on the
//! device**, inside the kernel, from the same Philox counters: the same bits as the CPU, no
//! host round trip, nothing saved. [`dropout_mask`] (and so [`dropout_composite`], the LoRA and
//! attention fallbacks) draws its mask with that kernel too. Otherwise (Triton off, Metal, f64
//! on CUDA) the op multiplies by a mask [`dropout_mask`] draws **on the host** and copies to the
//! device: a host round trip per call.

#[cfg(feature = "cuda")]
mod cuda;

use crate::cpu::{self, Elem, Real};
use crate::cuda_kernels::{triton_flat, triton_input};
use crate::op::{self, Grads, In, Kernel};
use crate::philox::RngKey;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Result, Shape, Tensor};

/// Elements per chunk: each chunk draws its uniforms into a stack buffer and applies them.
const CHUNK: usize = 1024;
/// Cost of one element relative to a plain elementwise op (Philox rounds dominate), for the
/// parallelism threshold.
const WORK_PER_ELEM: usize = 16;

/// Errors unless `p` is in `[0, 1)`.
pub(crate) fn check_p(p: f32) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("candle-fused dropout: p must be in [0, 1), got {p}")
    }
    Ok(())
}

/// The keep scale `1 / (1 - p)` in the storage type (computed in f64, rounded via the
/// accumulation type, so every path rounds it the same way).
pub(crate) fn keep_scale<T: Elem>(p: f32) -> T {
    T::from_acc(<T::Acc as Real>::c(1.0 / (1.0 - p as f64)))
}

/// Calls `f(element, kept)` for every element of `data` (element 0 = flat index 0 of the
/// dropped tensor) with whether the mask of `(p, key)` keeps it, in parallel chunks whose
/// uniforms depend only on their position.
fn for_mask<E: Send>(data: &mut [E], p: f32, key: RngKey, f: impl Fn(&mut E, bool) + Sync) {
    cpu::for_rows(data, CHUNK, CHUNK * WORK_PER_ELEM, |c, row| {
        let mut buf = [0f32; CHUNK];
        let u = &mut buf[..row.len()];
        key.fill_uniform((c * CHUNK) as u64, u);
        for (x, &u) in row.iter_mut().zip(u.iter()) {
            f(x, u >= p);
        }
    });
}

/// Multiplies `data` (element 0 = flat index 0 of the dropped tensor) in place by the mask of
/// `(p, key)`.
fn apply_mask<T: Elem>(data: &mut [T], p: f32, key: RngKey) {
    let scale: T = keep_scale(p);
    let zero = T::from_acc(<T::Acc as Real>::ZERO);
    for_mask(data, p, key, |x, kept| {
        let m = if kept { scale } else { zero };
        // The same rounding as Candle's `x * mask` in this dtype.
        *x = T::from_acc(x.acc() * m.acc());
    });
}

/// Multiplies `data`, values of a tensor of storage type `T` held in its accumulation type, in
/// place by the mask of `(p, key)` as `T` holds it (the keep scale rounded to `T`), without
/// rounding the products: the dropout backward inside a larger f32 sum (`lora`).
pub(crate) fn apply_mask_acc<T: Elem>(data: &mut [T::Acc], p: f32, key: RngKey) {
    let scale = keep_scale::<T>(p).acc();
    let zero = <T::Acc as Real>::ZERO;
    for_mask(data, p, key, |x, kept| {
        *x *= if kept { scale } else { zero };
    });
}

/// The masked copy of a contiguous slice.
pub(crate) fn masked<T: Elem>(x: &[T], p: f32, key: RngKey) -> Vec<T> {
    let mut out = x.to_vec();
    apply_mask(&mut out, p, key);
    out
}

/// The scaled keep mask of a tensor of `shape`: element `i` is `0` if `key.uniform(i) < p`,
/// `1 / (1 - p)` (rounded to `dtype`) otherwise.
///
/// On CUDA with the Triton kernels on (f32, bf16, f16) the mask is drawn on the device (the
/// dropout kernel applied to ones); otherwise on the host (in parallel, identical for any
/// thread count) and copied to `device`, a host round trip on a GPU. The same bits either way.
/// `dtype` must be a float type; `p` must be in `[0, 1)`.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_fused::{dropout::dropout_mask, RngKey};
/// let m = dropout_mask((2, 3), 0.5, RngKey::new(1, 0), DType::F32, &Device::Cpu)?;
/// for v in m.flatten_all()?.to_vec1::<f32>()? {
///     assert!(v == 0.0 || v == 2.0);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn dropout_mask(
    shape: impl Into<Shape>,
    p: f32,
    key: RngKey,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    check_p(p)?;
    let shape: Shape = shape.into();
    let n = shape.elem_count();
    if triton_flat(device, dtype, n) {
        #[cfg(feature = "cuda")]
        return cuda::masked(&Tensor::ones(shape, dtype, device)?, p, key);
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("dropout_mask: Triton kernels need the `cuda` feature");
    }
    fn host<T: Elem + candle_core::WithDType>(
        n: usize,
        p: f32,
        key: RngKey,
        shape: Shape,
        device: &Device,
    ) -> Result<Tensor> {
        // 1 * m == m exactly in every dtype, so the mask is the kernel applied to ones.
        let mut v = vec![T::from_acc(<T::Acc as Real>::ONE); n];
        apply_mask(&mut v, p, key);
        Tensor::from_vec(v, shape, device)
    }
    cpu::dispatch!(dtype, T => host::<T>(n, p, key, shape, device))
}

/// The composite reference: `x * dropout_mask(x.shape(), p, key, ..)` with plain Candle ops
/// (`x` itself when `p == 0`). The fused [`dropout`] gives the same bits.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::{dropout::{dropout, dropout_composite}, RngKey};
/// let x = Tensor::randn(0f32, 1., (4, 5), &Device::Cpu)?;
/// let key = RngKey::new(7, 1);
/// let a = dropout(&x, 0.3, key)?.flatten_all()?.to_vec1::<f32>()?;
/// let b = dropout_composite(&x, 0.3, key)?.flatten_all()?.to_vec1::<f32>()?;
/// assert_eq!(a, b);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn dropout_composite(x: &Tensor, p: f32, key: RngKey) -> Result<Tensor> {
    check_p(p)?;
    if p == 0.0 {
        return Ok(x.clone());
    }
    x * dropout_mask(x.shape(), p, key, x.dtype(), x.device())?
}

/// Inverted dropout: `x * mask`, each element dropped with probability `p` (iff
/// `key.uniform(flat index) < p`) and the kept ones scaled by `1 / (1 - p)`.
///
/// `p` must be in `[0, 1)`; `p == 0` returns `x` unchanged. Differentiable: the backward
/// regenerates the mask from `key` (nothing else is saved). NaN stays NaN even where dropped
/// (the mask is multiplied, as in PyTorch). Use a distinct `key.site` per dropout location and
/// a fresh `key.seed` per forward pass; reuse the same key to recompute the same mask.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::{dropout::dropout, RngKey};
/// let x = Var::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
/// let y = dropout(&x, 0.5, RngKey::new(42, 0))?;
/// let g = y.sum_all()?.backward()?;
/// // d y / d x is the mask: 0 where dropped, 2 where kept.
/// let mask = g.get(&x).unwrap().to_vec1::<f32>()?;
/// let (x, y) = (x.to_vec1::<f32>()?, y.to_vec1::<f32>()?);
/// for i in 0..4 {
///     assert_eq!(y[i], x[i] * mask[i]);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn dropout(x: &Tensor, p: f32, key: RngKey) -> Result<Tensor> {
    check_p(p)?;
    if p == 0.0 {
        return Ok(x.clone());
    }
    if triton_flat(x.device(), x.dtype(), x.elem_count()) {
        // the Triton kernel (CUDA, on by default): the mask drawn in the kernel
        let op = Dropout {
            p,
            key,
            triton: true,
        };
        return op::apply(op, &[&triton_input(x)?], None, None);
    }
    let op = Dropout {
        p,
        key,
        triton: false,
    };
    if cpu::has_kernel(x) {
        return op::apply(op, &[&x.contiguous()?], None, None);
    }
    let y = dropout_composite(&x.detach(), p, key)?;
    op::apply(op, &[x], None, Some(y))
}

/// The dropout op on `(x)`.
struct Dropout {
    p: f32,
    key: RngKey,
    /// Forward and backward run the Triton kernel (CUDA, `dropout/cuda.rs`).
    triton: bool,
}

impl Kernel for Dropout {
    fn name(&self) -> &'static str {
        "candle-fused-dropout"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let (s, l) = ins[0];
        cpu::dispatch!(s.dtype(), T => {
            let x = cpu::contiguous::<T>(s, l)?;
            Ok((T::storage(masked(x, self.p, self.key)), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        cuda::fwd(ins[0], self.p, self.key)
    }

    fn bwd(&self, _ins: &[&Tensor], _y: &Tensor, grad: &Tensor) -> Result<Grads> {
        // d(x * m)/dx = m: the gradient is the upstream gradient times the regenerated mask.
        op::triton_path!(
            self.triton,
            self.name(),
            Ok([Some(cuda::masked(grad, self.p, self.key)?), None, None])
        );
        let g = if cpu::has_kernel(grad) {
            let g = grad.contiguous()?;
            cpu::dispatch!(g.dtype(), T => cpu::with_slice::<T, _>(&g, |s| {
                cpu::tensor(masked(s, self.p, self.key), g.shape())
            })?)
        } else {
            (grad.detach()
                * dropout_mask(grad.shape(), self.p, self.key, grad.dtype(), grad.device())?)?
        };
        Ok([Some(g), None, None])
    }
}
