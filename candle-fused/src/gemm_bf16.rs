//! A bf16 GEMM for the CPU: `C [m, n] (f32) (+)= A [m, k] · B [k, n]` with A and B in bf16,
//! on AVX512-BF16 (`vdpbf16ps`).
//!
//! `vdpbf16ps` takes two vectors of 32 bf16 values as 16 *pairs* and, in each of 16 f32 lanes,
//! adds `a[2i] * b[2i] + a[2i+1] * b[2i+1]` to the accumulator. A product of two bf16 values
//! (8-bit significands) is exact in f32, so the only rounding is in the f32 sums, as in an f32
//! GEMM of the widened inputs: only the summation order differs. One instruction does 32
//! multiply-adds where an f32 FMA does 16, and the operands are half the bytes.
//!
//! The layout the instruction wants is a pair along `k` in each 32-bit lane, so both operands
//! are packed first (as in BLIS / llm.c's matmul, but with pairs):
//!
//! * A in panels of [`MR`] rows: for each `k`-pair `p`, the `MR` pairs
//!   `(A[r, 2p], A[r, 2p+1])` of the panel's rows, one `u32` each (`k` odd: the last pair's
//!   second half is 0; rows past `m`: 0);
//! * B in panels of [`NR`] columns: for each `k`-pair `p`, the `NR` pairs
//!   `(B[2p, j], B[2p+1, j])` (columns past `n`: 0).
//!
//! The micro-kernel keeps an `MR x NR` tile of C in at most 24 zmm registers; per `k`-pair it
//! loads `NR / 16` vectors of B, broadcasts each row's A pair and issues `MR * NR / 16`
//! `vdpbf16ps`. The tile's width follows `n` (6 x 64, 8 x 48, 12 x 32, 12 x 16: a rank-16
//! product is one vector wide, not four with three of zeros). A row-major A with `k` even
//! already holds its pairs (two neighbours of a row are one `u32`), so it is read in place
//! instead of packed: packing A costs as much as the product when B is narrow.
//! Cache blocking: the tile loop runs over equal slices of at most 320 `k`, and within one
//! slice over B panels, then A panels, so one B panel slice (at most 320 `k` x 64 columns of
//! bf16, 40 KiB) is reused from L1 / L2 by every A panel of the task, whose A block (48 rows)
//! stays in L2. Work is split over tiles of C (rows x columns), never over
//! `k`: every element is the same sum, in the same order, on any number of threads, with any
//! tile shape and any slicing of `k` (a tile's f32 sums are stored and loaded back between
//! slices, exactly). A bf16 result is rounded as each task's block is done (from the registers
//! when `k` is one slice), never through a whole f32 matrix.
//!
//! Operands are read through row and column strides ([`Mat`]), so transposed and sliced views
//! (`Wᵀ` of a `[out, in]` weight, `xᵀ` for a weight gradient) cost nothing but the packing.
//!
//! The instruction treats bf16 subnormal inputs as zero and flushes subnormal results (below
//! ~1.2e-38) to zero; everything else is IEEE f32 arithmetic. On CPUs without AVX512-BF16,
//! [`available`] is false and callers widen to f32 instead; the [`Kernel::Portable`]
//! micro-kernel (the same packing, scalar pair sums) exists so the packing and tiling are
//! tested on any machine.

mod kernel;
mod pack;

use half::bf16;
pub(crate) use kernel::{available, Kernel};
use pack::APanels;
pub(crate) use pack::Mat;

/// The most `k`-pairs per cache block (320 values of `k`); a product's `k` is cut into
/// equal slices of at most this many ([`slice_len`]). Between slices a tile's f32 sums are
/// stored and loaded back, exactly, so the slicing never changes a result's bits.
const KC: usize = 160;
/// Rows of C per task (a multiple of every tile shape's `MR`).
const MC: usize = 48;
/// About the columns of C per task (rounded down to whole `NR` panels).
const NC: usize = 256;
/// Multiply-adds (`m * n * k`) from which the work is spread over the pool's threads (the
/// threshold `linear` uses for the f32 GEMM).
const PAR_MIN_MACS: usize = 1 << 18;

/// Where [`gemm`] writes `C [m, n]` (row-major, row stride `n`).
#[derive(Clone, Copy)]
pub(crate) enum Out {
    /// f32: `C = (acc ? C : 0) + A · B` (with `acc == false` C is only written, never read).
    F32 { c: *mut f32, acc: bool },
    /// bf16: `C = A · B` rounded once from the f32 sums (as `half::bf16::from_f32`), each task's
    /// block summed in a small f32 buffer of its own: no f32 matrix written and read back.
    Bf16(*mut bf16),
}

/// `a · b` as a new row-major `m x n` f32 matrix (written once, no zero-fill first).
///
/// Panics if `kernel` is [`Kernel::Avx512Bf16`] and not [`available`], or if a view does not
/// fit its data.
#[cfg(test)]
pub(crate) fn matmul(
    kernel: Kernel,
    mnk: (usize, usize, usize),
    a: Mat<'_>,
    b: Mat<'_>,
    parallel: bool,
) -> Vec<f32> {
    new_matrix(
        mnk,
        |c| Out::F32 { c, acc: false },
        |out| {
            // SAFETY: `out` per `new_matrix`.
            unsafe { gemm(kernel, mnk, out, a, b, parallel) }
        },
    )
}

/// `a · b` as a new row-major bf16 matrix ([`Out::Bf16`]), on the pool's threads.
#[cfg(test)]
pub(crate) fn matmul_bf16(
    kernel: Kernel,
    mnk: (usize, usize, usize),
    ab: [Mat<'_>; 2],
) -> Vec<bf16> {
    new_matrix(mnk, Out::Bf16, |out| {
        // SAFETY: `out` per `new_matrix`.
        unsafe { gemm(kernel, mnk, out, ab[0], ab[1], true) }
    })
}

/// A new `m x n` matrix written in full by `run` through the [`Out`] that `out` makes of its
/// buffer (valid for writes of `m * n` elements, never read).
#[cfg(test)]
fn new_matrix<T>(
    (m, n, _): (usize, usize, usize),
    out: impl FnOnce(*mut T) -> Out,
    run: impl FnOnce(Out),
) -> Vec<T> {
    let mut v = Vec::with_capacity(m * n);
    run(out(v.as_mut_ptr()));
    // SAFETY: `run` wrote all m x n elements (its contract).
    unsafe { v.set_len(m * n) };
    v
}

/// `c (m x n, row-major) += a · b`. Panics like [`matmul`] and if `c` is not `m * n` long.
#[cfg(test)]
pub(crate) fn matmul_acc(
    kernel: Kernel,
    (m, n, k): (usize, usize, usize),
    c: &mut [f32],
    a: Mat<'_>,
    b: Mat<'_>,
    parallel: bool,
) {
    assert_eq!(c.len(), m * n, "candle-fused gemm_bf16: output length");
    let c = Out::F32 {
        c: c.as_mut_ptr(),
        acc: true,
    };
    // SAFETY: `c` is exactly m x n initialised elements, exclusively borrowed.
    unsafe { gemm(kernel, (m, n, k), c, a, b, parallel) }
}

/// `C [m, n] (+)= a · b` into `out` ([`Out`]), on Candle's threads when `parallel` and the
/// product is large enough.
///
/// Panics if `kernel` is [`Kernel::Avx512Bf16`] and not [`available`], or if a view does not
/// fit its data.
///
/// # Safety
/// `out`'s pointer is valid for writes of `m * n` elements (and initialised when it
/// accumulates), and nothing else accesses them during the call.
pub(crate) unsafe fn gemm(
    kernel: Kernel,
    (m, n, k): (usize, usize, usize),
    out: Out,
    a: Mat<'_>,
    b: Mat<'_>,
    parallel: bool,
) {
    assert!(
        kernel == Kernel::Portable || available(),
        "candle-fused gemm_bf16: this CPU has no AVX512-BF16"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // SAFETY: m x n elements, valid for writes (caller); 0 bits are +0 in f32 and bf16.
        match out {
            Out::F32 { c, acc: false } => unsafe { std::ptr::write_bytes(c, 0, m * n) },
            Out::Bf16(c) => unsafe { std::ptr::write_bytes(c, 0, m * n) },
            Out::F32 { acc: true, .. } => {}
        }
        return;
    }
    assert!(
        a.covers(m, k) && b.covers(k, n),
        "candle-fused gemm_bf16: operand out of bounds"
    );
    let par = parallel && crate::pool::parts() > 1 && m * n * k >= PAR_MIN_MACS;
    let args = Args {
        kernel,
        mnk: (m, n, k),
        out: SharedOut(out),
        a,
        b,
        par,
    };
    // The tile's width follows n (a rank-16 product is one vector wide, not four with three
    // of zeros); each shape keeps 24 or fewer accumulators.
    // SAFETY: `out` per the contract; the views were checked above.
    unsafe {
        match n.div_ceil(16) {
            1 => run::<12, 1>(args),
            2 => run::<12, 2>(args),
            3 => run::<8, 3>(args),
            _ => run::<6, 4>(args),
        }
    }
}

/// One call's operands and settings, as [`gemm`] checked them.
struct Args<'a> {
    kernel: Kernel,
    mnk: (usize, usize, usize),
    out: SharedOut,
    a: Mat<'a>,
    b: Mat<'a>,
    par: bool,
}

/// [`gemm`] on tiles of `MR x 16 NV`: packs (or borrows) the operands, then runs tasks of
/// [`MC`] rows x about [`NC`] columns.
///
/// # Safety
/// As [`gemm`], with `m`, `n`, `k` non-zero and the views covering their operands.
unsafe fn run<const MR: usize, const NV: usize>(x: Args<'_>) {
    const { assert!(MC.is_multiple_of(MR) && MR * 16 * NV <= kernel::EDGE && MR * NV <= 24) };
    let (m, n, k) = x.mnk;
    let nr = 16 * NV;
    let nc = (NC / nr).max(1) * nr;
    let kp = k.div_ceil(2);
    let kc = slice_len(kp);
    let gather = x.kernel == Kernel::Avx512Bf16;
    let ap = APanels::new::<MR>(gather, x.a, (m, k), x.par);
    let bp = pack::pack_b(gather, x.b, (k, n), nr, x.par);
    let (out, kernel) = (x.out, x.kernel);
    let (tm, tn) = (m.div_ceil(MC), n.div_ceil(nc));
    let task = |t: usize| {
        let (r0, c0) = ((t / tn) * MC, (t % tn) * nc);
        let (r1, c1) = ((r0 + MC).min(m), (c0 + nc).min(n));
        let tile = |dst: kernel::Dst, ldc: usize| {
            // SAFETY: `dst` is the task's block of C (rows r0..r1, columns c0..c1, row
            // stride ldc), which no other task touches; the panels cover every (row, pair)
            // and (pair, column) indexed (packing sizes); bf16 only with kp <= kc.
            unsafe {
                kernel::tile::<MR, NV>(kernel, &ap, &bp, (kp, kc), (r0, r1), (c0, c1), ldc, dst)
            };
        };
        match out.get() {
            // SAFETY: (r0, c0) is inside C (valid per the caller).
            Out::F32 { c, acc } => tile(
                kernel::Dst::F32 {
                    c: unsafe { c.add(r0 * n + c0) },
                    acc,
                },
                n,
            ),
            // One slice of k: each tile rounded from the registers.
            Out::Bf16(c) if kp <= kc => tile(kernel::Dst::Bf16(unsafe { c.add(r0 * n + c0) }), n),
            Out::Bf16(c) => {
                let w = c1 - c0;
                let mut sums = Vec::with_capacity((r1 - r0) * w);
                tile(
                    kernel::Dst::F32 {
                        c: sums.as_mut_ptr(),
                        acc: false,
                    },
                    w,
                );
                // SAFETY: `tile` wrote every element of the block (acc = false).
                unsafe { sums.set_len((r1 - r0) * w) };
                for (r, row) in sums.chunks_exact(w).enumerate() {
                    // SAFETY: row r0 + r, columns c0..c1 of C: valid for writes (caller),
                    // this task's alone.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(c.add((r0 + r) * n + c0), w) };
                    kernel::round_bf16(kernel, row, dst);
                }
            }
        }
    };
    if x.par {
        crate::pool::for_each(tm * tn, task);
    } else {
        (0..tm * tn).for_each(task);
    }
}

/// Pairs per slice of `kp` pairs: equal slices of at most [`KC`] (no short last slice).
fn slice_len(kp: usize) -> usize {
    kp.div_ceil(kp.div_ceil(KC))
}

/// The output, shared by tasks that write disjoint blocks.
#[derive(Clone, Copy)]
struct SharedOut(Out);

impl SharedOut {
    /// The output (a method, so closures capture the whole `Sync` wrapper).
    fn get(self) -> Out {
        self.0
    }
}
// SAFETY: the pointers are only dereferenced for disjoint blocks of C, one task each; the
// caller of `gemm` guarantees nothing else touches C meanwhile.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

#[cfg(test)]
mod tests;
