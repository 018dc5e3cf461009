//! The CPU kernels of [`super`]: flash-style forward (online softmax over key blocks) and the
//! FlashAttention-2 backward, written over explicit strides so the same code reads `[B, H, T, D]`
//! tensors and GPT-2's fused `[B, T, 3C]` projection in place.
//!
//! One task per `(batch, head)`: it gathers the head's rows into contiguous scratch (widened to
//! the accumulation type), then works tile by tile (`QB` query rows x `KB` keys) with small
//! single-threaded GEMMs (the `gemm` crate Candle's own matmul uses) for `Q Kᵀ`, `P V` and the
//! four backward products, and vectorised row loops for the softmax. Scratch per task is a few
//! `T x D` panels plus three `QB x KB` tiles: nothing of size `B x H x T x T` exists. Each task
//! owns its output rows, and a tile's arithmetic does not depend on which thread runs it, so the
//! result is bit-identical for every thread count.

mod backward;

pub(crate) use backward::{backward, BwdInputs};

use crate::cpu::{sum_map, Elem, Real, PAR_MIN_WORK};
use crate::gelu::FastMath;
use crate::pool;
use crate::RngKey;

/// Query rows per tile. Small, so that a causal strip of rows stops at its last row's keys (at
/// T = 128 the strips read 10/16 of the score matrix, one 128-row tile all of it); the GEMMs
/// of a 32-row strip still run at the full width of `gemm`'s 16 x 6 micro-kernel. Chosen with
/// `cargo bench -p candle-fused --bench ops -- attention` (32: 1.62 / 4.1 ms forward + backward
/// for the baby GPT / GPT 4/4/256 shapes; 64: 1.70 / 4.3; 128: 1.69 / 4.8-5.2).
pub(crate) const QB: usize = 32;
/// Keys per tile (the online softmax runs over key tiles).
pub(crate) const KB: usize = 256;

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
    pub fn bhtd(h: usize, t: usize, d: usize) -> Self {
        View {
            off: 0,
            sb: h * t * d,
            sh: t * d,
            st: d,
        }
    }

    /// Head-interleaved `[B, T, W]` rows whose head `h` sits at columns `off + h * d ..`.
    pub fn interleaved(off: usize, t: usize, w: usize, d: usize) -> Self {
        View {
            off,
            sb: t * w,
            sh: d,
            st: w,
        }
    }

    #[inline(always)]
    fn row(&self, b: usize, h: usize, t: usize) -> usize {
        self.off + b * self.sb + h * self.sh + t * self.st
    }
}

/// Sizes and layouts of one attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geom {
    pub b: usize,
    pub h: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub dv: usize,
    pub q: View,
    pub k: View,
    pub v: View,
    /// Layout of the output (and of its gradient).
    pub o: View,
}

impl Geom {
    /// Number of keys query row `i` sees: `0..lim(i)`.
    #[inline(always)]
    fn lim(&self, causal: bool, i: usize) -> usize {
        if causal {
            (i + self.tk + 1).saturating_sub(self.tq).min(self.tk)
        } else {
            self.tk
        }
    }

    /// The keys query row `i` sees in `row`, the scores of the keys `j0..j0 + row.len()`; the
    /// rest of `row`, past the row's causal limit, is set to 0.
    #[inline(always)]
    fn live_row<'s, A: Real>(
        &self,
        causal: bool,
        row: &'s mut [A],
        i: usize,
        j0: usize,
    ) -> &'s mut [A] {
        let live = self.lim(causal, i).saturating_sub(j0).min(row.len());
        let (w, dead) = row.split_at_mut(live);
        dead.fill(A::ZERO);
        w
    }

    /// Flat index of the dropout element `(bh, i, j)` in the `[B, H, Tq, Tk]` probabilities.
    #[inline(always)]
    fn drop_index(&self, bh: usize, i: usize, j: usize) -> u64 {
        ((bh as u64 * self.tq as u64) + i as u64) * self.tk as u64 + j as u64
    }
}

/// Scalar parameters of a call, in the accumulation type.
pub(crate) struct Params<'a, A> {
    pub scale: A,
    pub causal: bool,
    /// Additive `[Tq, Tk]` mask.
    pub mask: Option<&'a [A]>,
    pub dropout: f32,
    pub key: RngKey,
}

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
    unsafe fn write(self, off: usize, vals: impl ExactSizeIterator<Item = T>) {
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
fn load<T: Elem>(src: &[T], off: usize, dst: &mut [T::Acc]) {
    let n = dst.len();
    for (d, s) in dst.iter_mut().zip(&src[off..off + n]) {
        *d = s.acc();
    }
}

/// Runs `f(task, scratch)` for `0..n` tasks, in parallel when `n * work` is large enough. Each
/// task's result depends on the task alone, so the split does not change any bit.
fn run_tasks<S: Send>(
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
struct Mat<A> {
    ptr: *const A,
    rs: usize,
    cs: usize,
}

impl<A> Mat<A> {
    /// Rows of `cols` contiguous elements.
    fn rows(s: &[A], cols: usize) -> Self {
        Mat {
            ptr: s.as_ptr(),
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of [`Mat::rows`].
    fn rows_t(s: &[A], cols: usize) -> Self {
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
fn gemm<A: Real>(
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

/// Scratch of one task: the head's rows and the tiles.
struct Scratch<A> {
    q: Vec<A>,
    k: Vec<A>,
    v: Vec<A>,
    /// Scores / probabilities tile.
    s: Vec<A>,
    /// dP / dS tile (backward), accumulator (forward).
    t: Vec<A>,
    /// Dropped probabilities tile (backward with dropout).
    pz: Vec<A>,
    dout: Vec<A>,
    dq: Vec<A>,
    dk: Vec<A>,
    dv: Vec<A>,
    di: Vec<A>,
    m: Vec<A>,
    l: Vec<A>,
    u: Vec<f32>,
}

impl<A: Real> Scratch<A> {
    fn new(g: &Geom, backward: bool) -> Self {
        let z = A::ZERO;
        let (tq, tk, d, dv) = (g.tq, g.tk, g.d, g.dv);
        let (qb, kb) = (QB.min(tq), KB.min(tk));
        let bw = |n: usize| if backward { vec![z; n] } else { Vec::new() };
        Scratch {
            q: vec![z; tq * d],
            k: vec![z; tk * d],
            v: vec![z; tk * dv],
            s: vec![z; qb * kb],
            t: vec![z; (qb * kb).max(qb * dv)],
            pz: bw(qb * kb),
            dout: bw(tq * dv),
            dq: bw(tq * d),
            dk: bw(tk * d),
            dv: bw(tk * dv),
            di: bw(tq),
            m: vec![z; qb],
            l: vec![z; qb],
            u: vec![0f32; kb],
        }
    }

    /// Gathers the rows of head `(b, h)` of q, k, v.
    fn load_head<T: Elem<Acc = A>>(
        &mut self,
        g: &Geom,
        b: usize,
        h: usize,
        q: &[T],
        k: &[T],
        v: &[T],
    ) {
        let (d, dv) = (g.d, g.dv);
        for i in 0..g.tq {
            load(q, g.q.row(b, h, i), &mut self.q[i * d..(i + 1) * d]);
        }
        for j in 0..g.tk {
            load(k, g.k.row(b, h, j), &mut self.k[j * d..(j + 1) * d]);
            load(v, g.v.row(b, h, j), &mut self.v[j * dv..(j + 1) * dv]);
        }
    }
}

/// Scores of tile (rows `i0..i0 + nq`, keys `j0..j0 + nk`) into `s` (`nq x nk`): scaled `q kᵀ`,
/// plus the mask. Entries past a row's causal limit are not meaningful: both callers read only
/// each row's keys below [`Geom::lim`] and set the rest of the row to 0.
#[allow(clippy::too_many_arguments)]
fn tile_scores<A: Real>(
    g: &Geom,
    p: &Params<A>,
    sc_q: &[A],
    sc_k: &[A],
    s: &mut [A],
    i0: usize,
    nq: usize,
    j0: usize,
    nk: usize,
) {
    let d = g.d;
    gemm(
        nq,
        nk,
        d,
        s,
        false,
        Mat::rows(&sc_q[i0 * d..], d),
        Mat::rows_t(&sc_k[j0 * d..], d),
        p.scale,
    );
    for r in 0..nq {
        let i = i0 + r;
        let row = &mut s[r * nk..(r + 1) * nk];
        if let Some(mk) = p.mask {
            for (x, m) in row.iter_mut().zip(&mk[i * g.tk + j0..i * g.tk + j0 + nk]) {
                *x += *m;
            }
        }
    }
}

/// Forward: the output (in layout `g.o`, length `out_len`) and the per-row log-sum-exp
/// `[B, H, Tq]` (`-inf` for rows that see no key; their output is 0).
pub(crate) fn forward<T: Elem>(
    g: &Geom,
    p: &Params<T::Acc>,
    q: &[T],
    k: &[T],
    v: &[T],
    out_len: usize,
) -> (Vec<T>, Vec<T::Acc>)
where
    T::Acc: FastMath,
{
    let mut out = vec![T::from_acc(T::Acc::ZERO); out_len];
    let mut lse = vec![T::Acc::ZERO; g.b * g.h * g.tq];
    let (po, pl) = (Ptr::new(&mut out), Ptr::new(&mut lse));
    let work = g.tq * g.tk * (g.d + g.dv + 4);
    run_tasks(
        g.b * g.h,
        work,
        || Scratch::new(g, false),
        |bh, sc| {
            // SAFETY: task bh alone writes the output rows and LSE entries of head bh.
            unsafe { fwd_head(g, p, q, k, v, bh, sc, po, pl) }
        },
    );
    (out, lse)
}

/// # Safety
/// No other task writes the output rows / LSE entries of head `bh` concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn fwd_head<T: Elem>(
    g: &Geom,
    p: &Params<T::Acc>,
    q: &[T],
    k: &[T],
    v: &[T],
    bh: usize,
    sc: &mut Scratch<T::Acc>,
    out: Ptr<T>,
    lse: Ptr<T::Acc>,
) where
    T::Acc: FastMath,
{
    let zero = T::Acc::ZERO;
    let neg_inf = T::Acc::NEG_INFINITY;
    let (dv, tq) = (g.dv, g.tq);
    let (b, h) = (bh / g.h, bh % g.h);
    sc.load_head(g, b, h, q, k, v);
    let keep = T::Acc::c(1.0 / (1.0 - p.dropout as f64));
    let mut i0 = 0;
    while i0 < tq {
        let nq = QB.min(tq - i0);
        let acc = &mut sc.t[..nq * dv];
        acc.fill(zero);
        sc.m[..nq].fill(neg_inf);
        sc.l[..nq].fill(zero);
        // Keys beyond the last row's causal limit are never read.
        let kend = g.lim(p.causal, i0 + nq - 1);
        let mut j0 = 0;
        while j0 < kend {
            let nk = KB.min(kend - j0);
            let s = &mut sc.s[..nq * nk];
            tile_scores(g, p, &sc.q, &sc.k, s, i0, nq, j0, nk);
            for r in 0..nq {
                // Keys past the row's causal limit are -inf: their weights are 0, no exp taken.
                let w = g.live_row(p.causal, &mut s[r * nk..(r + 1) * nk], i0 + r, j0);
                // Online softmax. NaN-propagating max; while a row has seen only -inf,
                // exponents are taken against 0 so no -inf - -inf appears.
                let m_old = sc.m[r];
                let m_new = w.iter().fold(m_old, |a, &x| a.max_nan(x));
                let m_use = if m_new == neg_inf { zero } else { m_new };
                let alpha = (m_old - m_use).exp_fast();
                if alpha != T::Acc::ONE {
                    sc.l[r] *= alpha;
                    acc[r * dv..(r + 1) * dv]
                        .iter_mut()
                        .for_each(|a| *a *= alpha);
                }
                // A branch-free exp in its own loop (vectorises), then an 8-lane sum.
                w.iter_mut().for_each(|x| *x = (*x - m_use).exp_fast());
                sc.l[r] += sum_map(w, |x| x);
                if p.dropout > 0.0 {
                    // Every weight counts in the normaliser; only kept ones reach the numerator.
                    let u = &mut sc.u[..nk];
                    p.key.fill_uniform(g.drop_index(bh, i0 + r, j0), u);
                    for (x, &uv) in w.iter_mut().zip(u.iter()) {
                        if uv < p.dropout {
                            *x = zero;
                        }
                    }
                }
                sc.m[r] = m_new;
            }
            gemm(
                nq,
                dv,
                nk,
                acc,
                true,
                Mat::rows(s, nk),
                Mat::rows(&sc.v[j0 * dv..], dv),
                T::Acc::ONE,
            );
            j0 += nk;
        }
        for r in 0..nq {
            let i = i0 + r;
            let (row_lse, inv) = if sc.m[r] == neg_inf {
                (neg_inf, zero)
            } else {
                (sc.m[r] + sc.l[r].ln(), keep / sc.l[r])
            };
            let arow = &acc[r * dv..(r + 1) * dv];
            // SAFETY: forwarded from the caller.
            unsafe {
                out.write(g.o.row(b, h, i), arow.iter().map(|&a| T::from_acc(a * inv)));
                lse.write(bh * tq + i, std::iter::once(row_lse));
            }
        }
        i0 += nq;
    }
}
