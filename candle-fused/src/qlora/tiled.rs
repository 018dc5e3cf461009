//! [`super`]'s 4-bit product a tile of rows at a time: on the host by our GEMM over each
//! dequantized tile (forward and `dx`), and `dx` from Candle ops for other devices.

use candle_core::{DType, Result, Tensor};

use crate::cpu::{self, Elem, Real};
use crate::linear::gemm::{gemm_raw, operand, widen, Operand};
use crate::linear::Strided;
use crate::nf4::Nf4Weight;
use crate::op::acc_dtype;
use crate::pool;

/// The most weight values dequantized at a time (one tile of rows, 1 MiB in f32).
pub const TILE_ELEMS: usize = 1 << 18;

/// `(out, in)` of a weight checked 2-D.
fn out_in(w: &Nf4Weight) -> (usize, usize) {
    match w.shape() {
        [o, i] => (*o, *i),
        _ => (0, 0),
    }
}

/// Calls `f(first row, tile [rows, in] in dtype)` for each tile of `w`'s rows in order
/// (at most [`TILE_ELEMS`] values, at least one row).
pub(crate) fn tiles(
    w: &Nf4Weight,
    dtype: DType,
    mut f: impl FnMut(usize, Tensor) -> Result<()>,
) -> Result<()> {
    let (n_out, n_in) = out_in(w);
    let absmax = w.absmax_f32()?;
    let step = (TILE_ELEMS / n_in.max(1)).clamp(1, n_out.max(1));
    for r0 in (0..n_out).step_by(step) {
        let r1 = (r0 + step).min(n_out);
        let tile = w.dequantize_range(&absmax, r0 * n_in, r1 * n_in, dtype)?;
        f(r0, tile.reshape((r1 - r0, n_in))?)?;
    }
    Ok(())
}

/// [`tiles`] on the host: each tile's values in `T`.
fn host_tiles<T: Elem>(w: &Nf4Weight, mut f: impl FnMut(usize, &[T]) -> Result<()>) -> Result<()> {
    tiles(w, T::DTYPE, |r0, tile| {
        cpu::with_slice::<T, _>(&tile, |s| f(r0, s))
    })
}

/// `x Wᵀ (+ bias)` for `x [N, in]` on the host, in the accumulation type: one output buffer
/// (the bias rows, or zeros), each tile's product (our GEMM over the dequantized tile, `[N,
/// rows]` in one reused buffer) added into its columns.
pub(crate) fn fwd_acc_host<T: Elem>(
    x: &[T],
    w: &Nf4Weight,
    bias: Option<&[T]>,
) -> Result<Vec<T::Acc>> {
    let (n_out, n_in) = out_in(w);
    let rows = x.len().checked_div(n_in).unwrap_or(0);
    let mut y: Vec<T::Acc> = match bias {
        Some(b) => widen(b)
            .iter()
            .copied()
            .cycle()
            .take(rows * n_out)
            .collect(),
        None => vec![<T::Acc as Real>::ZERO; rows * n_out],
    };
    let xa = operand(x);
    let threads = pool::parts();
    let mut part: Vec<T::Acc> = Vec::new();
    host_tiles::<T>(w, |r0, tile| {
        let nt = tile.len() / n_in;
        let ta = operand(tile);
        part.clear();
        part.reserve(rows * nt);
        // SAFETY: `part` has capacity rows x nt, written in full by the GEMM (acc = false)
        // before its length is set.
        unsafe {
            gemm_raw(
                rows,
                nt,
                n_in,
                part.as_mut_ptr(),
                false,
                (&xa, Strided { rs: n_in, cs: 1 }),
                (&ta, Strided { rs: 1, cs: n_in }),
                threads,
            );
            part.set_len(rows * nt);
        }
        for (yr, pr) in y.chunks_exact_mut(n_out).zip(part.chunks_exact(nt)) {
            for (o, p) in yr[r0..r0 + nt].iter_mut().zip(pr) {
                *o += *p;
            }
        }
        Ok(())
    })?;
    Ok(y)
}

/// `dx += g W` for `g [N, out]` (row-major) on the host, `dx [N, in]` in the accumulation type,
/// summed over the tiles in order (our GEMM over each dequantized tile and its columns of `g`).
pub(crate) fn add_dx_host<T: Elem>(
    dx: &mut [T::Acc],
    g: &Operand<'_, T::Acc>,
    w: &Nf4Weight,
) -> Result<()> {
    let (n_out, n_in) = out_in(w);
    let rows = dx.len().checked_div(n_in).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    let threads = pool::parts();
    host_tiles::<T>(w, |r0, tile| {
        let nt = tile.len() / n_in;
        let (gt, ta) = (g.skip(r0), operand(tile));
        // SAFETY: `dx` holds rows x n_in initialised elements, exclusively borrowed.
        unsafe {
            gemm_raw(
                rows,
                n_in,
                nt,
                dx.as_mut_ptr(),
                true,
                (&gt, Strided { rs: n_out, cs: 1 }),
                (&ta, Strided { rs: n_in, cs: 1 }),
                threads,
            )
        };
        Ok(())
    })
}

/// `g W` for `g [N, out]` from Candle ops (devices without a kernel), in `g`'s dtype: summed
/// over the tiles in order in the accumulation type, rounded once.
pub(crate) fn dx_composite(w: &Nf4Weight, g: &Tensor) -> Result<Tensor> {
    let (n_out, n_in) = out_in(w);
    let dtype = g.dtype();
    let acc = acc_dtype(dtype);
    let g = g.reshape(((), n_out))?.to_dtype(acc)?;
    let mut dx: Option<Tensor> = None;
    tiles(w, dtype, |r0, tile| {
        let tile = tile.to_dtype(acc)?;
        let part = g.narrow(1, r0, tile.dim(0)?)?.contiguous()?.matmul(&tile)?;
        dx = Some(match dx.take() {
            Some(d) => (d + part)?,
            None => part,
        });
        Ok(())
    })?;
    match dx {
        Some(d) => d.to_dtype(dtype),
        None => Tensor::zeros((g.dim(0)?, n_in), dtype, g.device()),
    }
}
