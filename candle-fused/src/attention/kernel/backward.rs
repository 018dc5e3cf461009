//! The FlashAttention-2 backward of [`super`]: per `(batch, head)` task, `P` recomputed tile
//! by tile from the saved log-sum-exp, then `dV`, `dP`, `dS` and the `dQ` / `dK` products.

use super::{gemm, load, run_tasks, tile_scores, Geom, Mat, Params, Ptr, Scratch, KB, QB};
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
/// `dq`, `dk`, `dv` (which may point into one buffer). One task per `(b, h)`: it owns its
/// gradient rows, so there are no races and the summation order is fixed.
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
    let work = g.tq * g.tk * (3 * g.d + 2 * g.dv + 4);
    run_tasks(
        g.b * g.h,
        work,
        || Scratch::new(g, true),
        |bh, sc| {
            // SAFETY: task bh alone writes the gradient rows of head bh.
            unsafe { bwd_head(g, p, x, bh, sc, dq, dk, dv) }
        },
    );
}

/// # Safety
/// No other task writes the gradient rows of head `bh` concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn bwd_head<T: Elem>(
    g: &Geom,
    p: &Params<T::Acc>,
    x: &BwdInputs<T>,
    bh: usize,
    sc: &mut Scratch<T::Acc>,
    dq: Ptr<T>,
    dk: Ptr<T>,
    dv: Ptr<T>,
) where
    T::Acc: FastMath,
{
    let zero = T::Acc::ZERO;
    let one = T::Acc::ONE;
    let (d, dvn, tq, tk) = (g.d, g.dv, g.tq, g.tk);
    let (b, h) = (bh / g.h, bh % g.h);
    sc.load_head(g, b, h, x.q, x.k, x.v);
    for i in 0..tq {
        let orow = g.o.row(b, h, i);
        load(x.dout, orow, &mut sc.dout[i * dvn..(i + 1) * dvn]);
        // D_i = <dO_i, O_i> (also right with dropout: O_i = sum_j P_ij Z_ij v_j).
        load(x.o, orow, &mut sc.t[..dvn]);
        sc.di[i] = dot(&sc.dout[i * dvn..(i + 1) * dvn], &sc.t[..dvn]);
    }
    sc.dq.fill(zero);
    sc.dk.fill(zero);
    sc.dv.fill(zero);
    let lse = &x.lse[bh * tq..(bh + 1) * tq];
    let keep = T::Acc::c(1.0 / (1.0 - p.dropout as f64));
    let dropout = p.dropout > 0.0;
    let mut i0 = 0;
    while i0 < tq {
        let nq = QB.min(tq - i0);
        let kend = g.lim(p.causal, i0 + nq - 1);
        let mut j0 = 0;
        while j0 < kend {
            let nk = KB.min(kend - j0);
            let s = &mut sc.s[..nq * nk];
            tile_scores(g, p, &sc.q, &sc.k, s, i0, nq, j0, nk);
            // P = exp(S - L) (rows that see no key have L = -inf and contribute nothing).
            for r in 0..nq {
                let li = lse[i0 + r];
                let row = g.live_row(p.causal, &mut s[r * nk..(r + 1) * nk], i0 + r, j0);
                if li == T::Acc::NEG_INFINITY {
                    row.fill(zero);
                } else {
                    row.iter_mut().for_each(|x| *x = (*x - li).exp_fast());
                }
            }
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
                for r in 0..nq {
                    let u = &mut sc.u[..nk];
                    p.key.fill_uniform(g.drop_index(bh, i0 + r, j0), u);
                    let (prow, pzrow) = (&s[r * nk..(r + 1) * nk], &mut pz[r * nk..(r + 1) * nk]);
                    let dprow = &mut dp[r * nk..(r + 1) * nk];
                    for c in 0..nk {
                        let z = if u[c] < p.dropout { zero } else { keep };
                        pzrow[c] = prow[c] * z;
                        dprow[c] *= z;
                    }
                }
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
            // dS = P ∘ (dP - D_i) · scale, in place of dP.
            for r in 0..nq {
                let di = sc.di[i0 + r];
                let (prow, dsrow) = (&s[r * nk..(r + 1) * nk], &mut dp[r * nk..(r + 1) * nk]);
                for (ds, &pv) in dsrow.iter_mut().zip(prow) {
                    *ds = pv * (*ds - di) * p.scale;
                }
            }
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
            j0 += nk;
        }
        i0 += nq;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        for i in 0..tq {
            let src = &sc.dq[i * d..(i + 1) * d];
            dq.write(g.q.row(b, h, i), src.iter().map(|&a| T::from_acc(a)));
        }
        for j in 0..tk {
            let src = &sc.dk[j * d..(j + 1) * d];
            dk.write(g.k.row(b, h, j), src.iter().map(|&a| T::from_acc(a)));
            let src = &sc.dv[j * dvn..(j + 1) * dvn];
            dv.write(g.v.row(b, h, j), src.iter().map(|&a| T::from_acc(a)));
        }
    }
}
