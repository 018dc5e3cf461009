//! [`super`]'s 4-bit product a tile of rows at a time: on the host by our GEMM over each
//! dequantized tile (forward and `dx`), and `dx` from Candle ops for other devices.

use candle_core::{DType, Result, Tensor};

use crate::cpu::{Elem, Real};
use crate::linear::gemm::{gemm_raw, operand, widen, Operand, KC};
use crate::linear::Strided;
use crate::nf4::Nf4Weight;
use crate::op::acc_dtype;
use crate::pool;

/// The most weight values dequantized at a time: one tile of rows, 8 MiB in bf16 (16 MiB in
/// f32). Large enough that a tile is a large GEMM (at Llama-3.2-1B's shape a 2048-wide
/// projection's tile is 2048 rows), small beside the 4-bit weights of a model.
pub const TILE_ELEMS: usize = 1 << 22;

/// `(out, in)` of a weight checked 2-D.
fn out_in(w: &Nf4Weight) -> (usize, usize) {
    match w.shape() {
        [o, i] => (*o, *i),
        _ => (0, 0),
    }
}

/// Rows a tile of a `[n_out, n_in]` weight holds: as many as [`TILE_ELEMS`] allows (at least
/// one), whole multiples of the GEMM's [`KC`]-long sums where that many fit, so `dx`'s sum over
/// the tiles runs in the same chunks as one GEMM over the whole weight.
fn tile_rows(n_out: usize, n_in: usize) -> usize {
    let fit = (TILE_ELEMS / n_in.max(1)).max(1);
    let rows = if fit >= KC { fit / KC * KC } else { fit };
    rows.min(n_out.max(1))
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
    let step = tile_rows(n_out, n_in);
    for r0 in (0..n_out).step_by(step) {
        let r1 = (r0 + step).min(n_out);
        let tile = w.dequantize_range(&absmax, r0 * n_in, r1 * n_in, dtype)?;
        f(r0, tile.reshape((r1 - r0, n_in))?)?;
    }
    Ok(())
}

/// [`tiles`] on the host: each tile dequantized in `T` into one buffer reused for every tile.
fn host_tiles<T: Elem>(w: &Nf4Weight, mut f: impl FnMut(usize, &[T]) -> Result<()>) -> Result<()> {
    let (n_out, n_in) = out_in(w);
    let absmax = w.absmax_f32()?.to_vec1::<f32>()?;
    let step = tile_rows(n_out, n_in);
    let mut buf = vec![T::from_acc(<T::Acc as Real>::ZERO); step.min(n_out) * n_in];
    for r0 in (0..n_out).step_by(step) {
        let r1 = (r0 + step).min(n_out);
        let tile = &mut buf[..(r1 - r0) * n_in];
        w.dequantize_into(&absmax, r0 * n_in, tile)?;
        f(r0, tile)?;
    }
    Ok(())
}

/// `x Wᵀ (+ bias)` for `x [N, in]` on the host, in the accumulation type, as the dense
/// [`fwd_acc`](crate::linear::fwd_acc) computes it column for column: each tile's columns
/// start from the bias rows (or are written from nothing) and our GEMM over the dequantized
/// tile accumulates into them, in one reused `[N, rows]` buffer copied into the output (or
/// straight in the output when one tile holds every row).
pub(crate) fn fwd_acc_host<T: Elem>(
    x: &[T],
    w: &Nf4Weight,
    bias: Option<&[T]>,
) -> Result<Vec<T::Acc>> {
    let (n_out, n_in) = out_in(w);
    let rows = x.len().checked_div(n_in).unwrap_or(0);
    let bias = bias.map(widen);
    let xa = operand(x);
    let threads = pool::parts();
    // `part` [rows, nt] = (bias columns r0.. or nothing) + x W_tileᵀ
    let product = |part: &mut Vec<T::Acc>, r0: usize, tile: &[T]| {
        let nt = tile.len() / n_in;
        part.clear();
        if let Some(b) = &bias {
            for _ in 0..rows {
                part.extend_from_slice(&b[r0..r0 + nt]);
            }
        }
        part.reserve(rows * nt);
        let ta = operand(tile);
        // SAFETY: `part` has capacity rows x nt, initialised when the GEMM accumulates (a
        // bias) and else written in full by it (acc = false) before its length is set.
        unsafe {
            gemm_raw(
                rows,
                nt,
                n_in,
                part.as_mut_ptr(),
                bias.is_some(),
                (&xa, Strided { rs: n_in, cs: 1 }),
                (&ta, Strided { rs: 1, cs: n_in }),
                threads,
            );
            part.set_len(rows * nt);
        }
    };
    let mut y: Vec<T::Acc> = Vec::new();
    let mut part: Vec<T::Acc> = Vec::new();
    host_tiles::<T>(w, |r0, tile| {
        if tile.len() == n_out * n_in {
            product(&mut y, r0, tile);
            return Ok(());
        }
        product(&mut part, r0, tile);
        y.resize(rows * n_out, <T::Acc as Real>::ZERO);
        let nt = tile.len() / n_in;
        for (yr, pr) in y.chunks_exact_mut(n_out).zip(part.chunks_exact(nt)) {
            yr[r0..r0 + nt].copy_from_slice(pr);
        }
        Ok(())
    })?;
    y.resize(rows * n_out, <T::Acc as Real>::ZERO);
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
