//! The tile loop and the micro-kernels: an `MR x NR` block of C (`NR = 16 NV`) from A's pairs
//! ([`APairs`]) and one packed B panel.

use super::pack::{APairs, APanels};
use half::bf16;

/// The largest `MR * NR` of the tile shapes (`super::gemm` picks them): the edge scratch.
pub(super) const EDGE: usize = 384;

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

/// Where a tile's sums go: f32 (added to C when `acc`), or rounded to bf16 as they are done
/// (only when `k` is one slice: no partial sums to keep).
#[derive(Clone, Copy)]
pub(super) enum Dst {
    F32 { c: *mut f32, acc: bool },
    Bf16(*mut bf16),
}

/// Computes rows `r0..r1` x columns `c0..c1` of C (`dst`: its element `(r0, c0)`, row stride
/// `ldc`) from A's panels and B's packed `NR`-column panels, one slice of `kc` pairs at a time
/// (so every element is the same sum, in the same order, whatever the tile shape or task).
///
/// # Safety
/// `dst` is valid for writes of that tile (and reads, initialised, when it accumulates), which
/// no other thread accesses; `r0` and `c0` are multiples of `MR` and `NR`; `ap` and `bp` are
/// the panels of the matrices (`kp` pairs each) covering those rows and columns; a bf16 `dst`
/// only with `kp <= kc`; for [`Kernel::Avx512Bf16`] the CPU has the features.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile<const MR: usize, const NV: usize>(
    kernel: Kernel,
    ap: &APanels<'_>,
    bp: &[u32],
    (kp, kc): (usize, usize),
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    ldc: usize,
    dst: Dst,
) {
    assert!(kc > 0 && (matches!(dst, Dst::F32 { .. }) || kp <= kc));
    let nr = 16 * NV;
    let mut edge = [0f32; EDGE];
    for k0 in (0..kp).step_by(kc) {
        let kl = kc.min(kp - k0);
        for j in (c0..c1).step_by(nr) {
            let b = &bp[((j / nr) * kp + k0) * nr..][..kl * nr];
            let cols = nr.min(c1 - j);
            for i in (r0..r1).step_by(MR) {
                let a = ap.panel::<MR>(i, k0, kp);
                let rows = MR.min(r1 - i);
                let at = (i - r0) * ldc + j - c0;
                // SAFETY: (i, j) is inside the tile, valid per the contract.
                let store = match dst {
                    Dst::F32 { c, acc } => Store::F32 {
                        c: unsafe { c.add(at) },
                        load: acc || k0 > 0,
                    },
                    Dst::Bf16(c) => Store::Bf16(unsafe { c.add(at) }),
                };
                if rows == MR && cols == nr {
                    // SAFETY: a full MR x NR block of C at row stride ldc, inside the tile;
                    // the panels cover kl pairs of its rows and columns.
                    unsafe { micro::<MR, NV>(kernel, kl, a, b, (store, ldc)) };
                    continue;
                }
                // An edge tile: through a full-size f32 scratch tile, only the valid part of C
                // read and written. SAFETY: (i + r, j + q) below is inside the tile; `edge`
                // is a full MR x NR tile at row stride NR; the panels are padded to full
                // panels (packed) or full (read in place).
                let edge = &mut edge[..MR * nr];
                for r in 0..rows {
                    for q in 0..cols {
                        edge[r * nr + q] = match store {
                            Store::F32 { c, load: true } => unsafe { *c.add(r * ldc + q) },
                            _ => 0.0,
                        };
                    }
                }
                let scratch = Store::F32 {
                    c: edge.as_mut_ptr(),
                    load: true,
                };
                unsafe { micro::<MR, NV>(kernel, kl, a, b, (scratch, nr)) };
                for r in 0..rows {
                    for q in 0..cols {
                        let v = edge[r * nr + q];
                        match store {
                            Store::F32 { c, .. } => unsafe { *c.add(r * ldc + q) = v },
                            Store::Bf16(c) => unsafe { *c.add(r * ldc + q) = bf16::from_f32(v) },
                        }
                    }
                }
            }
        }
    }
}

/// Where one micro-kernel call's `MR x NR` sums go: f32 (added to what is there when `load`)
/// or rounded to bf16 (as `half::bf16::from_f32`).
#[derive(Clone, Copy)]
enum Store {
    F32 { c: *mut f32, load: bool },
    Bf16(*mut bf16),
}

/// `C[MR x NR] (row stride ldc) = (load ? C : 0) + Σ_p pairs` ([`Store`]), `kl` pairs of A's
/// panel `a` and of the B panel `b` (`kl * NR` lanes).
///
/// # Safety
/// The store's `c` is valid for reads (when `load`) and writes of `MR` rows of `NR` at stride
/// `ldc`;
/// `a` covers `MR` rows of `kl` pairs; for [`Kernel::Avx512Bf16`] the CPU has the features.
#[inline(always)]
unsafe fn micro<const MR: usize, const NV: usize>(
    kernel: Kernel,
    kl: usize,
    a: APairs,
    b: &[u32],
    c: (Store, usize),
) {
    debug_assert!(b.len() >= kl * 16 * NV);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: panel lengths checked by the slicing in `tile`; A, C and the CPU per the
        // contract.
        Kernel::Avx512Bf16 => unsafe { avx512::micro::<MR, NV>(kl, a, b.as_ptr(), c) },
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Avx512Bf16 => unreachable!("checked by `gemm`"),
        // SAFETY: A and C per the contract.
        Kernel::Portable => unsafe { micro_portable::<MR, NV>(kl, a, b, c) },
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
unsafe fn micro_portable<const MR: usize, const NV: usize>(
    kl: usize,
    a: APairs,
    b: &[u32],
    (store, ldc): (Store, usize),
) {
    let nr = 16 * NV;
    for r in 0..MR {
        for q in 0..nr {
            // SAFETY: (r, q) inside the MR x NR block (contract).
            let mut s = match store {
                Store::F32 { c, load: true } => unsafe { *c.add(r * ldc + q) },
                _ => 0.0,
            };
            for p in 0..kl {
                // SAFETY: r < MR, p < kl: inside A's panel (contract).
                let (x, y) = (unsafe { a.get(r, p) }, b[p * nr + q]);
                s += half_f32(x, true) * half_f32(y, true);
                s += half_f32(x, false) * half_f32(y, false);
            }
            // SAFETY: as above.
            match store {
                Store::F32 { c, .. } => unsafe { *c.add(r * ldc + q) = s },
                Store::Bf16(c) => unsafe { *c.add(r * ldc + q) = bf16::from_f32(s) },
            }
        }
    }
}

/// `dst = src` rounded to bf16 exactly as `half::bf16::from_f32` rounds (to nearest, ties to
/// even; a NaN stays a NaN with its top payload bits and the quiet bit set), 16 values per
/// step on [`Kernel::Avx512Bf16`] (`half` converts bf16 one value at a time).
pub(super) fn round_bf16(kernel: Kernel, src: &[f32], dst: &mut [bf16]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "candle-fused gemm_bf16: rounding lengths"
    );
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: equal lengths (asserted); the kernel runs only where the CPU has AVX512F
        // (`super::gemm` checked).
        Kernel::Avx512Bf16 => unsafe { avx512::round_bf16(src, dst) },
        _ => half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::gemm_bf16::kernel::Store;
    use crate::gemm_bf16::pack::APairs;
    use half::bf16;
    use std::arch::x86_64::*;

    /// Reinterprets 16 lanes of 32 bits as 32 bf16 (the same 512 bits).
    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are plain 512-bit vectors with no invalid bit patterns.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// The AVX512-BF16 micro-kernel: the `MR x 16 NV` tile in `MR * NV` (at most 24)
    /// accumulators; per pair `NV` loads of B and one broadcast of A per row.
    ///
    /// # Safety
    /// `a` covers `MR` rows of `kl` pairs, `b` is valid for reads of `kl * 16 NV` lanes; `c`
    /// as in [`super::micro`]; the CPU has AVX512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn micro<const MR: usize, const NV: usize>(
        kl: usize,
        a: APairs,
        b: *const u32,
        (store, ldc): (Store, usize),
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        if let Store::F32 { c, load: true } = store {
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
                let at = unsafe { b.add((p * NV + v) * 16) } as *const __m512i;
                *x = bh(unsafe { _mm512_loadu_si512(at) });
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: p < kl, r < MR: inside A's panel (contract).
                let av = bh(_mm512_set1_epi32(unsafe { a.get(r, p) } as i32));
                for (x, bv) in row.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, av, *bv);
                }
            }
        }
        // SAFETY (both loops): inside the C block (contract).
        match store {
            Store::F32 { c, .. } => {
                for (r, row) in acc.iter().enumerate() {
                    for (v, x) in row.iter().enumerate() {
                        unsafe { _mm512_storeu_ps(c.add(r * ldc + v * 16), *x) };
                    }
                }
            }
            // SAFETY: as above; the CPU has AVX512F (contract).
            Store::Bf16(c) => unsafe { store_bf16::<MR, NV>(acc, c, ldc) },
        }
    }

    /// The tile's sums rounded to bf16 and stored. Not inlined: its constants would take
    /// registers from the micro-kernel's accumulators (spilling them in the main loop).
    ///
    /// # Safety
    /// `c` is valid for writes of `MR` rows of `16 NV` bf16 at stride `ldc`; the CPU has
    /// AVX512F.
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_bf16<const MR: usize, const NV: usize>(
        acc: [[__m512; NV]; MR],
        c: *mut bf16,
        ldc: usize,
    ) {
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: inside the C block; AVX512F (contract).
                unsafe {
                    let to = c.add(r * ldc + v * 16) as *mut __m256i;
                    _mm256_storeu_si256(to, round16(_mm512_castps_si512(*x)));
                }
            }
        }
    }

    /// 16 f32 (as bits) rounded to bf16 as `half::bf16::from_f32` rounds. Always inlined
    /// (into the AVX-512 functions below): a call would spill the micro-kernel's 24
    /// accumulators.
    ///
    /// # Safety
    /// The CPU has AVX512F.
    #[inline(always)]
    unsafe fn round16(x: __m512i) -> __m256i {
        // SAFETY: AVX512F (contract).
        unsafe {
            let hi = _mm512_srli_epi32::<16>(x);
            // NaN: |x| above infinity's bits; rounds up: the round bit and any of the bits below
            // it or the lowest kept one (ties to even).
            let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
            let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
            let up = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x8000))
                & _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x1_7FFF));
            let r = _mm512_mask_add_epi32(hi, up, hi, _mm512_set1_epi32(1));
            let r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
            _mm512_cvtepi32_epi16(r)
        }
    }

    /// [`super::round_bf16`] 16 values at a time, the rest one by one through `half`.
    ///
    /// # Safety
    /// `src` and `dst` have the same length; the CPU has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_bf16(src: &[f32], dst: &mut [bf16]) {
        let body = src.len() - src.len() % 16;
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= len of both slices; 16 bf16 are 32 bytes.
            unsafe {
                let x = _mm512_loadu_si512(src.as_ptr().add(i) as *const __m512i);
                _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, round16(x));
            }
        }
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut dst[body..], &src[body..]);
    }
}
