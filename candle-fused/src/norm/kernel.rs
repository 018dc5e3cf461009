//! The CPU kernels of [`super`]: one sweep per row forward, one per row backward, the weight
//! and bias gradients summed over fixed row blocks in block order.

use super::Kind;
use crate::cpu::{self, Elem, Real};

/// `(y, mean, rstd)` for rows of `c` elements (`mean` is all zeros for RMSNorm).
pub(super) fn fwd_kernel<T: Elem>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    c: usize,
    eps: f64,
    kind: Kind,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    let wa: Vec<T::Acc> = w.iter().map(|v| v.acc()).collect();
    let ba: Option<Vec<T::Acc>> = b.map(|b| b.iter().map(|v| v.acc()).collect());
    let eps = T::Acc::c(eps);
    let inv_c = T::Acc::c(1.0 / c as f64);
    let mut y = vec![T::from_acc(T::Acc::ZERO); x.len()];
    let stats = cpu::for_row_blocks(&mut y, c, 4 * c, |r0, yb| {
        let mut st = Vec::with_capacity(yb.len() / c);
        for (k, yr) in yb.chunks_mut(c).enumerate() {
            let xr = &x[(r0 + k) * c..(r0 + k + 1) * c];
            let (mean, rstd) = match kind {
                Kind::Layer => {
                    let mean = cpu::sum_map(xr, |v| v.acc()) * inv_c;
                    let var = cpu::sum_map(xr, |v| {
                        let d = v.acc() - mean;
                        d * d
                    }) * inv_c;
                    (mean, T::Acc::ONE / (var + eps).sqrt())
                }
                Kind::Rms => {
                    let ms = cpu::sum_map(xr, |v| {
                        let a = v.acc();
                        a * a
                    }) * inv_c;
                    (T::Acc::ZERO, T::Acc::ONE / (ms + eps).sqrt())
                }
            };
            match &ba {
                Some(ba) => {
                    for (((yo, xv), wv), bv) in yr.iter_mut().zip(xr).zip(&wa).zip(ba) {
                        *yo = T::from_acc((xv.acc() - mean) * rstd * *wv + *bv);
                    }
                }
                None => {
                    for ((yo, xv), wv) in yr.iter_mut().zip(xr).zip(&wa) {
                        *yo = T::from_acc((xv.acc() - mean) * rstd * *wv);
                    }
                }
            }
            st.push((mean, rstd));
        }
        st
    });
    let n = x.len() / c;
    let (mut mean, mut rstd) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (m, r) in stats.into_iter().flatten() {
        mean.push(m);
        rstd.push(r);
    }
    (y, mean, rstd)
}

/// `(sum g, sum g * xhat)` over a row, `g = dy * w`, `xhat = (x - mean) * rstd`, 8 lanes.
#[inline(always)]
fn row_sums<T: Elem>(
    x: &[T],
    dy: &[T],
    w: &[T::Acc],
    mean: T::Acc,
    rstd: T::Acc,
) -> (T::Acc, T::Acc) {
    let z = T::Acc::ZERO;
    let (mut a, mut b) = ([z; 8], [z; 8]);
    let (mut cx, mut cd, mut cw) = (x.chunks_exact(8), dy.chunks_exact(8), w.chunks_exact(8));
    for ((xs, ds), ws) in (&mut cx).zip(&mut cd).zip(&mut cw) {
        for l in 0..8 {
            let g = ds[l].acc() * ws[l];
            a[l] += g;
            b[l] += g * ((xs[l].acc() - mean) * rstd);
        }
    }
    let fold = |v: [T::Acc; 8]| ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    let (mut sa, mut sb) = (fold(a), fold(b));
    for ((xv, dv), wv) in cx
        .remainder()
        .iter()
        .zip(cd.remainder())
        .zip(cw.remainder())
    {
        let g = dv.acc() * *wv;
        sa += g;
        sb += g * ((xv.acc() - mean) * rstd);
    }
    (sa, sb)
}

/// `(dx, dw, db)`; `mean` is `None` for RMSNorm (whose `dx` has no `mean(g)` term).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(super) fn bwd_kernel<T: Elem>(
    x: &[T],
    w: &[T],
    dy: &[T],
    mean: Option<&[T::Acc]>,
    rstd: &[T::Acc],
    c: usize,
    need_w: bool,
    need_b: bool,
) -> (Vec<T>, Option<Vec<T>>, Option<Vec<T>>) {
    let zero = T::Acc::ZERO;
    let wa: Vec<T::Acc> = w.iter().map(|v| v.acc()).collect();
    let inv_c = T::Acc::c(1.0 / c as f64);
    let mut dx = vec![T::from_acc(zero); x.len()];
    let parts = cpu::for_row_blocks(&mut dx, c, 8 * c, |r0, dxb| {
        let mut dw = if need_w { vec![zero; c] } else { Vec::new() };
        let mut db = if need_b { vec![zero; c] } else { Vec::new() };
        for (k, dxr) in dxb.chunks_mut(c).enumerate() {
            let i = r0 + k;
            let (xr, dyr) = (&x[i * c..(i + 1) * c], &dy[i * c..(i + 1) * c]);
            let m = mean.map_or(zero, |m| m[i]);
            let r = rstd[i];
            let (sg, sgx) = row_sums::<T>(xr, dyr, &wa, m, r);
            let mg = if mean.is_some() { sg * inv_c } else { zero };
            let mgx = sgx * inv_c;
            for (((d, xv), dv), wv) in dxr.iter_mut().zip(xr).zip(dyr).zip(&wa) {
                let xh = (xv.acc() - m) * r;
                *d = T::from_acc(r * (dv.acc() * *wv - mg - xh * mgx));
            }
            if need_w {
                for ((a, xv), dv) in dw.iter_mut().zip(xr).zip(dyr) {
                    *a += dv.acc() * ((xv.acc() - m) * r);
                }
            }
            if need_b {
                for (a, dv) in db.iter_mut().zip(dyr) {
                    *a += dv.acc();
                }
            }
        }
        (dw, db)
    });
    let total = |pick: fn(&(Vec<T::Acc>, Vec<T::Acc>)) -> &Vec<T::Acc>| -> Vec<T> {
        let mut s = vec![zero; c];
        for p in &parts {
            for (a, v) in s.iter_mut().zip(pick(p)) {
                *a += *v;
            }
        }
        s.into_iter().map(T::from_acc).collect()
    };
    let dw = need_w.then(|| total(|p| &p.0));
    let db = need_b.then(|| total(|p| &p.1));
    (dx, dw, db)
}
