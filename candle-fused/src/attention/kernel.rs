//! The CPU kernels of [`super`]: flash-style forward (online softmax over key blocks) and the
//! FlashAttention-2 backward, written over explicit strides so the same code reads `[B, H, T, D]`
//! tensors and GPT-2's fused `[B, T, 3C]` projection in place.
//!
//! The forward runs one task per `(batch, query head)`, the backward one per `(batch, kv head)`
//! (see [`backward`]). A task gathers its heads' rows into contiguous scratch (widened to the
//! accumulation type), then works tile by tile (`QB` query rows x up to `KB` keys) with small
//! single-threaded GEMMs (the `gemm` crate Candle's own matmul uses) for `Q Kᵀ`, `P V` and the
//! four backward products, and vectorised row loops for the softmax. Scratch per task is a few
//! `T x D` panels plus three `QB x KB` tiles: nothing of size `B x H x T x T` exists. Each task
//! owns its output rows, and a tile's arithmetic does not depend on which thread runs it, so the
//! result is bit-identical for every thread count.
//!
//! **Which keys a tile reads.** Row `i` sees the keys `lo(i)..hi(i)` ([`Geom::row_keys`]: the
//! causal limit, the sliding window, and the span of its document), minus the keys of other
//! documents inside that span when a document's positions are not contiguous. A block of query
//! rows reads the key tiles from the smallest `lo` to the largest `hi` of its rows (starting at
//! `lo`, not at a multiple of `KB`); everything outside is skipped, not masked. Inside a tile
//! the scores outside a row's span are set to 0 before they are used (the row's weights there
//! are exactly 0, so a NaN key outside a row's span does not reach it).

pub(super) mod backward;
mod tile;

pub(crate) use tile::Ptr;

use crate::cpu::{sum_map, Elem, Real};
use crate::gelu::FastMath;
use crate::RngKey;
use tile::{gemm, load, run_tasks, Mat};

pub(crate) use crate::cpu::View;

/// Query rows per tile. Small, so that a causal strip of rows stops at its last row's keys (at
/// T = 128 the strips read 10/16 of the score matrix, one 128-row tile all of it); the GEMMs
/// of a 32-row strip still run at the full width of `gemm`'s 16 x 6 micro-kernel. Chosen with
/// `cargo bench -p candle-fused --bench ops -- attention` (32: 1.62 / 4.1 ms forward + backward
/// for the baby GPT / GPT 4/4/256 shapes; 64: 1.70 / 4.3; 128: 1.69 / 4.8-5.2).
pub(crate) const QB: usize = 32;
/// Keys per tile (the online softmax runs over key tiles).
pub(crate) const KB: usize = 256;

/// Sizes and layouts of one attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geom {
    pub b: usize,
    /// Query heads.
    pub h: usize,
    /// Key / value heads (`h` is a multiple): query head `h` reads kv head `h / (h / kvh)`.
    pub kvh: usize,
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

    /// Query heads per kv head.
    #[inline(always)]
    fn rep(&self) -> usize {
        self.h / self.kvh
    }

    /// The keys `lo..hi` query row `i` of batch row `b` may see (empty when `hi <= lo`): below
    /// the causal limit, inside the window, inside the span of its document.
    #[inline(always)]
    fn row_keys<A>(&self, p: &Params<A>, b: usize, i: usize) -> (usize, usize) {
        let mut hi = self.lim(p.causal, i);
        // i_abs - j < w  <=>  j >= i_abs + 1 - w  (i_abs = i + tk - tq).
        let mut lo = match p.window {
            Some(w) => (i + self.tk + 1).saturating_sub(self.tq + w),
            None => 0,
        };
        if let Some(dc) = &p.docs {
            // Tq <= Tk with document ids (checked), so i_abs >= 0.
            let at = b * self.tk + i + self.tk - self.tq;
            lo = lo.max(dc.first[at] as usize);
            hi = hi.min(dc.last[at] as usize + 1);
        }
        (lo, hi)
    }

    /// The keys `lo..hi` some row of the query block `i0..i0 + nq` of batch row `b` may see.
    #[inline]
    fn block_keys<A>(&self, p: &Params<A>, b: usize, i0: usize, nq: usize) -> (usize, usize) {
        if p.docs.is_none() {
            // Both ends grow with the row.
            return (
                self.row_keys(p, b, i0).0,
                self.row_keys(p, b, i0 + nq - 1).1,
            );
        }
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in i0..i0 + nq {
            let (l, h) = self.row_keys(p, b, i);
            if l < h {
                (lo, hi) = (lo.min(l), hi.max(h));
            }
        }
        (lo.min(hi), hi)
    }

    /// The key tiles `(j0, nk)` (at most [`KB`] keys from `j0`), in order, that the query rows
    /// `i0 .. i0 + nq` of batch `b` read: keys no row of the block sees are never read.
    fn key_tiles<A>(
        &self,
        p: &Params<A>,
        b: usize,
        i0: usize,
        nq: usize,
    ) -> impl Iterator<Item = (usize, usize)> {
        let (kbeg, kend) = self.block_keys(p, b, i0, nq);
        (kbeg..kend)
            .step_by(KB)
            .map(move |j0| (j0, KB.min(kend - j0)))
    }

    /// Flat index of the dropout element `(bh, i, j)` in the `[B, H, Tq, Tk]` probabilities.
    #[inline(always)]
    fn drop_index(&self, bh: usize, i: usize, j: usize) -> u64 {
        ((bh as u64 * self.tq as u64) + i as u64) * self.tk as u64 + j as u64
    }
}

/// Document ids of a call and their spans, `[B, Tk]` each (see `HostDocs` in `super::config`).
#[derive(Clone, Copy)]
pub(crate) struct Docs<'a> {
    pub ids: &'a [u32],
    /// First position of the id of each position, in its batch row.
    pub first: &'a [u32],
    /// Last position of the id of each position, in its batch row.
    pub last: &'a [u32],
    /// Per batch row: every id occupies one contiguous run.
    pub runs: &'a [bool],
}

/// Scalar parameters of a call, in the accumulation type.
pub(crate) struct Params<'a, A> {
    pub scale: A,
    pub causal: bool,
    /// Additive `[Tq, Tk]` mask.
    pub mask: Option<&'a [A]>,
    pub dropout: f32,
    pub key: RngKey,
    /// Sliding window (with `causal`).
    pub window: Option<usize>,
    pub docs: Option<Docs<'a>>,
}

/// The part of the tile row (keys `j0..j0 + nk`) that row `i` of batch row `b` sees, its
/// scores; the rest of `row` is set to 0. With non-contiguous documents, the keys of other
/// documents inside the span are set to `fill` (`-inf` before a softmax, 0 after).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn live_row<'s, A: Real>(
    g: &Geom,
    p: &Params<A>,
    row: &'s mut [A],
    b: usize,
    i: usize,
    j0: usize,
    fill: A,
) -> (usize, &'s mut [A]) {
    let (a, e) = tile_span(g.row_keys(p, b, i), j0, row.len());
    let (head, rest) = row.split_at_mut(a);
    let (w, tail) = rest.split_at_mut(e - a);
    if !head.is_empty() {
        head.fill(A::ZERO);
    }
    if !tail.is_empty() {
        tail.fill(A::ZERO);
    }
    mask_docs(g, p, w, b, i, j0 + a, fill);
    (a, w)
}

/// The offsets `a..e` (`a <= e`) of the keys `lo..hi` in the tile of keys `j0..j0 + nk`.
#[inline(always)]
fn tile_span((lo, hi): (usize, usize), j0: usize, nk: usize) -> (usize, usize) {
    let a = lo.clamp(j0, j0 + nk) - j0;
    let e = hi.clamp(j0, j0 + nk) - j0;
    (a, e.max(a))
}

/// Sets the entries of `w` (keys `j0..`) of another document than row `i`'s to `fill` (only
/// in batch rows whose documents are not contiguous: otherwise the span is the document).
#[inline(always)]
fn mask_docs<A: Real>(
    g: &Geom,
    p: &Params<A>,
    w: &mut [A],
    b: usize,
    i: usize,
    j0: usize,
    fill: A,
) {
    if let Some(dc) = &p.docs {
        if !dc.runs[b] {
            let row = &dc.ids[b * g.tk..(b + 1) * g.tk];
            let qid = row[i + g.tk - g.tq];
            for (x, &id) in w.iter_mut().zip(&row[j0..]) {
                if id != qid {
                    *x = fill;
                }
            }
        }
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

    /// Gathers the rows of query head `(b, h)` of q.
    fn load_q<T: Elem<Acc = A>>(&mut self, g: &Geom, b: usize, h: usize, q: &[T]) {
        let d = g.d;
        for i in 0..g.tq {
            load(q, g.q.row(b, h, i), &mut self.q[i * d..(i + 1) * d]);
        }
    }

    /// Gathers the rows of kv head `(b, c)` of k and v.
    fn load_kv<T: Elem<Acc = A>>(&mut self, g: &Geom, b: usize, c: usize, k: &[T], v: &[T]) {
        let (d, dv) = (g.d, g.dv);
        for j in 0..g.tk {
            load(k, g.k.row(b, c, j), &mut self.k[j * d..(j + 1) * d]);
            load(v, g.v.row(b, c, j), &mut self.v[j * dv..(j + 1) * dv]);
        }
    }
}

/// Scores of tile (rows `i0..i0 + nq`, keys `j0..j0 + nk`) into `s` (`nq x nk`): scaled `q kᵀ`,
/// plus the mask. Entries outside a row's keys are not meaningful: both callers read only
/// each row's [`Geom::row_keys`] and set the rest of the row to 0 ([`live_row`]).
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
    sc.load_q(g, b, h, q);
    sc.load_kv(g, b, h / g.rep(), k, v);
    let keep = T::Acc::c(1.0 / (1.0 - p.dropout as f64));
    let mut i0 = 0;
    while i0 < tq {
        let nq = QB.min(tq - i0);
        let acc = &mut sc.t[..nq * dv];
        acc.fill(zero);
        sc.m[..nq].fill(neg_inf);
        sc.l[..nq].fill(zero);
        for (j0, nk) in g.key_tiles(p, b, i0, nq) {
            let s = &mut sc.s[..nq * nk];
            tile_scores(g, p, &sc.q, &sc.k, s, i0, nq, j0, nk);
            for r in 0..nq {
                // Keys the row does not see get weight 0, no exp taken (other documents inside
                // its span: -inf, exp gives 0).
                let row = &mut s[r * nk..(r + 1) * nk];
                let (a, w) = live_row(g, p, row, b, i0 + r, j0, neg_inf);
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
                    for (x, &uv) in w.iter_mut().zip(&u[a..]) {
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
