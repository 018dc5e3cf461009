//! The FlashAttention-2 backward of [`super`]: `P` recomputed tile by tile from the saved
//! log-sum-exp, then `dV`, `dP`, `dS` and the `dQ` / `dK` products.
//!
//! **Grouped-query attention.** The `dK` / `dV` of a kv head are sums over the `H / KV` query
//! heads that read it. One task per `(batch, kv head)` runs those query heads one after the
//! other, in head order, accumulating into the same `dK` / `dV` scratch (and writing each query
//! head's `dQ` when it is done): no partial gradients of size `B x H x T x D` (what summing
//! per-`(batch, head)` partials in a fixed order would need), no atomics, and the summation
//! order is a function of the shapes only, so the result is bit-identical for every thread
//! count. With `H == KV` this is the one-task-per-`(batch, head)` backward. The price: only
//! `B * KV` tasks to spread over the threads.

use super::tile::{gemm, load, run_tasks, Mat, Ptr};
use super::{live_row, mask_docs, tile_scores, Geom, Params, Scratch, QB};
use crate::cpu::{dot, Elem, Real};
use crate::gelu::FastMath;

/// Inputs of the backward kernel (output and its gradient in layout `g.o`).
pub(crate) struct BwdInputs<'a, T: Elem> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub o: &'a [T],
    pub dout: &'a [T],
    pub lse: &'a [T::Acc],
}

/// Backward (FlashAttention-2): writes dQ, dK, dV in the layouts `g.q`, `g.k`, `g.v` through
/// `dq`, `dk`, `dv` (which may point into one buffer). One task per `(b, kv head)`: it owns its
/// gradient rows (those of the kv head and of its query heads), so there are no races and the
/// summation order is fixed.
pub(crate) fn backward<T: Elem>(
    g: &Geom,
    p: &Params<T::Acc>,
    x: &BwdInputs<T>,
    dq: Ptr<T>,
    dk: Ptr<T>,
    dv: Ptr<T>,
) where
    T::Acc: FastMath,
{
    let work = g.rep() * g.tq * g.tk * (3 * g.d + 2 * g.dv + 4);
    run_tasks(
        g.b * g.kvh,
        work,
        || Scratch::new(g, true),
        |bc, sc| {
            // SAFETY: task bc alone writes the gradient rows of kv head bc and its query heads.
            unsafe { bwd_group(g, p, x, bc, sc, dq, dk, dv) }
        },
    );
}

/// dK, dV of kv head `bc` (batch `bc / KV`, kv head `bc % KV`), and dQ of its query heads.
///
/// # Safety
/// No other task writes these gradient rows concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn bwd_group<T: Elem>(
    g: &Geom,
    p: &Params<T::Acc>,
    x: &BwdInputs<T>,
    bc: usize,
    sc: &mut Scratch<T::Acc>,
    dq: Ptr<T>,
    dk: Ptr<T>,
    dv: Ptr<T>,
) where
    T::Acc: FastMath,
{
    let (d, dvn, tk) = (g.d, g.dv, g.tk);
    let (b, c) = (bc / g.kvh, bc % g.kvh);
    let rep = g.rep();
    sc.load_kv(g, b, c, x.k, x.v);
    sc.dk.fill(T::Acc::ZERO);
    sc.dv.fill(T::Acc::ZERO);
    for h in c * rep..(c + 1) * rep {
        // SAFETY: forwarded from the caller (query head h belongs to kv head c).
        unsafe { bwd_head(g, p, x, b * g.h + h, sc, dq) };
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        for j in 0..tk {
            let src = &sc.dk[j * d..(j + 1) * d];
            dk.write(g.k.row(b, c, j), src.iter().map(|&a| T::from_acc(a)));
            let src = &sc.dv[j * dvn..(j + 1) * dvn];
            dv.write(g.v.row(b, c, j), src.iter().map(|&a| T::from_acc(a)));
        }
    }
}

/// Query head `bh`: writes its dQ rows, adds its share to the kv head's dK, dV in `sc`.
///
/// # Safety
/// No other task writes the dQ rows of head `bh` concurrently.
unsafe fn bwd_head<T: Elem>(
    g: &Geom,
    p: &Params<T::Acc>,
    x: &BwdInputs<T>,
    bh: usize,
    sc: &mut Scratch<T::Acc>,
    dq: Ptr<T>,
) where
    T::Acc: FastMath,
{
    let (zero, one) = (T::Acc::ZERO, T::Acc::ONE);
    let (d, dvn, tq) = (g.d, g.dv, g.tq);
    let (b, h) = (bh / g.h, bh % g.h);
    sc.load_q(g, b, h, x.q);
    for i in 0..tq {
        let orow = g.o.row(b, h, i);
        load(x.dout, orow, &mut sc.dout[i * dvn..(i + 1) * dvn]);
        // D_i = <dO_i, O_i> (also right with dropout: O_i = sum_j P_ij Z_ij v_j).
        load(x.o, orow, &mut sc.t[..dvn]);
        sc.di[i] = dot(&sc.dout[i * dvn..(i + 1) * dvn], &sc.t[..dvn]);
    }
    sc.dq.fill(zero);
    let lse = &x.lse[bh * tq..(bh + 1) * tq];
    let dropout = p.dropout > 0.0;
    let mut i0 = 0;
    while i0 < tq {
        let nq = QB.min(tq - i0);
        for (j0, nk) in g.key_tiles(p, b, i0, nq) {
            let s = &mut sc.s[..nq * nk];
            tile_scores(g, p, &sc.q, &sc.k, s, i0, nq, j0, nk);
            let spans = tile_probs(g, p, s, lse, b, (i0, nq), j0);
            // dP = dO Vᵀ.
            let dp = &mut sc.t[..nq * nk];
            gemm(
                nq,
                nk,
                dvn,
                dp,
                false,
                Mat::rows(&sc.dout[i0 * dvn..], dvn),
                Mat::rows_t(&sc.v[j0 * dvn..], dvn),
                one,
            );
            // With dropout Z = keep mask / (1 - p): dV uses P∘Z, and dP is taken through Z.
            let pz: &[T::Acc] = if dropout {
                let pz = &mut sc.pz[..nq * nk];
                dropout_tile(g, p, (s, dp, pz), &mut sc.u, bh, (i0, nq), (j0, nk));
                pz
            } else {
                s
            };
            // dV_j += (P∘Z)ᵀ dO_i.
            gemm(
                nk,
                dvn,
                nq,
                &mut sc.dv[j0 * dvn..],
                true,
                Mat::rows_t(pz, nk),
                Mat::rows(&sc.dout[i0 * dvn..], dvn),
                one,
            );
            tile_ds(g, p, s, dp, &sc.di[i0..], &spans[..nq], b, (i0, j0, nk));
            // dQ_i += dS K_j; dK_j += dSᵀ Q_i.
            gemm(
                nq,
                d,
                nk,
                &mut sc.dq[i0 * d..],
                true,
                Mat::rows(dp, nk),
                Mat::rows(&sc.k[j0 * d..], d),
                one,
            );
            gemm(
                nk,
                d,
                nq,
                &mut sc.dk[j0 * d..],
                true,
                Mat::rows_t(dp, nk),
                Mat::rows(&sc.q[i0 * d..], d),
                one,
            );
        }
        i0 += nq;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        for i in 0..tq {
            let src = &sc.dq[i * d..(i + 1) * d];
            dq.write(g.q.row(b, h, i), src.iter().map(|&a| T::from_acc(a)));
        }
    }
}

/// `P = exp(S - L)` in place of the scores `s` of a tile (`nq` rows from `i0`, keys from
/// `j0`; `lse`: the head's `L`): rows that see no key have `L = -inf` and contribute nothing;
/// 0 exactly where the row does not see the key. Returns each row's span of keys it sees.
fn tile_probs<A: FastMath>(
    g: &Geom,
    p: &Params<A>,
    s: &mut [A],
    lse: &[A],
    b: usize,
    (i0, nq): (usize, usize),
    j0: usize,
) -> [(usize, usize); QB] {
    let (zero, nk) = (A::ZERO, s.len() / nq);
    let mut spans = [(0usize, 0usize); QB];
    for r in 0..nq {
        let li = lse[i0 + r];
        let srow = &mut s[r * nk..(r + 1) * nk];
        let (a, row) = live_row(g, p, srow, b, i0 + r, j0, A::NEG_INFINITY);
        spans[r] = (a, a + row.len());
        if li == A::NEG_INFINITY {
            row.fill(zero);
        } else {
            row.iter_mut().for_each(|x| *x = (*x - li).exp_fast());
            // Other documents: exp(-inf - L) = 0, also when L is NaN.
            mask_docs(g, p, row, b, i0 + r, j0 + a, zero);
        }
    }
    spans
}

/// With dropout `Z = keep mask / (1 - p)` (drawn for query head `bh`): `P∘Z` of the tile's
/// `P` into `pz`, and `dP` taken through `Z` in place; `u`: scratch for the uniforms.
fn dropout_tile<A: Real>(
    g: &Geom,
    p: &Params<A>,
    (s, dp, pz): (&[A], &mut [A], &mut [A]),
    u: &mut [f32],
    bh: usize,
    (i0, nq): (usize, usize),
    (j0, nk): (usize, usize),
) {
    let (zero, keep) = (A::ZERO, A::c(1.0 / (1.0 - p.dropout as f64)));
    for r in 0..nq {
        let u = &mut u[..nk];
        p.key.fill_uniform(g.drop_index(bh, i0 + r, j0), u);
        let (prow, pzrow) = (&s[r * nk..(r + 1) * nk], &mut pz[r * nk..(r + 1) * nk]);
        let dprow = &mut dp[r * nk..(r + 1) * nk];
        for c in 0..nk {
            let z = if u[c] < p.dropout { zero } else { keep };
            pzrow[c] = prow[c] * z;
            dprow[c] *= z;
        }
    }
}

/// `dS = P ∘ (dP - D_i) · scale`, in place of the tile's `dp` (`di`: `D` from row `i0` on,
/// `spans`: each row's keys, from [`tile_probs`]); 0 exactly where the row does not see the
/// key (so a NaN in `D_i` stays off the keys the row does not see).
#[allow(clippy::too_many_arguments)]
fn tile_ds<A: Real>(
    g: &Geom,
    p: &Params<A>,
    s: &[A],
    dp: &mut [A],
    di: &[A],
    spans: &[(usize, usize)],
    b: usize,
    (i0, j0, nk): (usize, usize, usize),
) {
    let zero = A::ZERO;
    for (r, &(a, e)) in spans.iter().enumerate() {
        let di = di[r];
        let (prow, dsrow) = (&s[r * nk..(r + 1) * nk], &mut dp[r * nk..(r + 1) * nk]);
        let (head, rest) = dsrow.split_at_mut(a);
        let (live, tail) = rest.split_at_mut(e - a);
        if !head.is_empty() {
            head.fill(zero);
        }
        if !tail.is_empty() {
            tail.fill(zero);
        }
        for (ds, &pv) in live.iter_mut().zip(&prow[a..e]) {
            *ds = pv * (*ds - di) * p.scale;
        }
        mask_docs(g, p, live, b, i0 + r, j0 + a, zero);
    }
}
