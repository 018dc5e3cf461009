//! Dtype casts between f32 and bf16/f16 on Candle's CPU threads, without a graph.
//!
//! Candle's `to_dtype` converts on the calling thread, element by element through `half`'s
//! out-of-line conversion. A mixed-precision step casts every f32 master weight to the compute
//! dtype and every weight gradient back to f32: two passes over all the parameters per step.
//! These casts give the same bits as `to_dtype` (rounding to nearest even, NaN kept a quiet NaN,
//! as `half` does), inlined so the loops vectorise, and split over the pool as the other kernels
//! are (each element converted alone: any thread count gives the same bits).

use candle_core::{DType, Tensor, Var};

use crate::cpu::{self, Elem};
use crate::pool;

/// `t` in `dtype` as a new tensor with no graph (`t.to_dtype(dtype)?.detach()`, the same
/// bits): converted in parallel for a contiguous CPU tensor cast between f32 and bf16 or f16,
/// by `to_dtype` otherwise.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let w = Tensor::new(&[1.0f32, 1.0 + 1.0 / 256.0, -3.5e-39], &Device::Cpu)?;
/// let c = candle_fused::cast::cast(&w, DType::BF16)?;
/// assert_eq!(c.to_vec1::<half::bf16>()?, w.to_dtype(DType::BF16)?.to_vec1::<half::bf16>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cast(t: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    match parallel(t, dtype)? {
        Some(out) => Ok(out),
        None => Ok(t.to_dtype(dtype)?.detach()),
    }
}

/// [`cast`] as a new [`Var`] (a leaf that gradients stop at), without the copy
/// `Var::from_tensor` makes of a tensor that is not a variable already.
pub fn cast_var(t: &Tensor, dtype: DType) -> candle_core::Result<Var> {
    let (data, shape) = match parallel_data(t, dtype)? {
        Some(v) => v,
        None => return Var::from_tensor(&t.to_dtype(dtype)?),
    };
    match data {
        Cast::F32(v) => Var::from_vec(v, shape, t.device()),
        Cast::BF16(v) => Var::from_vec(v, shape, t.device()),
        Cast::F16(v) => Var::from_vec(v, shape, t.device()),
    }
}

/// The converted elements.
enum Cast {
    F32(Vec<f32>),
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

fn parallel(t: &Tensor, dtype: DType) -> candle_core::Result<Option<Tensor>> {
    Ok(match parallel_data(t, dtype)? {
        None => None,
        Some((Cast::F32(v), shape)) => Some(cpu::tensor(v, shape)?),
        Some((Cast::BF16(v), shape)) => Some(cpu::tensor(v, shape)?),
        Some((Cast::F16(v), shape)) => Some(cpu::tensor(v, shape)?),
    })
}

/// The elements of `t` converted to `dtype` and its shape, or `None` where this module does not
/// cast (another device or pair of dtypes, a strided layout, the kernels turned off).
fn parallel_data(
    t: &Tensor,
    dtype: DType,
) -> candle_core::Result<Option<(Cast, candle_core::Shape)>> {
    if !t.device().is_cpu() || !t.is_contiguous() || cpu::fallback_forced() {
        return Ok(None);
    }
    let data = match (t.dtype(), dtype) {
        (DType::F32, DType::BF16) => Cast::BF16(cpu::with_slice(t, |s| Ok(narrow(s)))?),
        (DType::F32, DType::F16) => Cast::F16(cpu::with_slice(t, |s| Ok(narrow(s)))?),
        (DType::BF16, DType::F32) => Cast::F32(cpu::with_slice(t, |s| Ok(widen::<half::bf16>(s)))?),
        (DType::F16, DType::F32) => Cast::F32(cpu::with_slice(t, |s| Ok(widen::<half::f16>(s)))?),
        _ => return Ok(None),
    };
    Ok(Some((data, t.shape().clone())))
}

/// f32 to a 16-bit type.
fn narrow<T: Elem<Acc = f32> + Default>(src: &[f32]) -> Vec<T> {
    convert(src, T::from_acc)
}

/// A 16-bit type to f32.
fn widen<T: Elem<Acc = f32>>(src: &[T]) -> Vec<f32> {
    convert(src, T::acc)
}

/// `src` mapped by `f`, in one contiguous piece per thread when large enough.
fn convert<S: Copy + Sync, D: Copy + Default + Send>(
    src: &[S],
    f: impl Fn(S) -> D + Sync,
) -> Vec<D> {
    let mut out = vec![D::default(); src.len()];
    let per = match src.len() < cpu::PAR_MIN_WORK {
        true => src.len(),
        false => src.len().div_ceil(pool::parts()),
    };
    pool::map_chunks_mut(&mut out, per, |i, o| {
        for (d, &s) in o.iter_mut().zip(&src[i * per..]) {
            *d = f(s);
        }
    });
    out
}
