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
//! The micro-kernel keeps an `MR x NR` tile of C in 24 zmm registers; per `k`-pair it loads
//! `NR / 16` vectors of B, broadcasts each row's A pair and issues `MR * NR / 16` `vdpbf16ps`.
//! Cache blocking: the tile loop runs over slices of 256 `k`, and within one slice over B
//! panels, then A panels, so one B panel slice (256 `k` x 64 columns of bf16, 32 KiB) is reused
//! from L1 / L2 by every A panel of the task, whose A block (48 rows x 256 `k`) stays in L2. Work is split over tiles of C (rows x columns), never over
//! `k`: every element is the same sum, in the same order, on any number of threads.
//!
//! Operands are read through row and column strides ([`Mat`]), so transposed and sliced views
//! (`Wᵀ` of a `[out, in]` weight, `xᵀ` for a weight gradient) cost nothing but the packing.
//!
//! The instruction treats bf16 subnormal inputs as zero and flushes subnormal results (below
//! ~1.2e-38) to zero; everything else is IEEE f32 arithmetic. On CPUs without AVX512-BF16,
//! [`available`] is false and callers widen to f32 instead; the [`Kernel::Portable`]
//! micro-kernel (the same packing, scalar pair sums) exists so the packing and tiling are
//! tested on any machine.

use half::bf16;

/// Rows of the micro-kernel's C tile.
pub(crate) const MR: usize = 6;
/// Columns of the micro-kernel's C tile: 4 vectors of 16 f32 lanes.
pub(crate) const NR: usize = 64;
/// `k`-pairs per cache block (256 values of `k`).
const KC: usize = 128;
/// Rows of C per task (8 A panels).
const MC: usize = 8 * MR;
/// Columns of C per task (4 B panels).
const NC: usize = 4 * NR;
/// Multiply-adds (`m * n * k`) from which the work is spread over the pool's threads (the
/// threshold `linear` uses for the f32 GEMM).
const PAR_MIN_MACS: usize = 1 << 18;
/// Elements from which the packing runs in parallel ([`crate::cpu::PAR_MIN_WORK`]).
const PAR_MIN_PACK: usize = crate::cpu::PAR_MIN_WORK;

/// A read-only bf16 matrix view: element `(r, c)` is `data[r * rs + c * cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mat<'a> {
    /// The elements, from the view's first one.
    pub data: &'a [bf16],
    /// Row stride (elements).
    pub rs: usize,
    /// Column stride (elements).
    pub cs: usize,
}

impl Mat<'_> {
    /// Whether a `rows x cols` view fits in `data`.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// Which micro-kernel runs the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `vdpbf16ps` on zmm registers (needs [`available`]).
    Avx512Bf16,
    /// Scalar f32 pair sums over the same packed panels: slow, for testing the packing and the
    /// tiling on any CPU.
    Portable,
}

/// Whether this CPU runs [`Kernel::Avx512Bf16`] (AVX512F and AVX512-BF16, detected at run
/// time once and cached by the standard library).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `a · b` as a new row-major `m x n` f32 matrix (written once, no zero-fill first).
///
/// Panics if `kernel` is [`Kernel::Avx512Bf16`] and not [`available`], or if a view does not
/// fit its data.
#[cfg(test)]
pub(crate) fn matmul(
    kernel: Kernel,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_>,
    b: Mat<'_>,
    parallel: bool,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: the buffer has capacity m x n, is written in full by `gemm` (acc = false: never
    // read) and only then given its length.
    unsafe {
        gemm(kernel, (m, n, k), out.as_mut_ptr(), false, a, b, parallel);
        out.set_len(m * n);
    }
    out
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
    // SAFETY: `c` is exactly m x n initialised elements, exclusively borrowed.
    unsafe { gemm(kernel, (m, n, k), c.as_mut_ptr(), true, a, b, parallel) }
}

/// `c (m x n, row-major, row stride n) = (acc ? c : 0) + a · b`, on Candle's threads when
/// `parallel` and the product is large enough.
///
/// Panics if `kernel` is [`Kernel::Avx512Bf16`] and not [`available`], or if a view does not
/// fit its data.
///
/// # Safety
/// `c` is valid for writes of `m * n` f32 (and initialised when `acc`), and nothing else
/// accesses them during the call. With `acc == false` they are only written, never read.
pub(crate) unsafe fn gemm(
    kernel: Kernel,
    (m, n, k): (usize, usize, usize),
    c: *mut f32,
    acc: bool,
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
        if !acc {
            // SAFETY: m x n elements, valid for writes (caller).
            unsafe { std::ptr::write_bytes(c, 0, m * n) };
        }
        return;
    }
    assert!(
        a.covers(m, k) && b.covers(k, n),
        "candle-fused gemm_bf16: operand out of bounds"
    );
    let par = parallel && crate::pool::parts() > 1 && m * n * k >= PAR_MIN_MACS;
    let kp = k.div_ceil(2);
    let ap = pack_a(a, m, k, par);
    let bp = pack_b(b, k, n, par);
    let c = SharedOut(c);
    let (tm, tn) = (m.div_ceil(MC), n.div_ceil(NC));
    let task = |t: usize| {
        let (r0, c0) = ((t / tn) * MC, (t % tn) * NC);
        let (r1, c1) = ((r0 + MC).min(m), (c0 + NC).min(n));
        // SAFETY: tasks own disjoint tiles [r0, r1) x [c0, c1) of C (valid per the caller);
        // the panels cover every (row, pair) and (pair, column) indexed (packing sizes).
        unsafe { tile(kernel, &ap, &bp, kp, (r0, r1), (c0, c1), (n, acc), c) };
    };
    if par {
        crate::pool::for_each(tm * tn, task);
    } else {
        (0..tm * tn).for_each(task);
    }
}

/// The output pointer, shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the pointer is only dereferenced by `tile`, whose callers hand each task a distinct
// tile of C; the caller of `gemm` guarantees nothing else touches C meanwhile.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

/// The pair `(lo, hi)` as one lane: `lo` (the even `k`) in the low half, as `vdpbf16ps`
/// multiplies the low halves of both operands together.
#[inline(always)]
fn pair(lo: u32, hi: u32) -> u32 {
    lo | (hi << 16)
}

/// Packs `a [m, k]` into `MR`-row panels of `kp = ceil(k/2)` pairs (layout in the module doc).
fn pack_a(a: Mat<'_>, m: usize, k: usize, par: bool) -> Vec<u32> {
    pack_lines::<MR>(a.data, m, a.rs, a.cs, k, par)
}

/// Packs `b [k, n]` into `NR`-column panels of `kp = ceil(k/2)` pairs (layout in the module
/// doc).
fn pack_b(b: Mat<'_>, k: usize, n: usize, par: bool) -> Vec<u32> {
    pack_lines::<NR>(b.data, n, b.cs, b.rs, k, par)
}

/// Packs `n` lines of `k` elements (line `i` starts at `i * step`, its elements `ks` apart)
/// into `W`-line panels of `kp = ceil(k/2)` pairs: A's rows (`W = MR`) or B's columns (`NR`).
fn pack_lines<const W: usize>(
    data: &[bf16],
    n: usize,
    step: usize,
    ks: usize,
    k: usize,
    par: bool,
) -> Vec<u32> {
    let kp = k.div_ceil(2);
    pack(n.div_ceil(W) * kp * W, kp * W, par, |p, panel| {
        let lines = Lines {
            data,
            first: p * W * step,
            step,
            ks,
        };
        lines.pack(panel, W, W.min(n - p * W), k);
    })
}

/// The lines (rows of A, columns of B) of one panel, each `k` long: element `kk` of line `i`
/// is `data[first + i * step + kk * ks]`.
struct Lines<'a> {
    data: &'a [bf16],
    first: usize,
    step: usize,
    ks: usize,
}

impl Lines<'_> {
    /// Writes the pairs of `count` lines into a zeroed panel `width` lanes wide (lane
    /// `p * width + i`: the pair `p` of line `i`). Two layouts are read with unit strides: a
    /// pair that is two neighbours of one line (`ks == 1`: row-major A, a `w.t()` weight as B)
    /// and a pair that is the same place of two rows (`step == 1`: `xᵀ` as A, row-major B).
    fn pack(&self, panel: &mut [u32], width: usize, count: usize, k: usize) {
        let bits = |i: usize| self.data[i].to_bits() as u32;
        if self.ks == 1 {
            for i in 0..count {
                let line = &self.data[self.first + i * self.step..][..k];
                let mut pairs = line.chunks_exact(2);
                for (p, two) in (&mut pairs).enumerate() {
                    panel[p * width + i] = pair(two[0].to_bits() as u32, two[1].to_bits() as u32);
                }
                if let [last] = pairs.remainder() {
                    panel[(k / 2) * width + i] = last.to_bits() as u32;
                }
            }
        } else if self.step == 1 {
            for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
                let lo = &self.data[self.first + 2 * p * self.ks..][..count];
                if 2 * p + 1 < k {
                    let hi = &self.data[self.first + (2 * p + 1) * self.ks..][..count];
                    for ((d, l), h) in dst.iter_mut().zip(lo).zip(hi) {
                        *d = pair(l.to_bits() as u32, h.to_bits() as u32);
                    }
                } else {
                    for (d, l) in dst.iter_mut().zip(lo) {
                        *d = l.to_bits() as u32;
                    }
                }
            }
        } else {
            for i in 0..count {
                let line = self.first + i * self.step;
                for p in 0..k.div_ceil(2) {
                    let lo = bits(line + 2 * p * self.ks);
                    let hi = if 2 * p + 1 < k {
                        bits(line + (2 * p + 1) * self.ks)
                    } else {
                        0
                    };
                    panel[p * width + i] = pair(lo, hi);
                }
            }
        }
    }
}

/// A zeroed buffer of `len` lanes, `fill(panel_index, panel)` called on each `panel`-long chunk
/// (in parallel when `par` and large).
fn pack(len: usize, panel: usize, par: bool, fill: impl Fn(usize, &mut [u32]) + Sync) -> Vec<u32> {
    let mut buf = vec![0u32; len];
    if par && len >= PAR_MIN_PACK {
        crate::pool::map_chunks_mut(&mut buf, panel, fill);
    } else {
        buf.chunks_mut(panel)
            .enumerate()
            .for_each(|(i, p)| fill(i, p));
    }
    buf
}

/// Computes rows `r0..r1` x columns `c0..c1` of C (`ldc` = row stride, `acc`: add to C) from
/// the packed panels, one `KC` slice of `k` at a time.
///
/// # Safety
/// `c` is valid for reads and writes of that tile (and initialised when `acc`), which no other
/// thread accesses; `r0` and `c0` are multiples of `MR` and `NR`; `ap` and `bp` are the packed
/// panels of the matrices (`kp` pairs each) covering those rows and columns.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    kernel: Kernel,
    ap: &[u32],
    bp: &[u32],
    kp: usize,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    (ldc, acc): (usize, bool),
    c: SharedOut,
) {
    let mut edge = [0f32; MR * NR];
    for k0 in (0..kp).step_by(KC) {
        let kl = KC.min(kp - k0);
        let load = acc || k0 > 0;
        for j in (c0..c1).step_by(NR) {
            let b = &bp[((j / NR) * kp + k0) * NR..][..kl * NR];
            let cols = NR.min(c1 - j);
            for i in (r0..r1).step_by(MR) {
                let a = &ap[((i / MR) * kp + k0) * MR..][..kl * MR];
                let rows = MR.min(r1 - i);
                // SAFETY: (i, j) is inside the tile, valid per the contract.
                let cij = unsafe { c.0.add(i * ldc + j) };
                if rows == MR && cols == NR {
                    // SAFETY: a full MR x NR block of C at row stride ldc, inside the tile.
                    unsafe { micro(kernel, kl, a, b, cij, ldc, load) };
                } else {
                    // An edge tile: through a full-size scratch tile, only the valid part of
                    // C read and written.
                    for r in 0..rows {
                        for q in 0..cols {
                            // SAFETY: (i + r, j + q) is inside the tile.
                            edge[r * NR + q] = if load {
                                unsafe { *cij.add(r * ldc + q) }
                            } else {
                                0.0
                            };
                        }
                    }
                    // SAFETY: `edge` is a full MR x NR tile at row stride NR.
                    unsafe { micro(kernel, kl, a, b, edge.as_mut_ptr(), NR, true) };
                    for r in 0..rows {
                        for q in 0..cols {
                            // SAFETY: as above.
                            unsafe { *cij.add(r * ldc + q) = edge[r * NR + q] };
                        }
                    }
                }
            }
        }
    }
}

/// `C[MR x NR] (row stride ldc) = (load ? C : 0) + Σ_p pairs`, `kl` pairs from the panels `a`
/// (`kl * MR` lanes) and `b` (`kl * NR` lanes).
///
/// # Safety
/// `c` is valid for reads (when `load`) and writes of `MR` rows of `NR` f32 at stride `ldc`;
/// for [`Kernel::Avx512Bf16`] the CPU has the features ([`available`]).
#[inline(always)]
unsafe fn micro(
    kernel: Kernel,
    kl: usize,
    a: &[u32],
    b: &[u32],
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    debug_assert!(a.len() >= kl * MR && b.len() >= kl * NR);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: panel lengths checked by the slicing in `tile`; C and the CPU per the
        // contract.
        Kernel::Avx512Bf16 => unsafe { avx512::micro(kl, a.as_ptr(), b.as_ptr(), c, ldc, load) },
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Avx512Bf16 => unreachable!("checked by `gemm`"),
        // SAFETY: C per the contract.
        Kernel::Portable => unsafe { micro_portable(kl, a, b, c, ldc, load) },
    }
}

/// The widened bf16 of a lane's low (`hi == false`) or high half.
#[inline(always)]
fn half_f32(lane: u32, hi: bool) -> f32 {
    f32::from_bits(if hi { lane & 0xFFFF_0000 } else { lane << 16 })
}

/// The scalar micro-kernel: what `vdpbf16ps` computes per lane (the high pair's product added
/// first, then the low one's, as Intel's pseudo-code does), without its subnormal flushing.
///
/// # Safety
/// As [`micro`].
unsafe fn micro_portable(kl: usize, a: &[u32], b: &[u32], c: *mut f32, ldc: usize, load: bool) {
    for r in 0..MR {
        for q in 0..NR {
            // SAFETY: (r, q) inside the MR x NR block (contract).
            let cp = unsafe { c.add(r * ldc + q) };
            let mut s = if load { unsafe { *cp } } else { 0.0 };
            for p in 0..kl {
                let (x, y) = (a[p * MR + r], b[p * NR + q]);
                s += half_f32(x, true) * half_f32(y, true);
                s += half_f32(x, false) * half_f32(y, false);
            }
            // SAFETY: as above.
            unsafe { *cp = s };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// zmm vectors per row of the tile.
    const NV: usize = NR / 16;

    /// Reinterprets 16 lanes of 32 bits as 32 bf16 (the same 512 bits).
    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are plain 512-bit vectors with no invalid bit patterns.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// The AVX512-BF16 micro-kernel: the `MR x NR` tile in `MR * NV` (24) accumulators.
    ///
    /// # Safety
    /// `a` and `b` are valid for reads of `kl * MR` and `kl * NR` lanes; `c` as in
    /// [`super::micro`]; the CPU has AVX512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn micro(
        kl: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        if load {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    // SAFETY: inside the C block (contract).
                    *x = unsafe { _mm512_loadu_ps(c.add(r * ldc + v * 16)) };
                }
            }
        }
        for p in 0..kl {
            let mut bv = [bh(_mm512_setzero_si512()); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: p < kl: lanes p * NR .. p * NR + NR of `b` (contract).
                *x = bh(unsafe { _mm512_loadu_si512(b.add(p * NR + v * 16) as *const __m512i) });
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: p < kl, r < MR: inside `a` (contract).
                let av = bh(_mm512_set1_epi32(unsafe { *a.add(p * MR + r) } as i32));
                for (x, bv) in row.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, av, *bv);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: inside the C block (contract).
                unsafe { _mm512_storeu_ps(c.add(r * ldc + v * 16), *x) };
            }
        }
    }
}

#[cfg(test)]
mod tests;
