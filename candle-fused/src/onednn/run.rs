//! The banded oneDNN GEMM of [`super::gemm`]: one single-threaded oneDNN call per band of the
//! output, the bands spread over Candle's pool.

use std::any::TypeId;
use std::os::raw::c_char;

use super::{ffi, Data, Mat};
use crate::pool::{self, Shared};

/// The width of a band (rows or columns of the output, along its longer side). Fixed, so the
/// bands and therefore the bits do not depend on the thread count; a multiple of every
/// micro-kernel's tile, and long enough that oneDNN's packing of the other operand, repeated
/// per band, stays a small share of the products (1 / (2 x 128) of a band's work).
const BAND: usize = 128;

/// How oneDNN reads a `rows x cols` operand: `'N'` (row-major, leading dimension the row
/// stride) or `'T'` (column-major), or `None` for other strides. A dimension of 1 takes any
/// stride on its side.
fn trans(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(c_char, usize)> {
    if (cols == 1 || cs == 1) && (rows == 1 || rs >= cols) {
        Some((b'N' as c_char, if rows == 1 { cols } else { rs }.max(1)))
    } else if (rows == 1 || rs == 1) && (cols == 1 || cs >= rows) {
        Some((b'T' as c_char, if cols == 1 { rows } else { cs }.max(1)))
    } else {
        None
    }
}

/// Whether the last element of a `rows x cols` operand lies inside `len`.
fn inside(rows: usize, cols: usize, m: &Mat<'_, impl Sized>, len: usize) -> bool {
    (rows - 1) * m.rs + (cols - 1) * m.cs < len
}

/// The operands' data as oneDNN takes it: both bf16, or both f32 (`A` is f32).
enum Pair<'a> {
    Bf16(&'a [half::bf16], &'a [half::bf16]),
    F32(&'a [f32], &'a [f32]),
}

/// A product oneDNN can run: both operands f32 or both bf16, each row-major or transposed,
/// inside its slice.
pub(super) struct Job<'a> {
    mnk: (usize, usize, usize),
    pair: Pair<'a>,
    /// (trans, leading dimension) and (row stride, column stride) of each operand.
    a: ((c_char, usize), (usize, usize)),
    b: ((c_char, usize), (usize, usize)),
}

impl<'a> Job<'a> {
    pub(super) fn new<A: 'static>(
        (m, n, k): (usize, usize, usize),
        lhs: &Mat<'a, A>,
        rhs: &Mat<'a, A>,
    ) -> Option<Self> {
        if TypeId::of::<A>() != TypeId::of::<f32>() || m == 0 || n == 0 || k == 0 {
            return None;
        }
        let (pair, ll, rl) = match (&lhs.data, &rhs.data) {
            (Data::Bf16(l), Data::Bf16(r)) => (Pair::Bf16(l, r), l.len(), r.len()),
            (Data::Acc(l), Data::Acc(r)) => {
                // SAFETY: `A` is f32 (checked above): same length, alignment and bits.
                let f = |s: &'a [A]| unsafe {
                    std::slice::from_raw_parts(s.as_ptr().cast::<f32>(), s.len())
                };
                (Pair::F32(f(l), f(r)), l.len(), r.len())
            }
            _ => return None,
        };
        if !inside(m, k, lhs, ll) || !inside(k, n, rhs, rl) {
            return None;
        }
        Some(Job {
            mnk: (m, n, k),
            pair,
            a: (trans(m, k, lhs.rs, lhs.cs)?, (lhs.rs, lhs.cs)),
            b: (trans(k, n, rhs.rs, rhs.cs)?, (rhs.rs, rhs.cs)),
        })
    }

    pub(super) fn dtype(&self) -> candle_core::DType {
        match self.pair {
            Pair::Bf16(..) => candle_core::DType::BF16,
            Pair::F32(..) => candle_core::DType::F32,
        }
    }

    /// `dst (+)= lhs · rhs`, band by band (on Candle's pool when `threads > 1`).
    ///
    /// # Safety
    /// `dst` is valid for writes of `m * n` elements (initialised when `acc`), and nothing else
    /// accesses them during the call.
    pub(super) unsafe fn run(&self, dst: *mut f32, acc: bool, threads: usize) {
        let (m, n, k) = self.mnk;
        let along_rows = m >= n;
        let bands = if along_rows { m } else { n }.div_ceil(BAND);
        let dst = Shared(dst);
        let band = |i: usize| {
            let lo = i * BAND;
            let (rows, cols) = if along_rows {
                ((lo, (lo + BAND).min(m)), (0, n))
            } else {
                ((0, m), (lo, (lo + BAND).min(n)))
            };
            let call = Call {
                shape: (rows.1 - rows.0, cols.1 - cols.0, k),
                ta: self.a.0,
                tb: self.b.0,
                a: rows.0 * self.a.1 .0,
                b: cols.0 * self.b.1 .1,
                c: dst.at(rows.0 * n + cols.0),
                ldc: n,
                beta: if acc { 1.0 } else { 0.0 },
            };
            // SAFETY: the band lies inside dst (m x n, row stride n, valid per the caller) and
            // bands are disjoint; its operand rows / columns lie inside the operands (checked
            // by `Job::new`).
            unsafe { call.run(&self.pair) };
        };
        if threads < 2 {
            (0..bands).for_each(band);
        } else {
            pool::for_each(bands, band);
        }
    }
}

/// One oneDNN call: a band of the output.
struct Call {
    /// (rows, columns, k) of the band.
    shape: (usize, usize, usize),
    ta: (c_char, usize),
    tb: (c_char, usize),
    /// Offsets of the band's first row of `op(A)` and first column of `op(B)`.
    a: usize,
    b: usize,
    c: *mut f32,
    ldc: usize,
    beta: f32,
}

impl Call {
    /// Runs the call on the calling thread alone (its OpenMP team size set to 1 meanwhile).
    ///
    /// # Safety
    /// `c` is valid for the band's writes (and reads when `beta != 0`); the operands from
    /// offsets `a` / `b` cover the band's rows / columns through their leading dimensions.
    unsafe fn run(&self, pair: &Pair<'_>) {
        // SAFETY: OpenMP's per-thread setting; restored below.
        let team = unsafe { ffi::omp_get_max_threads() };
        unsafe { ffi::omp_set_num_threads(1) };
        // SAFETY: per this function's contract.
        let status = unsafe {
            match pair {
                Pair::F32(l, r) => self.call(ffi::dnnl_sgemm, l, r),
                Pair::Bf16(l, r) => self.call(ffi::dnnl_gemm_bf16bf16f32, l, r),
            }
        };
        // SAFETY: as above.
        unsafe { ffi::omp_set_num_threads(team) };
        // The arguments were checked (shapes, leading dimensions, bounds): a failure here is
        // oneDNN's (e.g. out of memory for its packing buffers), with the band half-written.
        assert!(
            status == 0,
            "candle-fused onednn: oneDNN GEMM failed with status {status}"
        );
    }

    /// `f` (one of oneDNN's GEMMs) on this band of `l · r`.
    ///
    /// # Safety
    /// As [`Call::run`].
    unsafe fn call<T>(&self, f: ffi::Gemm<T>, l: &[T], r: &[T]) -> ffi::Status {
        let (m, n, k) = self.shape;
        let d = |v: usize| v as i64;
        let (ta, tb) = (self.ta, self.tb);
        // SAFETY: the operands and `c` per `Call::run`'s contract; oneDNN reads `op(A)` /
        // `op(B)` through (trans, ld) exactly as `trans` derived them from the strides.
        unsafe {
            let (a, b) = (l.as_ptr().add(self.a), r.as_ptr().add(self.b));
            f(
                ta.0,
                tb.0,
                d(m),
                d(n),
                d(k),
                1.0,
                a,
                d(ta.1),
                b,
                d(tb.1),
                self.beta,
                self.c,
                d(self.ldc),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dst = lhs · rhs` (acc false) only writes `dst` (NaN there stays out of the result), and
    /// `dst += lhs · rhs` (acc true) adds to it; 2 x 3 x 2 small integers: exact.
    #[test]
    fn overwrites_or_accumulates() {
        fn mat(d: &[f32], rs: usize) -> Mat<'_, f32> {
            Mat {
                data: Data::Acc(d),
                rs,
                cs: 1,
            }
        }
        let a = [1f32, 2., 3., 4., 5., 6.]; // 2 x 3
        let b = [1f32, 0., 0., 1., 1., 1.]; // 3 x 2
        let (a, b) = (&a[..], &b[..]);
        let mut dst = [f32::NAN; 4];
        // SAFETY: dst holds 2 x 2 elements, exclusively borrowed.
        let (a, b) = (mat(a, 3), mat(b, 2));
        let job = Job::new((2, 2, 3), &a, &b).expect("f32, row-major");
        unsafe { job.run(dst.as_mut_ptr(), false, 1) };
        assert_eq!(dst, [4., 5., 10., 11.]);
        // SAFETY: as above.
        unsafe { job.run(dst.as_mut_ptr(), true, 2) };
        assert_eq!(dst, [8., 10., 20., 22.]);
    }
}
