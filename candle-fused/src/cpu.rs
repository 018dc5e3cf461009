//! Shared plumbing of the CPU kernels: element types, slices out of Candle storages, and a
//! parallel-for that does not wake the thread pool for small work.
//!
//! Kernels are written once, generic over [`Elem`]: the storage type (`f32`, `f64`, `bf16`,
//! `f16`) and the accumulation type [`Elem::Acc`] (`f64` for `f64`, `f32` otherwise), so a
//! half-precision tensor is read and written in its own dtype while every sum, exponential and
//! square root runs in f32.

use crate::pool;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Tensor};
use half::{bf16, f16};

/// Arithmetic of the accumulation types (`f32`, `f64`).
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// -inf.
    const NEG_INFINITY: Self;
    /// From an f64 constant.
    fn c(v: f64) -> Self;
    /// To f64.
    fn f64(self) -> f64;
    /// ln x.
    fn ln(self) -> Self;
    /// sqrt x.
    fn sqrt(self) -> Self;
    /// max (NaN-propagating: a NaN in either argument gives NaN).
    fn max_nan(self, o: Self) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn c(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max_nan(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else if o > self {
                    o
                } else {
                    self
                }
            }
        }
    };
}
real!(f32);
real!(f64);

/// A floating-point storage type with its accumulation type.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// The type sums and transcendental functions run in.
    type Acc: Real;
    /// Candle's dtype of this storage type.
    const DTYPE: DType;
    /// Widens to the accumulation type.
    fn acc(self) -> Self::Acc;
    /// Rounds from the accumulation type.
    fn from_acc(v: Self::Acc) -> Self;
    /// The slice of this type in a CPU storage (error if the dtype differs).
    fn slice(s: &CpuStorage) -> candle_core::Result<&[Self]>;
    /// Wraps a vector as a CPU storage.
    fn storage(v: Vec<Self>) -> CpuStorage;
}

macro_rules! elem {
    ($t:ty, $acc:ty, $dt:ident, $var:ident, $to:expr, $from:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            const DTYPE: DType = DType::$dt;
            #[inline(always)]
            fn acc(self) -> $acc {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(v: $acc) -> Self {
                $from(v)
            }
            fn slice(s: &CpuStorage) -> candle_core::Result<&[Self]> {
                match s {
                    CpuStorage::$var(v) => Ok(v),
                    other => candle_core::bail!(
                        "candle-fused: expected {:?} storage, got {:?}",
                        DType::$dt,
                        other.dtype()
                    ),
                }
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$var(v)
            }
        }
    };
}
elem!(f32, f32, F32, F32, |x| x, |x| x);
elem!(f64, f64, F64, F64, |x| x, |x| x);
elem!(bf16, f32, BF16, BF16, bf16_to_f32, f32_to_bf16);
elem!(f16, f32, F16, F16, f16::to_f32, f16::from_f32);

/// bf16 to f32: exact, a shift (inlined, so loops over it vectorise; `half`'s conversion is
/// an out-of-line call per element on CPUs with AVX512-BF16).
#[inline(always)]
pub(crate) fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// f32 to bf16, rounding to nearest even (NaN stays a quiet NaN), bit for bit what
/// `half::bf16::from_f32` gives, inlined.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    if x.is_nan() {
        bf16::from_bits(((b >> 16) | 0x0040) as u16)
    } else {
        let round = 0x7FFF + ((b >> 16) & 1);
        bf16::from_bits((b.wrapping_add(round) >> 16) as u16)
    }
}

/// The contiguous elements of `layout` in `s` (error if the layout is strided).
pub(crate) fn contiguous<'a, T: Elem>(
    s: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&T::slice(s)?[a..b]),
        None => candle_core::bail!("candle-fused: kernel input must be contiguous"),
    }
}

/// Runs `f` on the contiguous f32/f64/bf16/f16 data of `t` (a CPU tensor).
pub(crate) fn with_slice<T: Elem, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(c) => f(contiguous::<T>(c, l)?),
        _ => candle_core::bail!("candle-fused: expected a CPU tensor"),
    }
}

/// A CPU tensor of `shape` over `data`.
pub(crate) fn tensor<T: Elem + candle_core::WithDType>(
    data: Vec<T>,
    shape: impl Into<candle_core::Shape>,
) -> candle_core::Result<Tensor> {
    Tensor::from_vec(data, shape, &candle_core::Device::Cpu)
}

/// Work (in elements touched) below which a kernel runs on the calling thread: waking the
/// pool's threads costs more than it saves on small tensors. 256K: measured on the baby-GPT step bench
/// (2 cores), faster than 32K at every rank of 6 alternating runs (by 4-18%, 5-7% mid-ranks).
pub(crate) const PAR_MIN_WORK: usize = 1 << 18;

/// Calls `f(row_index, row)` for every `row_len`-long row of `out`, in parallel when
/// `rows * work_per_row` is large enough, on the calling thread otherwise. Rows are handed out
/// in contiguous chunks, one per thread, so results do not depend on scheduling.
pub(crate) fn for_rows<T: Send>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if row_len == 0 {
        return;
    }
    let rows = out.len() / row_len;
    let threads = pool::parts();
    if rows < 2 || threads == 1 || rows.saturating_mul(work_per_row.max(1)) < PAR_MIN_WORK {
        for (i, r) in out.chunks_mut(row_len).enumerate() {
            f(i, r);
        }
        return;
    }
    let per = rows.div_ceil(threads);
    pool::map_chunks_mut(out, per * row_len, |c, chunk| {
        for (j, r) in chunk.chunks_mut(row_len).enumerate() {
            f(c * per + j, r);
        }
    });
}

/// Maps `0..n` in parallel chunks (when large enough) and returns the per-chunk results in
/// order: the building block for deterministic reductions (the chunking depends only on `n`
/// and the thread count, and results are combined in chunk order).
pub(crate) fn map_chunks<R: Send>(
    n: usize,
    work_per_item: usize,
    f: impl Fn(std::ops::Range<usize>) -> R + Sync,
) -> Vec<R> {
    let threads = pool::parts();
    if n < 2 || threads == 1 || n.saturating_mul(work_per_item.max(1)) < PAR_MIN_WORK {
        return vec![f(0..n)];
    }
    let per = n.div_ceil(threads);
    pool::map(threads, |c| f((c * per).min(n)..((c + 1) * per).min(n)))
}

/// Rows per block of [`for_row_blocks`]: a function of the row count only (never of the thread
/// count), so per-block partial results summed in block order are the same on any number of
/// threads. At least 16 rows (a partial of one row's length costs at most 1/16 of the block's
/// work) and at most 256 blocks.
pub(crate) fn row_block(rows: usize) -> usize {
    rows.div_ceil(256).max(16)
}

/// Calls `f(first_row, block)` on consecutive blocks of [`row_block`]`(rows)` rows of `out`
/// (`row_len` elements each; the last block may be shorter) and returns the results in block
/// order: the building block of deterministic reductions across rows (a weight gradient summed
/// over the batch: per-block partials, then summed in order). Parallel when
/// `rows * work_per_row >= PAR_MIN_WORK`, on the calling thread otherwise; the blocks, and so
/// the results, are the same either way.
pub(crate) fn for_row_blocks<T: Send, R: Send>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync,
) -> Vec<R> {
    if row_len == 0 {
        return Vec::new();
    }
    let rows = out.len() / row_len;
    let rb = row_block(rows);
    let threads = pool::parts();
    if rows <= rb || threads == 1 || rows.saturating_mul(work_per_row.max(1)) < PAR_MIN_WORK {
        return out
            .chunks_mut(rb * row_len)
            .enumerate()
            .map(|(b, c)| f(b * rb, c))
            .collect();
    }
    pool::map_chunks_mut(out, rb * row_len, |b, c| f(b * rb, c))
}

/// `sum_i a[i] * b[i]` with 8 independent accumulators, so the loop vectorises without
/// fast-math (the summation order is fixed: the same result on every run and thread count).
#[inline(always)]
pub(crate) fn dot<A: Real>(a: &[A], b: &[A]) -> A {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [A::ZERO; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += *x * *y;
    }
    s
}

/// `sum_i f(x[i])` with 8 independent accumulators, like [`dot`] (vectorises without fast-math;
/// fixed summation order).
#[inline(always)]
pub(crate) fn sum_map<T: Copy, A: Real>(x: &[T], f: impl Fn(T) -> A) -> A {
    let mut acc = [A::ZERO; 8];
    let mut cx = x.chunks_exact(8);
    for c in &mut cx {
        for l in 0..8 {
            acc[l] += f(c[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for v in cx.remainder() {
        s += f(*v);
    }
    s
}

thread_local! {
    static FORCE_FALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Restores the previous fallback setting of this thread when dropped (also on a panic).
struct Restore(bool);

impl Drop for Restore {
    fn drop(&mut self) {
        FORCE_FALLBACK.with(|c| c.set(self.0));
    }
}

/// Runs `f` with every op of this crate on this thread taking the composite fallback (see
/// [`crate::with_composite_fallback`]).
pub(crate) fn with_fallback<R>(f: impl FnOnce() -> R) -> R {
    let _restore = Restore(FORCE_FALLBACK.with(|c| c.replace(true)));
    f()
}

/// Whether the fallback is forced on this thread ([`with_fallback`]).
pub(crate) fn fallback_forced() -> bool {
    FORCE_FALLBACK.with(|c| c.get())
}

/// Whether the tensor lives on the CPU and has a dtype the CPU kernels handle (and the
/// fallback is not forced on this thread).
pub(crate) fn has_kernel(t: &Tensor) -> bool {
    !fallback_forced()
        && t.device().is_cpu()
        && matches!(
            t.dtype(),
            DType::F32 | DType::F64 | DType::BF16 | DType::F16
        )
}

/// Dispatches a generic kernel on a dtype: `dispatch!(dtype, T => expr)` runs `expr` with `T`
/// bound to the storage type (f32, f64, bf16, f16; other dtypes are an error).
macro_rules! dispatch {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("candle-fused: no kernel for dtype {other:?}"),
        }
    };
}
pub(crate) use dispatch;

/// Where row `t` of head `(b, h)` of a tensor starts: `off + b * sb + h * sh + t * st`; the
/// feature dimension has stride 1.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View {
    pub off: usize,
    pub sb: usize,
    pub sh: usize,
    pub st: usize,
}

impl View {
    /// The view of a contiguous `[B, H, T, D]` tensor.
    pub(crate) fn bhtd(h: usize, t: usize, d: usize) -> Self {
        View {
            off: 0,
            sb: h * t * d,
            sh: t * d,
            st: d,
        }
    }

    /// Head-interleaved `[B, T, W]` rows whose head `h` sits at columns `off + h * d ..`.
    pub(crate) fn interleaved(off: usize, t: usize, w: usize, d: usize) -> Self {
        View {
            off,
            sb: t * w,
            sh: d,
            st: w,
        }
    }

    #[inline(always)]
    pub(crate) fn row(&self, b: usize, h: usize, t: usize) -> usize {
        self.off + b * self.sb + h * self.sh + t * self.st
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_threshold_is_what_the_tests_assume() {
        assert_eq!(
            PAR_MIN_WORK,
            1 << 18,
            "tests/common/mod.rs sizes its parallel cases from PAR_MIN_WORK: update it there too"
        );
    }

    #[test]
    fn bf16_conversions_match_half() {
        // Every bf16 widens exactly; f32s around every rounding case round like `half`.
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            let w = bf16_to_f32(h);
            if h.is_nan() {
                assert!(w.is_nan(), "{bits:#x}");
            } else {
                assert_eq!(w.to_bits(), h.to_f32().to_bits(), "{bits:#x}");
            }
        }
        let mut x = 0x1234_5678u32;
        for i in 0..2_000_000u32 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            // Half the samples sit exactly on a tie (low 16 bits = 0x8000).
            let v = if i % 2 == 0 {
                x
            } else {
                (x & 0xFFFF_0000) | 0x8000
            };
            let f = f32::from_bits(v);
            let (a, b) = (f32_to_bf16(f), bf16::from_f32(f));
            if f.is_nan() {
                assert!(a.is_nan() && b.is_nan());
            } else {
                assert_eq!(a.to_bits(), b.to_bits(), "{v:#x}");
            }
        }
        assert_eq!(
            f32_to_bf16(f32::INFINITY).to_bits(),
            bf16::INFINITY.to_bits()
        );
        assert_eq!(f32_to_bf16(f32::MAX).to_bits(), bf16::INFINITY.to_bits());
    }
}
