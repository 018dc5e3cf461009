//! The GEMMs of [`super`]: `dst (+)= lhs · rhs` over strided 2-D operands, in the
//! accumulation type (Candle's `gemm` crate) or on bf16 directly ([`crate::gemm_bf16`]), split
//! into bands over the output (never over `k`), so every element is the same sum on any number
//! of threads.

use std::borrow::Cow;

use crate::cpu::{Elem, Real};
use crate::gemm_bf16;
use crate::onednn;
use crate::pool::{self, Shared};
use candle_core::{bail, CpuStorage, Layout, Result};

/// A 2-D operand: element `(r, c)` at `r * rs + c * cs` of its slice.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// The slice a strided 2-D `layout` reads in `s` (from its start offset) and its strides.
pub(crate) fn strided<'a, T: Elem>(s: &'a CpuStorage, l: &Layout) -> Result<(&'a [T], Strided)> {
    let st = l.stride();
    if st.len() != 2 {
        bail!("candle-fused linear: the weight must be 2-D");
    }
    let data = &T::slice(s)?[l.start_offset()..];
    let (r, c) = (l.dims()[0], l.dims()[1]);
    let need = if r * c == 0 {
        0
    } else {
        (r - 1) * st[0] + (c - 1) * st[1] + 1
    };
    if data.len() < need {
        bail!("candle-fused linear: weight storage too short for its layout");
    }
    Ok((
        data,
        Strided {
            rs: st[0],
            cs: st[1],
        },
    ))
}

/// The data as the accumulation type: borrowed when `T` is it (f32, f64), widened otherwise.
pub(crate) fn widen<T: Elem>(s: &[T]) -> Cow<'_, [T::Acc]> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<T::Acc>() {
        // SAFETY: `T` and `T::Acc` are the same type (checked above), so the slice is valid
        // as `[T::Acc]` with the same length and alignment.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const T::Acc, s.len()) })
    } else {
        Cow::Owned(s.iter().map(|v| v.acc()).collect())
    }
}

/// A GEMM operand as the kernels take it: bf16 as stored (for [`gemm_bf16`]), or in the
/// accumulation type (borrowed for f32 / f64, widened for 16-bit types).
pub(crate) enum Operand<'a, A: Clone> {
    Bf16(&'a [half::bf16]),
    Acc(Cow<'a, [A]>),
}

impl<A: Clone> Operand<'_, A> {
    /// The operand from element `off` on, borrowed (a column block of a row-major matrix).
    pub(crate) fn skip(&self, off: usize) -> Operand<'_, A> {
        match self {
            Operand::Bf16(s) => Operand::Bf16(&s[off..]),
            Operand::Acc(s) => Operand::Acc(Cow::Borrowed(&s[off..])),
        }
    }

    /// The operand as [`onednn::gemm`] takes it.
    fn onednn(&self, s: Strided) -> onednn::Mat<'_, A> {
        let data = match self {
            Operand::Bf16(b) => onednn::Data::Bf16(b),
            Operand::Acc(a) => onednn::Data::Acc(a),
        };
        onednn::Mat {
            data,
            rs: s.rs,
            cs: s.cs,
        }
    }
}

/// `s` as a GEMM operand: bf16 stays bf16 when the CPU runs the bf16 kernel, anything else
/// goes through [`widen`].
pub(crate) fn operand<T: Elem>(s: &[T]) -> Operand<'_, T::Acc> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<half::bf16>() && gemm_bf16::available()
    {
        // SAFETY: `T` is `bf16` (checked above): same length, alignment and bits.
        let b = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const half::bf16, s.len()) };
        Operand::Bf16(b)
    } else {
        Operand::Acc(widen(s))
    }
}

/// Rounds back to `T` (moves the buffer when `T` is the accumulation type).
pub(crate) fn narrow<T: Elem>(v: Vec<T::Acc>) -> Vec<T> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<T::Acc>() {
        let mut v = std::mem::ManuallyDrop::new(v);
        // SAFETY: same type (checked above): pointer, length and capacity stay valid, and the
        // original vector is not dropped.
        unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut T, v.len(), v.capacity()) }
    } else {
        v.into_iter().map(T::from_acc).collect()
    }
}

/// `dst [m x n] (row-major) = acc * dst + lhs [m x k] · rhs [k x n]`, split into `threads`
/// bands run on [`pool`] when large (the split is over rows or columns of `dst`, never over
/// `k`, so the sums do not depend on the thread count). Two bf16 operands run [`gemm_bf16`], two in the
/// accumulation type Candle's `gemm` crate.
///
/// # Safety
/// `dst` is valid for writes of `m * n` elements (and initialised when `acc`); nothing else
/// accesses them during the call. With `acc == false` the elements are only written, never
/// read (`gemm` treats a zero `alpha` as "overwrite"), so they may be uninitialised.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_raw<A: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut A,
    acc: bool,
    lhs: (&Operand<'_, A>, Strided),
    rhs: (&Operand<'_, A>, Strided),
    threads: usize,
) {
    // oneDNN where it is chosen (`onednn::active`); SAFETY: `dst` per this function's
    // contract, which is `onednn::gemm`'s.
    let (l, r) = (lhs.0.onednn(lhs.1), rhs.0.onednn(rhs.1));
    if unsafe { onednn::gemm((m, n, k), dst, acc, l, r, threads) }.is_some() {
        return;
    }
    let (lhs, rhs) = match (lhs, rhs) {
        ((Operand::Acc(l), ls), (Operand::Acc(r), rs)) => ((&l[..], ls), (&r[..], rs)),
        ((Operand::Bf16(l), ls), (Operand::Bf16(r), rs)) => {
            // SAFETY: `dst` per this function's contract, which is `gemm_bf16_raw`'s.
            unsafe { gemm_bf16_raw((m, n, k), dst, acc, (l, ls), (r, rs), threads) };
            return;
        }
        _ => unreachable!("candle-fused linear: both operands come from one dtype"),
    };
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            for i in 0..m * n {
                // SAFETY: in bounds by the caller's contract.
                unsafe { dst.add(i).write(A::ZERO) };
            }
        }
        return;
    }
    let last =
        |(s, st): (&[A], Strided), r: usize, c: usize| (r - 1) * st.rs + (c - 1) * st.cs < s.len();
    assert!(
        last(lhs, m, k) && last(rhs, k, n),
        "candle-fused linear: operand out of bounds"
    );
    // one block at a time on a thread, `k` in fixed chunks of at most KC (`gemm_block`)
    let kc = k.div_ceil(k.div_ceil(KC));
    let block = |dst: Shared<A>, rows: (usize, usize), cols: (usize, usize)| {
        // SAFETY: the block lies inside dst (m x n, valid per the caller) and blocks of one
        // call are disjoint; the operands were checked above.
        unsafe { gemm_block(dst, (n, k, kc), acc, lhs, rhs, rows, cols) }
    };
    let dst = Shared(dst);
    // Split dst into `threads` bands of rows or of columns (whichever dimension is longer, in
    // multiples of 16 so every band keeps the full micro-kernel). Outputs of at most 256
    // elements take another `gemm` kernel (dot products), so no band may be that small unless
    // the whole output is (then it is not split).
    let along_rows = m >= n;
    let (len, other) = if along_rows { (m, n) } else { (n, m) };
    let band = len.div_ceil(threads.max(1)).next_multiple_of(16);
    let bands = len.div_ceil(band);
    let smallest = len - (bands - 1) * band;
    if threads < 2 || bands < 2 || m * n * k < 1 << 18 || smallest * other <= 256 {
        block(dst, (0, m), (0, n));
        return;
    }
    pool::for_each(bands, |i| {
        let (lo, hi) = (i * band, ((i + 1) * band).min(len));
        if along_rows {
            block(dst, (lo, hi), (0, n));
        } else {
            block(dst, (0, m), (lo, hi));
        }
    });
}

/// [`gemm_raw`] of two bf16 operands: [`gemm_bf16`], accumulating in f32.
///
/// # Safety
/// As [`gemm_raw`]; `A` must be f32 (asserted) and the bf16 kernel available.
unsafe fn gemm_bf16_raw<A: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut A,
    acc: bool,
    (l, ls): (&[half::bf16], Strided),
    (r, rs): (&[half::bf16], Strided),
    threads: usize,
) {
    assert!(
        std::any::TypeId::of::<A>() == std::any::TypeId::of::<f32>(),
        "candle-fused linear: bf16 accumulates in f32"
    );
    let out = gemm_bf16::Out::F32 {
        c: dst as *mut f32,
        acc,
    };
    // SAFETY: `A` is f32 (asserted); `dst` per this function's contract, which is
    // `gemm_bf16::gemm`'s; the kernel is available (`operand` checked).
    unsafe {
        gemm_bf16::gemm(
            gemm_bf16::Kernel::Avx512Bf16,
            (m, n, k),
            out,
            bf16_mat(l, ls),
            bf16_mat(r, rs),
            threads > 1,
        )
    };
}

/// A bf16 operand as [`gemm_bf16`] reads it.
fn bf16_mat(data: &[half::bf16], s: Strided) -> gemm_bf16::Mat<'_> {
    gemm_bf16::Mat {
        data,
        rs: s.rs,
        cs: s.cs,
    }
}

/// One block of `dst` (rows `r0..r1`, columns `c0..c1`; `n` columns in all) on the calling
/// thread, `k` summed in fixed chunks of at most `kc`, accumulated in order. `gemm` itself
/// blocks `k` by rules that depend on the output's size (outputs up to 64 x 64 in 512-long
/// blocks, larger ones in equal blocks of about 512): with every call's `k` at most 512 both
/// rules give one block, so an element's sum is the same whichever band computes it.
///
/// # Safety
/// The block lies inside `dst` (valid for writes, row stride `n`, initialised when `acc`),
/// no other thread touches it, and the operands cover rows / columns of the block over `k`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_block<A: Real>(
    dst: Shared<A>,
    (n, k, kc): (usize, usize, usize),
    acc: bool,
    lhs: (&[A], Strided),
    rhs: (&[A], Strided),
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) {
    for (i, k0) in (0..k).step_by(kc).enumerate() {
        // SAFETY: the block lies inside dst (m x n, row stride n, valid per the caller)
        // and, with rows k0..k0 + kc, inside both operands (asserted by `gemm_raw`); blocks
        // of one call are disjoint.
        unsafe {
            gemm::gemm(
                r1 - r0,
                c1 - c0,
                kc.min(k - k0),
                dst.at(r0 * n + c0),
                1,
                n as isize,
                acc || i > 0,
                lhs.0.as_ptr().add(r0 * lhs.1.rs + k0 * lhs.1.cs),
                lhs.1.cs as isize,
                lhs.1.rs as isize,
                rhs.0.as_ptr().add(c0 * rhs.1.cs + k0 * rhs.1.rs),
                rhs.1.cs as isize,
                rhs.1.rs as isize,
                A::ONE,
                A::ONE,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    }
}

/// The longest `k` one `gemm` call sums (see [`gemm_raw`]).
pub(crate) const KC: usize = 512;

/// A new `m x n` matrix `lhs · rhs`, written once by the GEMM (no zero-fill first).
pub(crate) fn gemm_new<A: Real>(
    m: usize,
    n: usize,
    k: usize,
    lhs: (&Operand<'_, A>, Strided),
    rhs: (&Operand<'_, A>, Strided),
    threads: usize,
) -> Vec<A> {
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: the buffer has capacity m x n, is written in full by `gemm_raw` (acc = false) and
    // only then given its length.
    unsafe {
        gemm_raw(m, n, k, out.as_mut_ptr(), false, lhs, rhs, threads);
        out.set_len(m * n);
    }
    out
}

/// A new `m x n` matrix `lhs · rhs` rounded to `T` (what `narrow(gemm_new(..))` gives). Two
/// bf16 operands with a bf16 result round each task's block as it is done ([`gemm_bf16::Out::Bf16`]):
/// no f32 matrix written and read back, the same bits.
pub(crate) fn gemm_new_t<T: Elem>(
    m: usize,
    n: usize,
    k: usize,
    lhs: (&Operand<'_, T::Acc>, Strided),
    rhs: (&Operand<'_, T::Acc>, Strided),
    threads: usize,
) -> Vec<T> {
    let ((Operand::Bf16(l), ls), (Operand::Bf16(r), rs)) = (lhs, rhs) else {
        return narrow(gemm_new(m, n, k, lhs, rhs, threads));
    };
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<half::bf16>() {
        return narrow(gemm_new(m, n, k, lhs, rhs, threads));
    }
    let mut out = Vec::<T>::with_capacity(m * n);
    let c = gemm_bf16::Out::Bf16(out.as_mut_ptr() as *mut half::bf16);
    // SAFETY: `T` is bf16 (checked above); the buffer has capacity m x n, is written in full
    // by `gemm` (no accumulation) and only then given its length; the kernel is available
    // (`operand` made bf16 operands).
    unsafe {
        gemm_bf16::gemm(
            gemm_bf16::Kernel::Avx512Bf16,
            (m, n, k),
            c,
            bf16_mat(l, ls),
            bf16_mat(r, rs),
            threads > 1,
        );
        out.set_len(m * n);
    }
    out
}
