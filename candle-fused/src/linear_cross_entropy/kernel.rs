//! The CPU kernel of [`super::linear_cross_entropy`]: one pass over the counted rows, `chunk`
//! rows at a time, with the crate's GEMM (`linear::gemm`: f32 / f64 through the `gemm` crate,
//! bf16 on AVX512-BF16 where the CPU has it, split over the output so every sum is the same on
//! any number of threads).
//!
//! Per chunk of `R` counted rows (gathered into `xc [R, C]`), the vocabulary in blocks `b` of
//! [`VB`] classes (`W_b`: those rows of `W`):
//!
//! ```text
//! L_b = xc W_bᵀ                      [R, VB]  per block (GEMM 1; 16-bit: rounded to the dtype)
//! lse_r = log Σ_b Σ_j exp L_b,rj,  nll_r = lse_r - L_r,t_r      (rows in parallel)
//! G_b = s (exp(L_b - lse) - onehot(t))   in place over L_b (16-bit: rounded to the dtype)
//! dxc = Σ_b G_b W_b                  [R, C]   (GEMM 2, blocks added in order; rows -> dx)
//! dW_b += G_bᵀ xc                    [VB, C]  (GEMM 3, chunks added in order, f32 / f64)
//! ```
//!
//! `s` is the upstream gradient over the count (times the row's own upstream gradient `g_r`
//! in the per-token form, one product per row; its recomputing backward passes the forward's
//! `lse` and skips the max and the sum). The chunk's logits are stored block after
//! block (block `b`, `[R, VB]` row-major, at offset `R * b * VB`), so every GEMM reads and
//! writes plain row-major matrices and packs at most one block of its operands: no temporary
//! ever holds a whole `W` (the bf16 kernel packs both operands) or a whole `Gᵀ` (the `gemm`
//! crate prepacks its left operand).

use std::any::TypeId;
use std::borrow::Cow;

use crate::cpu::{self, Elem, Real};
use crate::gelu::FastMath;
use crate::linear::gemm::{gemm_raw, narrow, operand, Operand};
use crate::linear::Strided;
use crate::pool::{self, Shared};

/// Classes per vocabulary block of the GEMMs.
pub(super) const VB: usize = 4096;

/// What one pass computes, and over which rows.
pub(super) struct Pass<'a> {
    /// Rows of `x`.
    pub n: usize,
    /// Width of `x` (columns of `W`).
    pub c: usize,
    /// Vocabulary (rows of `W`).
    pub v: usize,
    /// Flat indices of the counted rows (target not ignored), ascending.
    pub rows: &'a [usize],
    /// The flat targets of every row.
    pub targets: &'a [u32],
    /// Counted rows per chunk (at least 1).
    pub chunk: usize,
    /// Which gradients to compute: `[dx, dW]`.
    pub need: [bool; 2],
    /// `s`: the upstream gradient of the loss over the count of counted rows.
    pub scale: f64,
    /// Per-row factors of `s` (indexed by flat row; the per-token form's upstream gradient):
    /// row `i`'s coefficient is the one product `s g_i`.
    pub row_scale: Option<&'a [f64]>,
    /// The counted rows' `lse` from an earlier pass (in row order): used instead of
    /// recomputing it (the per-token form's recomputing backward).
    pub lse: Option<&'a [f64]>,
}

impl Pass<'_> {
    /// The coefficient `s` (`s g_i` with a per-row scale) of flat row `i`.
    fn coef<A: Real>(&self, i: usize) -> A {
        match self.row_scale {
            Some(g) => A::c(self.scale * g[i]),
            None => A::c(self.scale),
        }
    }
}

/// The results of a pass.
pub(super) struct Output<T> {
    /// `Σ nll_r` over the counted rows, added in row order in f64.
    pub nll_sum: f64,
    /// `nll_r` of each counted row, in row order.
    pub nll: Vec<f64>,
    /// `lse_r` of each counted row, in row order.
    pub lse: Vec<f64>,
    /// `dx [n, c]` (zero rows where the target is ignored), if asked for.
    pub dx: Option<Vec<T>>,
    /// `dW [v, c]`, if asked for.
    pub dw: Option<Vec<T>>,
}

fn same<A: 'static, B: 'static>() -> bool {
    TypeId::of::<A>() == TypeId::of::<B>()
}

/// The operand `op` from element `off` on.
fn from<'a, A: Clone>(op: &'a Operand<'_, A>, off: usize) -> Operand<'a, A> {
    match op {
        Operand::Bf16(s) => Operand::Bf16(&s[off..]),
        Operand::Acc(s) => Operand::Acc(Cow::Borrowed(&s[off..])),
    }
}

/// The max of `s`, skipping NaN (8 lanes, as `cross_entropy`'s row log-sum-exp).
#[inline(always)]
fn max_skip_nan<A: Real>(s: &[A], mut m: A) -> A {
    let mut mx = [A::NEG_INFINITY; 8];
    let mut it = s.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            mx[l] = if c[l] > mx[l] { c[l] } else { mx[l] };
        }
    }
    for &v in mx.iter().chain(it.remainder()) {
        m = if v > m { v } else { m };
    }
    m
}

/// What every chunk of a pass shares: `W` as a GEMM operand with its strides (`ws`; `wt` for
/// `Wᵀ`, `[c, v]`), the vocabulary blocks `(first class, width)` and the GEMMs' threads.
struct Weights<'a, A: Clone> {
    op: Operand<'a, A>,
    ws: Strided,
    wt: Strided,
    blocks: Vec<(usize, usize)>,
    threads: usize,
}

/// Runs the pass over `x [n, c]` (contiguous) and `w [v, c]` (any strides).
pub(super) fn run<T: Elem>(x: &[T], (w, ws): (&[T], Strided), p: &Pass<'_>) -> Output<T>
where
    T::Acc: FastMath,
{
    let (n, c, v) = (p.n, p.c, p.v);
    let zero = T::Acc::ZERO;
    // 16-bit storage: logits and their gradients are rounded to it, as the 16-bit GEMM and the
    // cast of the composite expression round them.
    let round = !same::<T, T::Acc>();
    let wts = Weights {
        op: operand(w),
        ws,
        // Wᵀ as a [c, v] operand: element (k, j) is w[j, k].
        wt: Strided {
            rs: ws.cs,
            cs: ws.rs,
        },
        blocks: (0..v).step_by(VB).map(|b| (b, VB.min(v - b))).collect(),
        threads: pool::parts(),
    };
    let xs = Strided { rs: c, cs: 1 };
    let grads = p.need[0] || p.need[1];
    let mut dx = p.need[0].then(|| vec![T::from_acc(zero); n * c]);
    let mut dw: Vec<T::Acc> = Vec::new();
    let mut dw_started = false;
    if p.need[1] {
        dw.reserve_exact(v * c);
    }
    let mut buf = vec![zero; p.chunk.min(p.rows.len()) * v];
    let mut nll_sum = 0f64;
    let (mut nll, mut lses) = (
        Vec::with_capacity(p.rows.len()),
        Vec::with_capacity(p.rows.len()),
    );
    for (k, idx) in p.rows.chunks(p.chunk).enumerate() {
        let r = idx.len();
        let mut xc = Vec::with_capacity(r * c);
        for &i in idx {
            xc.extend_from_slice(&x[i * c..(i + 1) * c]);
        }
        let xop = operand(&xc);
        let buf = &mut buf[..r * v];
        logits(&wts, buf, r, c, (&xop, xs));
        for part in rows_loss::<T>(p, &wts.blocks, buf, idx, k * p.chunk, round, grads) {
            for (e, l) in part {
                nll_sum += e.f64();
                nll.push(e.f64());
                lses.push(l.f64());
            }
        }
        if !grads {
            continue;
        }
        let mut dxc = vec![zero; if p.need[0] { r * c } else { 0 }];
        let dw_out = p.need[1].then_some((&mut dw, dw_started));
        grads_of_chunk::<T>(p, &wts, buf, r, (&xop, xs), &mut dxc, dw_out);
        if p.need[1] && !dw_started {
            // SAFETY: every block of the v x c buffer was written above.
            unsafe { dw.set_len(v * c) };
            dw_started = true;
        }
        if let Some(dx) = dx.as_mut() {
            for (j, &i) in idx.iter().enumerate() {
                for (o, e) in dx[i * c..(i + 1) * c]
                    .iter_mut()
                    .zip(&dxc[j * c..(j + 1) * c])
                {
                    *o = T::from_acc(*e);
                }
            }
        }
    }
    let dw = p.need[1].then(|| {
        if !dw_started {
            dw = vec![zero; v * c];
        }
        narrow(dw)
    });
    Output {
        nll_sum,
        nll,
        lse: lses,
        dx,
        dw,
    }
}

/// GEMM 1: the chunk's logits `L_b = xc W_bᵀ` into `buf`, block after block (`r` rows of
/// `xc [r, c]`).
fn logits<A: Real>(
    w: &Weights<'_, A>,
    buf: &mut [A],
    r: usize,
    c: usize,
    xc: (&Operand<'_, A>, Strided),
) {
    for &(b0, wb) in &w.blocks {
        let l = &mut buf[r * b0..r * (b0 + wb)];
        // SAFETY: `l` holds r x wb initialised elements, exclusively borrowed; the operands
        // cover r x c (xc) and c x wb (Wᵀ from column b0, inside the checked [v, c] view).
        unsafe {
            gemm_raw(
                r,
                wb,
                c,
                l.as_mut_ptr(),
                false,
                xc,
                (&from(&w.op, b0 * w.ws.rs), w.wt),
                w.threads,
            )
        };
    }
}

/// Each row's `(nll, lse)` of the chunk's logits in `buf` (rows in parallel, in pieces, in row
/// order), turning the logits into their gradient `G` in place when `grads` (rounded to `T`
/// when `round`). `idx`: the chunk's flat rows, `first`: its first counted row.
fn rows_loss<T: Elem>(
    p: &Pass<'_>,
    bl: &[(usize, usize)],
    buf: &mut [T::Acc],
    idx: &[usize],
    first: usize,
    round: bool,
    grads: bool,
) -> Vec<Vec<(T::Acc, T::Acc)>>
where
    T::Acc: FastMath,
{
    let (r, zero) = (idx.len(), T::Acc::ZERO);
    let bp = Shared(buf.as_mut_ptr());
    let row = |j: usize| -> (T::Acc, T::Acc) {
        // SAFETY: row j's segments (one per block) are disjoint from every other row's,
        // and row j is handled by one piece only.
        let seg = |&(b0, wb): &(usize, usize)| unsafe {
            std::slice::from_raw_parts_mut(bp.at(r * b0 + j * wb), wb)
        };
        if round {
            for e in bl.iter().flat_map(seg) {
                *e = T::from_acc(*e).acc();
            }
        }
        let lse = match p.lse {
            Some(l) => T::Acc::c(l[first + j]),
            None => {
                let m = bl
                    .iter()
                    .fold(T::Acc::NEG_INFINITY, |m, b| max_skip_nan(seg(b), m));
                let mut sum = zero;
                for b in bl {
                    sum += cpu::sum_map(seg(b), |e: T::Acc| (e - m).exp_fast());
                }
                m + sum.ln()
            }
        };
        let t = p.targets[idx[j]] as usize;
        let tb = seg(&bl[t / VB]);
        let lt = tb[t % VB];
        if grads {
            let s: T::Acc = p.coef(idx[j]);
            for b in bl {
                for e in seg(b) {
                    *e = s * (*e - lse).exp_fast();
                }
            }
            seg(&bl[t / VB])[t % VB] = s * ((lt - lse).exp_fast() - T::Acc::ONE);
            if round {
                for e in bl.iter().flat_map(seg) {
                    *e = T::from_acc(*e).acc();
                }
            }
        }
        (lse - lt, lse)
    };
    cpu::map_chunks(r, 4 * p.v, |rows| rows.map(row).collect::<Vec<_>>())
}

/// GEMMs 2 and 3 of a chunk from its gradient `G` in `buf`: `dxc += G_b W_b` (when `dx` is
/// asked for) and, with `dw = Some((dW, started))`, `dW_b (+)= G_bᵀ xc` (written by the first
/// chunk, `started = false`, added to by the next ones).
fn grads_of_chunk<T: Elem>(
    p: &Pass<'_>,
    w: &Weights<'_, T::Acc>,
    buf: &[T::Acc],
    r: usize,
    xc: (&Operand<'_, T::Acc>, Strided),
    dxc: &mut [T::Acc],
    mut dw: Option<(&mut Vec<T::Acc>, bool)>,
) {
    let c = p.c;
    let bf16_kernel = matches!(operand::<T>(&[]), Operand::Bf16(_));
    for &(b0, wb) in &w.blocks {
        let g = &buf[r * b0..r * (b0 + wb)];
        // G_b as a GEMM operand (already rounded for 16-bit): a bf16 copy for the bf16
        // kernel, else read in place.
        let g16: Vec<T>;
        let gop = if bf16_kernel {
            g16 = g.iter().map(|&e| T::from_acc(e)).collect();
            operand(&g16)
        } else {
            Operand::Acc(Cow::Borrowed(g))
        };
        if p.need[0] {
            // dxc += G_b W_b: (i, k) = Σ_j G_b[i, j] w[b0 + j, k].
            // SAFETY: `dxc` holds r x c initialised elements, exclusively borrowed.
            unsafe {
                gemm_raw(
                    r,
                    c,
                    wb,
                    dxc.as_mut_ptr(),
                    true,
                    (&gop, Strided { rs: wb, cs: 1 }),
                    (&from(&w.op, b0 * w.ws.rs), w.ws),
                    w.threads,
                )
            };
        }
        if let Some((dw, started)) = dw.as_mut() {
            // dW_b (+)= G_bᵀ xc: (j, k) = Σ_i G_b[i, j] xc[i, k]; chunks added in order.
            // SAFETY: rows b0 .. b0 + wb of the v x c buffer (its capacity), written in
            // full by the first chunk (acc = false) before any read.
            unsafe {
                gemm_raw(
                    wb,
                    c,
                    r,
                    dw.as_mut_ptr().add(b0 * c),
                    *started,
                    (&gop, Strided { rs: 1, cs: wb }),
                    xc,
                    w.threads,
                )
            };
        }
    }
}
