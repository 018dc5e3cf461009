//! The operands as the micro-kernels read them: B packed in `NR`-column panels, A packed in
//! `MR`-row panels or, when its rows already hold the pairs, read in place ([`APanels`]).

use super::Mat;
use half::bf16;

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
    pub(super) fn new<const MR: usize>(a: Mat<'a>, m: usize, k: usize, par: bool) -> Self {
        if a.cs != 1 || k % 2 != 0 {
            return APanels::Packed(pack_lines(MR, a.data, m, a.rs, a.cs, k, par));
        }
        let full = m - m % MR;
        let rest = &a.data[(full * a.rs).min(a.data.len())..];
        APanels::Direct {
            data: a.data,
            rs: a.rs,
            full,
            tail: pack_lines(MR, rest, m - full, a.rs, 1, k, false),
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
pub(super) fn pack_b(b: Mat<'_>, k: usize, n: usize, nr: usize, par: bool) -> Vec<u32> {
    pack_lines(nr, b.data, n, b.cs, b.rs, k, par)
}

/// Packs `n` lines of `k` elements (line `i` starts at `i * step`, its elements `ks` apart)
/// into `w`-line panels of `kp = ceil(k/2)` pairs: A's rows (`w = MR`) or B's columns (`NR`).
fn pack_lines(
    w: usize,
    data: &[bf16],
    n: usize,
    step: usize,
    ks: usize,
    k: usize,
    par: bool,
) -> Vec<u32> {
    let kp = k.div_ceil(2);
    pack(n.div_ceil(w) * kp * w, kp * w, par, |p, panel| {
        let lines = Lines {
            data,
            first: p * w * step,
            step,
            ks,
        };
        lines.pack(panel, w, w.min(n - p * w), k);
    })
}

/// Pairs per stripe of the transposing copy in [`Lines::pack`]: the panel rows one stripe
/// writes stay in L1 while every line adds its lane.
const STRIPE: usize = 16;

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
    /// pair that is two neighbours of one line (`ks == 1`: row-major A, a `w.t()` weight as B;
    /// a transpose, done in stripes of [`STRIPE`] pairs) and a pair that is the same place of
    /// two rows (`step == 1`: `xᵀ` as A, row-major B).
    fn pack(&self, panel: &mut [u32], width: usize, count: usize, k: usize) {
        let bits = |i: usize| self.data[i].to_bits() as u32;
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
