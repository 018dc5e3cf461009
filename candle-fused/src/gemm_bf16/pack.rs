//! The operands as the micro-kernels read them: B packed in `NR`-column panels, A packed in
//! `MR`-row panels or, when its rows already hold the pairs, read in place ([`APanels`]).

use half::bf16;

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
    pub(super) fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// Elements from which the packing runs in parallel ([`crate::cpu::PAR_MIN_WORK`]).
const PAR_MIN_PACK: usize = crate::cpu::PAR_MIN_WORK;

/// The pair `(lo, hi)` as one lane: `lo` (the even `k`) in the low half, as `vdpbf16ps`
/// multiplies the low halves of both operands together.
#[inline(always)]
fn pair(lo: u32, hi: u32) -> u32 {
    lo | (hi << 16)
}

/// Where the micro-kernel finds A's pairs for one panel of `MR` rows: pair `p` of row `r` is
/// the `u32` (unaligned) at byte offset `r * rs + p * ps` from `ptr`.
#[derive(Clone, Copy)]
pub(super) struct APairs {
    pub(super) ptr: *const u8,
    pub(super) rs: usize,
    pub(super) ps: usize,
}

impl APairs {
    /// The pairs of packed panel lanes (`MR` lanes per pair).
    fn packed<const MR: usize>(lanes: &[u32]) -> Self {
        APairs {
            ptr: lanes.as_ptr() as *const u8,
            rs: 4,
            ps: 4 * MR,
        }
    }

    /// Pair `p` of row `r`.
    ///
    /// # Safety
    /// `(r, p)` lies in the panel this was made for.
    #[inline(always)]
    pub(super) unsafe fn get(&self, r: usize, p: usize) -> u32 {
        // SAFETY: inside the panel (caller): 4 readable bytes, read unaligned.
        unsafe { (self.ptr.add(r * self.rs + p * self.ps) as *const u32).read_unaligned() }
    }
}

/// A as the tiles read it.
pub(super) enum APanels<'a> {
    /// Packed in `MR`-row panels of `kp` pairs (layout in the module doc).
    Packed(Vec<u32>),
    /// Row-major with a unit column stride and `k` even: the pair `(A[r, 2p], A[r, 2p + 1])`
    /// is already one `u32` of row `r`, so full panels are read in place (no copy: for a
    /// narrow B the packing of A costs as much as the product); only the rows of a last
    /// partial panel (`m % MR`) are packed, in `tail`.
    Direct {
        data: &'a [bf16],
        rs: usize,
        full: usize,
        tail: Vec<u32>,
    },
}

impl<'a> APanels<'a> {
    /// Packs or borrows `a [m, k]` for `MR`-row panels.
    pub(super) fn new<const MR: usize>(
        gather: bool,
        a: Mat<'a>,
        (m, k): (usize, usize),
        par: bool,
    ) -> Self {
        if a.cs != 1 || k % 2 != 0 {
            let lines = Lines::new(a.data, a.rs, a.cs, gather);
            return APanels::Packed(pack_lines(MR, lines, m, k, par));
        }
        let full = m - m % MR;
        let rest = &a.data[(full * a.rs).min(a.data.len())..];
        APanels::Direct {
            data: a.data,
            rs: a.rs,
            full,
            tail: pack_lines(MR, Lines::new(rest, a.rs, 1, gather), m - full, k, false),
        }
    }

    /// The pairs `k0..` of the panel whose first row is `i` (a multiple of `MR`), `kp` pairs
    /// per row.
    pub(super) fn panel<const MR: usize>(&self, i: usize, k0: usize, kp: usize) -> APairs {
        match self {
            APanels::Packed(ap) => APairs::packed::<MR>(&ap[((i / MR) * kp + k0) * MR..]),
            APanels::Direct { tail, full, .. } if i >= *full => {
                APairs::packed::<MR>(&tail[k0 * MR..])
            }
            APanels::Direct { data, rs, .. } => APairs {
                ptr: data[i * rs + 2 * k0..].as_ptr() as *const u8,
                rs: 2 * rs,
                ps: 4,
            },
        }
    }
}

/// Packs `b [k, n]` into `nr`-column panels of `kp = ceil(k/2)` pairs (layout in the module
/// doc).
pub(super) fn pack_b(
    gather: bool,
    b: Mat<'_>,
    (k, n): (usize, usize),
    nr: usize,
    par: bool,
) -> Vec<u32> {
    pack_lines(nr, Lines::new(b.data, b.cs, b.rs, gather), n, k, par)
}

/// Packs `n` of `lines`, `k` elements each, into `w`-line panels of `kp = ceil(k/2)` pairs:
/// A's rows (`w = MR`) or B's columns (`NR`).
fn pack_lines(w: usize, lines: Lines<'_>, n: usize, k: usize, par: bool) -> Vec<u32> {
    let kp = k.div_ceil(2);
    pack(n.div_ceil(w) * kp * w, kp * w, par, |p, panel| {
        let first = p * w * lines.step;
        Lines { first, ..lines }.pack(panel, w, w.min(n - p * w), k);
    })
}

/// Pairs per stripe of the transposing copy in [`Lines::pack`]: the panel rows one stripe
/// writes stay in L1 while every line adds its lane.
const STRIPE: usize = 16;

/// The lines (rows of A, columns of B) of a matrix, each `k` long: element `kk` of line `i`
/// is `data[first + i * step + kk * ks]` (`first`: a panel's first line).
#[derive(Clone, Copy)]
struct Lines<'a> {
    data: &'a [bf16],
    first: usize,
    step: usize,
    ks: usize,
    /// Pairs that are neighbours in each line gathered 16 lines at a time (AVX-512).
    gather: bool,
}

impl<'a> Lines<'a> {
    /// Line `i` at `i * step`, its elements `ks` apart; `gather`: the AVX-512 copy may run
    /// (for the AVX-512 kernel only, so each kernel's tests cover its own packing).
    fn new(data: &'a [bf16], step: usize, ks: usize, gather: bool) -> Self {
        let gather = cfg!(target_arch = "x86_64")
            && gather
            && ks == 1
            && step.checked_mul(16).is_some_and(|s| s <= i32::MAX as usize);
        Lines {
            data,
            first: 0,
            step,
            ks,
            gather,
        }
    }

    /// Writes the pairs of `count` lines into a zeroed panel `width` lanes wide (lane
    /// `p * width + i`: the pair `p` of line `i`). Two layouts are read with unit strides: a
    /// pair that is two neighbours of one line (`ks == 1`: row-major A, a `w.t()` weight as B;
    /// a transpose, done in stripes of [`STRIPE`] pairs) and a pair that is the same place of
    /// two rows (`step == 1`: `xᵀ` as A, row-major B).
    fn pack(&self, panel: &mut [u32], width: usize, count: usize, k: usize) {
        let bits = |i: usize| self.data[i].to_bits() as u32;
        #[cfg(target_arch = "x86_64")]
        if self.gather && count > 0 {
            let last = self.first + (count - 1) * self.step + k - 1;
            assert!(last < self.data.len() && count <= width && panel.len() >= (k / 2) * width);
            // SAFETY: every line's k elements are in `data` (asserted for the last line, the
            // highest); the panel holds k / 2 pairs of `width >= count` lanes (asserted); the
            // CPU has AVX-512 (`gather` is set for the AVX-512 kernel only).
            unsafe {
                avx512::gather_pairs(
                    self.data,
                    (self.first, self.step),
                    panel,
                    width,
                    count,
                    k / 2,
                )
            };
            if k % 2 == 1 {
                for i in 0..count {
                    panel[(k / 2) * width + i] = bits(self.first + i * self.step + k - 1);
                }
            }
            return;
        }
        if self.ks == 1 {
            for p0 in (0..k / 2).step_by(STRIPE) {
                let pairs = STRIPE.min(k / 2 - p0);
                for i in 0..count {
                    let line = &self.data[self.first + i * self.step + 2 * p0..][..2 * pairs];
                    for (q, two) in line.chunks_exact(2).enumerate() {
                        panel[(p0 + q) * width + i] =
                            pair(two[0].to_bits() as u32, two[1].to_bits() as u32);
                    }
                }
            }
            if k % 2 == 1 {
                for i in 0..count {
                    panel[(k / 2) * width + i] = bits(self.first + i * self.step + k - 1);
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
    if len == 0 {
        return buf;
    }
    if par && len >= PAR_MIN_PACK {
        crate::pool::map_chunks_mut(&mut buf, panel, fill);
    } else {
        buf.chunks_mut(panel)
            .enumerate()
            .for_each(|(i, p)| fill(i, p));
    }
    buf
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// The first `pairs` pairs of `count` lines (unit element stride) into `panel` (lane
    /// `p * width + i`), 16 lines per gather: each gather reads one pair (4 bytes) of 16
    /// lines, one masked store writes them; no scattered scalar stores.
    ///
    /// # Safety
    /// Every line's first `2 * pairs` elements (line `i` at `first + i * step`) are in `data`, `16 * step` fits an
    /// `i32`, `panel` holds `pairs * width` lanes with `count <= width`; the CPU has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gather_pairs(
        data: &[bf16],
        (first, step): (usize, usize),
        panel: &mut [u32],
        width: usize,
        count: usize,
        pairs: usize,
    ) {
        let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let offs = _mm512_mullo_epi32(iota, _mm512_set1_epi32(step as i32));
        for i0 in (0..count).step_by(16) {
            let mask = ((1u32 << (count - i0).min(16)) - 1) as __mmask16;
            // SAFETY: line i0's first element (contract).
            let base = unsafe { data.as_ptr().add(first + i0 * step) };
            for p in 0..pairs {
                // SAFETY: elements 2p and 2p + 1 of the masked lines (offsets in bf16 units,
                // scale 2 bytes) are in `data`; lanes p * width + i0.. (masked) of `panel`.
                unsafe {
                    let at = base.add(2 * p) as *const _;
                    let zero = _mm512_setzero_si512();
                    let v = _mm512_mask_i32gather_epi32::<2>(zero, mask, offs, at);
                    let to = panel.as_mut_ptr().add(p * width + i0) as *mut _;
                    _mm512_mask_storeu_epi32(to, mask, v);
                }
            }
        }
    }
}
