//! The CPU kernels of AdamW: a moment pass (in place, f32, parallel chunks) and the sum of
//! squares over fixed blocks in f64.

use crate::cpu::{self, Elem, Real};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result};

/// Elements per chunk of the parallel loops.
pub(super) const CHUNK: usize = 4096;

/// The per-element constants, rounded to f32 exactly as Candle's `affine` rounds them.
#[derive(Clone, Copy)]
pub(super) struct Coeffs {
    pub(super) gs: f32,
    pub(super) b1: f32,
    pub(super) one_m_b1: f32,
    pub(super) b2: f32,
    pub(super) one_m_b2: f32,
    pub(super) decay: f32,
    pub(super) step_size: f32,
    pub(super) inv_bc2: f32,
    pub(super) eps: f32,
}

/// The f32 elements of an in-place destination.
pub(super) fn dst_f32<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    let (a, b) = match l.contiguous_offsets() {
        Some(o) => o,
        None => candle_core::bail!("candle-fused adamw: destination must be contiguous"),
    };
    match s {
        CpuStorage::F32(v) => Ok(&mut v[a..b]),
        other => candle_core::bail!("candle-fused adamw: expected f32, got {:?}", other.dtype()),
    }
}

#[inline(always)]
fn to_f32<T: Elem>(x: T) -> f32 {
    // Exact for f32/bf16/f16 (the f64 round trip folds away); rounds f64 like `to_dtype`.
    x.acc().f64() as f32
}

/// One moment pass over `dst` in place, in parallel chunks: `m = b1 m + (1-b1) g'`, or
/// `v = b2 v + (1-b2) g'^2` when `second` (`g' = gs g`).
pub(super) fn moment<T: Elem>(dst: &mut [f32], g: &[T], c: &Coeffs, second: bool) {
    let (b, omb, gs) = if second {
        (c.b2, c.one_m_b2, c.gs)
    } else {
        (c.b1, c.one_m_b1, c.gs)
    };
    cpu::for_rows(dst, CHUNK, CHUNK, |i, d| {
        let g = &g[i * CHUNK..i * CHUNK + d.len()];
        if second {
            for (v, g) in d.iter_mut().zip(g) {
                let g = to_f32(*g) * gs;
                *v = *v * b + (g * g) * omb;
            }
        } else {
            for (m, g) in d.iter_mut().zip(g) {
                *m = *m * b + (to_f32(*g) * gs) * omb;
            }
        }
    });
}

/// Deterministic reduction block: partial sums per fixed block, summed in block order.
const BLOCK: usize = 8192;

fn block_sumsq<T: Elem>(x: &[T]) -> f64 {
    let mut acc = [0f64; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            let v = c[l].acc().f64();
            acc[l] += v * v;
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for v in it.remainder() {
        let v = v.acc().f64();
        s += v * v;
    }
    s
}

pub(super) fn sumsq<T: Elem>(x: &[T]) -> f64 {
    let blocks = x.len().div_ceil(BLOCK);
    let parts = cpu::map_chunks(blocks, BLOCK, |r| {
        r.map(|b| block_sumsq(&x[b * BLOCK..((b + 1) * BLOCK).min(x.len())]))
            .collect::<Vec<f64>>()
    });
    // Fixed blocks combined in order: the same sum for any thread count.
    parts.iter().flatten().sum()
}
