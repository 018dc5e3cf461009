//! `gemm_bf16` against an f64 reference and the widened f32 GEMM (the `gemm` crate, what
//! `linear` runs without AVX512-BF16) of the same bf16 inputs: odd `m`, `n`, `k`, `k` odd and
//! across the cache block, transposed and padded (strided) operands, overwrite and accumulate,
//! below and above the parallel threshold, a bf16 result (the f32 one rounded once, bit for
//! bit), and the same bits on any thread count, tile shape and way of reading A.
//!
//! Every micro-kernel this CPU runs is tested: [`Kernel::Portable`] always (the packing and the
//! tiling on any machine), [`Kernel::Avx512Bf16`] where detected (the tests say when not).
//!
//! Tolerance. Products of two bf16 values are exact in f32, so the kernel and the widened f32
//! GEMM differ from the exact sum only by the rounding of their f32 additions, in different
//! orders. A sum of `k` terms rounded in any order is off by `Σ δ_i s_i` (`|δ_i| <= u = 2^-24`,
//! `s_i` the partial sums, each at most `S = Σ |a||b|`): at most `k u S` in the worst case,
//! and about `sqrt(k) u S` at most for independent roundings (in fact far less: partial sums
//! of mixed signs are much smaller than `S`). We allow `4 sqrt(k) u S` against the f64
//! reference (the same bound is asserted for the f32 GEMM, so it is no looser than what
//! `linear` accepted before) and twice that between the two. A packing slip (a wrong or
//! missing element) moves a sum by about `S / k`, 25x (k = 2) to 250x (k = 1000) more than
//! allowed. Small-integer inputs, whose sums are exact in f32 in any order, must match
//! exactly.

use super::{self as gemm_bf16, Kernel, Mat};
use half::bf16;

/// A 64-bit LCG (Knuth's MMIX constants): uniform values in [-1, 1).
struct Lcg(u64);

impl Lcg {
    /// Uniform in [-1, 1) (the top 53 bits of the state).
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
}

/// The kernels this machine runs (and says so when AVX512-BF16 is missing).
fn kernels() -> Vec<Kernel> {
    if gemm_bf16::available() {
        vec![Kernel::Portable, Kernel::Avx512Bf16]
    } else {
        eprintln!(
            "gemm_bf16: no AVX512-BF16 on this CPU: testing the portable micro-kernel only \
             (linear widens bf16 to f32 here)"
        );
        vec![Kernel::Portable]
    }
}

/// How an operand is stored.
#[derive(Clone, Copy, Debug)]
enum Store {
    /// Row-major.
    Rows,
    /// Column-major (a transposed view).
    Cols,
    /// Row-major inside a wider buffer (row stride `cols + 3`), starting 5 elements in.
    Padded,
    /// Every other element of a row-major buffer (no unit stride: packing's general path).
    Sparse,
}

/// A `rows x cols` matrix with values from `gen`, stored as `store`: the buffer, the offset of
/// element (0, 0) and the strides; plus the values row-major (exact, as f64).
struct Operand {
    buf: Vec<bf16>,
    off: usize,
    rs: usize,
    cs: usize,
    vals: Vec<f64>,
}

impl Operand {
    fn new(rows: usize, cols: usize, store: Store, mut gen: impl FnMut() -> f64) -> Self {
        let vals: Vec<f64> = (0..rows * cols)
            .map(|_| bf16::from_f64(gen()).to_f64())
            .collect();
        let (off, rs, cs, len) = match store {
            Store::Rows => (0, cols, 1, rows * cols),
            Store::Cols => (0, 1, rows, rows * cols),
            Store::Padded => (5, cols + 3, 1, 5 + rows * (cols + 3)),
            Store::Sparse => (0, 2 * cols, 2, 2 * rows * cols),
        };
        let mut buf = vec![bf16::from_f32(f32::NAN); len.max(1)];
        for r in 0..rows {
            for c in 0..cols {
                buf[off + r * rs + c * cs] = bf16::from_f64(vals[r * cols + c]);
            }
        }
        Operand {
            buf,
            off,
            rs,
            cs,
            vals,
        }
    }

    fn mat(&self) -> Mat<'_> {
        Mat {
            data: &self.buf[self.off..],
            rs: self.rs,
            cs: self.cs,
        }
    }

    /// Widened to f32 (the same view), for the `gemm` crate.
    fn widened(&self) -> Vec<f32> {
        self.buf.iter().map(|v| v.to_f32()).collect()
    }
}

/// The widened f32 GEMM of the same views (Candle's `gemm` crate), `c0 + a b`.
fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    a: &Operand,
    b: &Operand,
    c0: Option<&[f32]>,
) -> Vec<f32> {
    let (aw, bw) = (a.widened(), b.widened());
    let mut c = c0.map_or_else(|| vec![0f32; m * n], <[f32]>::to_vec);
    if m * n * k == 0 {
        return c;
    }
    // SAFETY: `c` is m x n row-major; the views cover their `m x k` and `k x n` elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            c0.is_some(),
            aw[a.off..].as_ptr(),
            a.cs as isize,
            a.rs as isize,
            bw[b.off..].as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    };
    c
}

/// Runs `kernel` on `(m, n, k)` with operands from `gen`, stored every way, overwriting and
/// accumulating, and checks against f64 and the f32 GEMM. `exact`: the sums are exact in f32.
fn check(kernel: Kernel, (m, n, k): (usize, usize, usize), exact: bool, rng: &mut Lcg) {
    let mut gen = |exact: bool| {
        let v = rng.next();
        if exact {
            (v * 8.0).round()
        } else {
            v * 2.0
        }
    };
    for (sa, sb) in [
        (Store::Rows, Store::Rows),
        (Store::Cols, Store::Cols),
        (Store::Padded, Store::Cols),
        (Store::Cols, Store::Padded),
        (Store::Sparse, Store::Sparse),
    ] {
        let a = Operand::new(m, k, sa, || gen(exact));
        let b = Operand::new(k, n, sb, || gen(exact));
        for acc in [false, true] {
            let c0: Option<Vec<f32>> = acc.then(|| (0..m * n).map(|_| gen(exact) as f32).collect());
            let got = match &c0 {
                Some(c0) => {
                    let mut c = c0.clone();
                    gemm_bf16::matmul_acc(kernel, (m, n, k), &mut c, a.mat(), b.mat(), true);
                    c
                }
                None => {
                    let c = gemm_bf16::matmul(kernel, (m, n, k), a.mat(), b.mat(), true);
                    // A bf16 result is the f32 one rounded once, bit for bit.
                    let rounded: Vec<u16> =
                        c.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
                    let direct = gemm_bf16::matmul_bf16(kernel, (m, n, k), [a.mat(), b.mat()]);
                    let direct: Vec<u16> = direct.iter().map(|v| v.to_bits()).collect();
                    assert!(
                        rounded == direct,
                        "{kernel:?} {m}x{n}x{k} {sa:?} {sb:?}: bf16 out"
                    );
                    c
                }
            };
            let f32g = gemm_f32(m, n, k, &a, &b, c0.as_deref());
            let what = format!("{kernel:?} {m}x{n}x{k} a {sa:?} b {sb:?} acc {acc}");
            assert_eq!(got.len(), m * n, "{what}");
            let ulp = f64::from(f32::EPSILON) / 2.0;
            for i in 0..m {
                for j in 0..n {
                    let start = c0.as_ref().map_or(0.0, |c| f64::from(c[i * n + j]));
                    let (mut exact_sum, mut s) = (start, start.abs());
                    for p in 0..k {
                        let t = a.vals[i * k + p] * b.vals[p * n + j];
                        exact_sum += t;
                        s += t.abs();
                    }
                    let (v, f) = (f64::from(got[i * n + j]), f64::from(f32g[i * n + j]));
                    if exact {
                        assert_eq!(v, exact_sum, "{what} at ({i}, {j})");
                        continue;
                    }
                    let tol =
                        4.0 * ((k + 1) as f64).sqrt() * ulp * s + f64::from(f32::MIN_POSITIVE);
                    assert!(
                        (v - exact_sum).abs() <= tol,
                        "{what} at ({i}, {j}): {v} vs exact {exact_sum} (tol {tol:e})"
                    );
                    assert!(
                        (f - exact_sum).abs() <= tol,
                        "f32 GEMM out of the tolerance: {what}"
                    );
                    assert!(
                        (v - f).abs() <= 2.0 * tol,
                        "{what} at ({i}, {j}): {v} vs f32 GEMM {f}"
                    );
                }
            }
        }
    }
}

/// Shapes around the tiles (6 x 64, and 8 x 48, 12 x 32, 12 x 16 for narrow outputs), task
/// (48 x 256) and cache-block (at most 320 k, in equal slices) sizes: 1s, odd everything, `k`
/// odd and one past the block, `k` even (row-major A read in place) with a partial last panel of rows; the last
/// crosses the parallel threshold.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (1, 1, 2),
    (2, 3, 1),
    (7, 5, 3),
    (6, 64, 2),
    (5, 63, 9),
    (13, 65, 31),
    (49, 257, 4),
    (12, 128, 257),
    (20, 70, 513),
    (9, 20, 321),
    (25, 16, 258),
    (16, 30, 64),
    (13, 40, 8),
    (30, 47, 6),
    (97, 300, 33),
];

#[test]
fn random_within_tolerance_of_exact_and_f32() {
    let mut rng = Lcg(1);
    for kernel in kernels() {
        for &shape in SHAPES {
            check(kernel, shape, false, &mut rng);
        }
    }
}

#[test]
fn small_integers_exact() {
    // |values| <= 8: products <= 64, sums of <= 600 terms < 2^24, exact in f32 in any order.
    let mut rng = Lcg(2);
    for kernel in kernels() {
        for &shape in SHAPES {
            check(kernel, shape, true, &mut rng);
        }
        check(kernel, (130, 200, 600), true, &mut rng);
    }
}

#[test]
fn empty_and_zero_k() {
    for kernel in kernels() {
        let a = Operand::new(3, 0, Store::Rows, || 1.0);
        let b = Operand::new(0, 4, Store::Rows, || 1.0);
        assert_eq!(
            gemm_bf16::matmul(kernel, (3, 4, 0), a.mat(), b.mat(), true),
            vec![0.0; 12]
        );
        let mut c = vec![2.0; 12];
        gemm_bf16::matmul_acc(kernel, (3, 4, 0), &mut c, a.mat(), b.mat(), true);
        assert_eq!(c, vec![2.0; 12]);
        let e = Operand::new(0, 5, Store::Rows, || 1.0);
        assert!(gemm_bf16::matmul(kernel, (0, 4, 5), e.mat(), b.mat(), true).is_empty());
    }
}

#[test]
#[should_panic(expected = "out of bounds")]
fn rejects_short_operand() {
    let a = Operand::new(4, 4, Store::Rows, || 1.0);
    gemm_bf16::matmul(Kernel::Portable, (5, 4, 4), a.mat(), a.mat(), false);
}

/// The bits of `a · b` (`m x n x k`).
fn bits(kernel: Kernel, (m, n, k): (usize, usize, usize), a: Mat<'_>, b: Mat<'_>) -> Vec<u32> {
    gemm_bf16::matmul(kernel, (m, n, k), a, b, true)
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn identical_for_any_thread_count() {
    // Far above the parallel threshold, several tasks: A packed (column-major, odd k) with the
    // wide tile, and A read in place (row-major, even k) with the narrow tile of a rank-16
    // output.
    let mut rng = Lcg(3);
    for ((m, n, k), sa) in [
        ((300, 200, 301), Store::Cols),
        ((300, 16, 600), Store::Rows),
    ] {
        let a = Operand::new(m, k, sa, || rng.next());
        let b = Operand::new(k, n, Store::Rows, || rng.next());
        for kernel in kernels() {
            let outs: Vec<Vec<u32>> = [1, 2, 3]
                .iter()
                .map(|&t| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(t)
                        .build()
                        .expect("pool");
                    pool.install(|| bits(kernel, (m, n, k), a.mat(), b.mat()))
                })
                .collect();
            assert!(
                outs[0] == outs[1] && outs[0] == outs[2],
                "{kernel:?} {m}x{n}x{k}"
            );
        }
    }
}

#[test]
fn identical_for_any_tile_shape_and_packing() {
    // Every tile shape and both ways of reading A sum each element in the same order, so a
    // column block computed alone (a narrower tile) and A packed (a strided copy of it) or
    // read in place give the same bits as the whole product.
    let mut rng = Lcg(4);
    let (m, n, k) = (37, 100, 520);
    let a = Operand::new(m, k, Store::Rows, || rng.next());
    let sparse = Operand::new(m, k, Store::Sparse, || 0.0);
    let a_packed = Operand {
        buf: (0..sparse.buf.len())
            .map(|i| match i % 2 {
                0 => a.buf[i / 2],
                _ => bf16::from_f32(f32::NAN),
            })
            .collect(),
        ..sparse
    };
    let b = Operand::new(k, n, Store::Rows, || rng.next());
    for kernel in kernels() {
        let whole = bits(kernel, (m, n, k), a.mat(), b.mat());
        assert_eq!(
            whole,
            bits(kernel, (m, n, k), a_packed.mat(), b.mat()),
            "{kernel:?}"
        );
        for w in [16, 30, 48] {
            let cols = Mat {
                data: &b.buf[n - w..],
                ..b.mat()
            };
            let part = bits(kernel, (m, w, k), a.mat(), cols);
            for i in 0..m {
                assert_eq!(
                    part[i * w..][..w],
                    whole[i * n + n - w..][..w],
                    "{kernel:?} row {i} of the last {w} columns"
                );
            }
        }
    }
}

#[test]
fn rounding_to_bf16_matches_half() {
    // Every 65521st bit pattern (all exponents, signs and low bits) and the edges: zeros,
    // infinities, NaNs (signalling, quiet, payloads that would carry), ties both ways,
    // the largest finite value (rounds to infinity), subnormals. 65 540 values: 4 past a
    // multiple of 16, so the one-by-one tail runs too.
    let mut bits: Vec<u32> = (0..=u32::MAX).step_by(65_521).collect();
    bits.extend([
        0,
        0x8000_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0x7FC0_0000,
        0xFFFF_FFFF,
        0x7FFF_8000,
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_8001,
        0x7F7F_FFFF,
        0x0000_0001,
        0x0000_8000,
        0x0001_8000,
        0x807F_FFFF,
    ]);
    let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let want: Vec<u16> = src.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    for kernel in kernels() {
        let mut dst = vec![bf16::ZERO; src.len()];
        super::kernel::round_bf16(kernel, &src, &mut dst);
        for (i, (d, w)) in dst.iter().zip(&want).enumerate() {
            assert_eq!(d.to_bits(), *w, "{kernel:?}: {:#010x}", bits[i]);
        }
    }
}
