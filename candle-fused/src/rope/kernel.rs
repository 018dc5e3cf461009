//! The CPU kernels of [`super`]: one pass over the rows, the forward reading `x` `[B, T, H, D]`
//! through its strides and writing `y` `[B, H, T, D]` contiguous, the backward reading `dy`
//! `[B, H, T, D]` and writing `dx` `[B, T, H, D]`. Both are the same rotation, the backward's
//! by `-angle` (the transpose of a rotation); each output row is written by one piece, with
//! no reduction, so the result does not depend on the thread count.

use crate::cpu::{self, Elem, View};

/// Sizes of one call: `x` is `[B, T, H, 2 * half]`; the tables hold `half` values per row,
/// row `(b, t)` at `b * table_sb + t * half` (`table_sb` is 0 for tables shared by the batch).
#[derive(Clone, Copy, Debug)]
pub(super) struct Geom {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub half: usize,
    pub table_sb: usize,
}

impl Geom {
    #[inline(always)]
    fn table_row(&self, b: usize, t: usize) -> usize {
        b * self.table_sb + t * self.half
    }
}

/// Rotates one head row: `out[i] = src[i] c[i] - src[i + d] s[i]`,
/// `out[i + d] = src[i + d] c[i] + src[i] s[i]` (`d = c.len()`); with `INV` the inverse
/// rotation (`s -> -s`), `out[i] = src[i] c[i] + src[i + d] s[i]`,
/// `out[i + d] = src[i + d] c[i] - src[i] s[i]`. One product per term and one add or
/// subtract, in the accumulation type, rounded once.
#[inline(always)]
fn rotate<T: Elem, const INV: bool>(src: &[T], c: &[T::Acc], s: &[T::Acc], out: &mut [T]) {
    let d = c.len();
    let (x1, x2) = src[..2 * d].split_at(d);
    let (o1, o2) = out[..2 * d].split_at_mut(d);
    let rows = o1.iter_mut().zip(o2.iter_mut()).zip(x1.iter().zip(x2));
    for (((a, b), (u, v)), (cv, sv)) in rows.zip(c.iter().zip(s)) {
        let (u, v) = (u.acc(), v.acc());
        if INV {
            *a = T::from_acc(u * *cv + v * *sv);
            *b = T::from_acc(v * *cv - u * *sv);
        } else {
            *a = T::from_acc(u * *cv - v * *sv);
            *b = T::from_acc(v * *cv + u * *sv);
        }
    }
}

/// `y [B, H, T, D]` (contiguous) from `x` read through `xv`; `cos`, `sin`: the tables.
pub(super) fn forward<T: Elem>(
    g: &Geom,
    xv: &View,
    x: &[T],
    cos: &[T::Acc],
    sin: &[T::Acc],
) -> Vec<T> {
    let (d, dd) = (g.half, 2 * g.half);
    let mut y = vec![T::from_acc(zero::<T>()); g.b * g.h * g.t * dd];
    // Output row r = (b * H + h) * T + t.
    cpu::for_rows(&mut y, dd, 2 * dd, |r, yr| {
        let (t, bh) = (r % g.t, r / g.t);
        let (h, b) = (bh % g.h, bh / g.h);
        let xo = xv.row(b, h, t);
        let to = g.table_row(b, t);
        rotate::<T, false>(&x[xo..xo + dd], &cos[to..to + d], &sin[to..to + d], yr);
    });
    y
}

/// `dx [B, T, H, D]` (contiguous) from `dy [B, H, T, D]` (contiguous): the inverse rotation.
pub(super) fn backward<T: Elem>(g: &Geom, dy: &[T], cos: &[T::Acc], sin: &[T::Acc]) -> Vec<T> {
    let (d, dd) = (g.half, 2 * g.half);
    let mut dx = vec![T::from_acc(zero::<T>()); g.b * g.t * g.h * dd];
    // Gradient row r = (b * T + t) * H + h.
    cpu::for_rows(&mut dx, dd, 2 * dd, |r, dr| {
        let (h, bt) = (r % g.h, r / g.h);
        let (t, b) = (bt % g.t, bt / g.t);
        let o = ((b * g.h + h) * g.t + t) * dd;
        let to = g.table_row(b, t);
        rotate::<T, true>(&dy[o..o + dd], &cos[to..to + d], &sin[to..to + d], dr);
    });
    dx
}

#[inline(always)]
fn zero<T: Elem>() -> T::Acc {
    <T::Acc as cpu::Real>::ZERO
}
