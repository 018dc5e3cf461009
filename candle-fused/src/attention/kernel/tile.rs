//! The building blocks of the attention kernels: the shared output buffer, task splitting and
//! the single-threaded tile GEMM.

use crate::cpu::{Elem, Real, PAR_MIN_WORK};
use crate::pool;

/// A raw output buffer shared by tasks that write disjoint element sets.
#[derive(Clone, Copy)]
pub(crate) struct Ptr<T>(*mut T, usize);

// SAFETY: the pointer is only written through `write`, whose callers guarantee that concurrent
// tasks touch disjoint elements; the buffer outlives the parallel section.
unsafe impl<T: Send> Send for Ptr<T> {}
unsafe impl<T: Send> Sync for Ptr<T> {}

impl<T> Ptr<T> {
    pub fn new(s: &mut [T]) -> Self {
        Ptr(s.as_mut_ptr(), s.len())
    }

    /// Writes `vals` at `off..`.
    ///
    /// # Safety
    /// No other task reads or writes these elements concurrently, and the buffer is alive.
    #[inline(always)]
    pub unsafe fn write(self, off: usize, vals: impl ExactSizeIterator<Item = T>) {
        assert!(
            off + vals.len() <= self.1,
            "candle-fused: attention write out of bounds"
        );
        for (i, v) in vals.enumerate() {
            // SAFETY: in bounds (checked above); exclusive by the caller's contract.
            unsafe { self.0.add(off + i).write(v) };
        }
    }
}

/// Converts `n` elements of `src` at `off` into `dst`.
#[inline(always)]
pub(crate) fn load<T: Elem>(src: &[T], off: usize, dst: &mut [T::Acc]) {
    let n = dst.len();
    for (d, s) in dst.iter_mut().zip(&src[off..off + n]) {
        *d = s.acc();
    }
}

/// Runs `f(task, scratch)` for `0..n` tasks, in parallel when `n * work` is large enough. Each
/// task's result depends on the task alone, so the split does not change any bit.
pub(crate) fn run_tasks<S: Send>(
    n: usize,
    work: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(usize, &mut S) + Sync,
) {
    let parts = pool::parts();
    if n < 2 || parts <= 1 || n.saturating_mul(work.max(1)) < PAR_MIN_WORK {
        let mut s = init();
        for t in 0..n {
            f(t, &mut s);
        }
    } else {
        // Contiguous groups of tasks, one scratch per group.
        let per = n.div_ceil(parts);
        pool::for_each(n.div_ceil(per), |g| {
            let mut s = init();
            for t in g * per..((g + 1) * per).min(n) {
                f(t, &mut s);
            }
        });
    }
}

/// A row-major matrix operand: element `(r, c)` at `ptr + r * rs + c * cs`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<A> {
    ptr: *const A,
    rs: usize,
    cs: usize,
}

impl<A> Mat<A> {
    /// Rows of `cols` contiguous elements.
    pub fn rows(s: &[A], cols: usize) -> Self {
        Mat {
            ptr: s.as_ptr(),
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of [`Mat::rows`].
    pub fn rows_t(s: &[A], cols: usize) -> Self {
        Mat {
            ptr: s.as_ptr(),
            rs: 1,
            cs: cols,
        }
    }
}

/// `dst[m x n] (row-major, contiguous) = acc * dst + beta * lhs[m x k] rhs[k x n]` on this
/// thread (`acc`: whether to keep `dst`).
///
/// The operands must cover the indexed elements; every call below passes slices of scratch
/// buffers sized for the tile.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<A: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [A],
    acc: bool,
    lhs: Mat<A>,
    rhs: Mat<A>,
    beta: A,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst.len() >= m * n,
        "candle-fused: attention tile out of bounds"
    );
    if k == 0 {
        if !acc {
            dst[..m * n].fill(A::ZERO);
        }
        return;
    }
    // SAFETY: `dst` holds m x n elements (checked); `lhs` and `rhs` point into live scratch
    // panels that hold every (r, c) they are indexed at (by construction of the tiles); the
    // call is single-threaded, so nothing else touches `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            acc,
            lhs.ptr,
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.ptr,
            rhs.cs as isize,
            rhs.rs as isize,
            A::ONE,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
