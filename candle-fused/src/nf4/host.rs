//! [`Nf4Weight`]'s values dequantized on the host straight into the compute type, the pieces
//! on the [`pool`]'s threads.
//!
//! Each value is `NF4_VALUES[code] * absmax` in f32, rounded to the quant state's dtype and
//! then converted to the compute type `T`, as Candle's `to_dtype(state).to_dtype(T)` rounds
//! it (one rounding when the state is f32 or `T`): per 4-bit block the 16 possible values are
//! computed once and the codes look them up, so every value is the same function of its code
//! and absmax on any number of threads.

use candle_core::{bail, CpuStorage, DType, Result, Storage};
use half::{bf16, f16};

use super::{Nf4Weight, NF4_VALUES};
use crate::cpu::{Elem, Real};
use crate::pool;

/// Values a piece of parallel work dequantizes at least (smaller ranges run on one thread).
const PIECE: usize = 1 << 15;

/// A value in f32 rounded to `dtype` and widened back (exact in f32 for the 16-bit types).
fn state_rounding(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::BF16 => |v| bf16::from_f32(v).to_f32(),
        DType::F16 => |v| f16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

/// `v` (exact in f32) in `T`.
#[inline(always)]
fn from_f32<T: Elem>(v: f32) -> T {
    T::from_acc(<T::Acc as Real>::c(v as f64))
}

impl Nf4Weight {
    /// Values `start..start + out.len()` (flat, row-major) dequantized into `out` on the host
    /// (see the [module docs](self)); `absmax` is [`Nf4Weight::absmax_f32`]'s, on the host.
    pub(crate) fn dequantize_into<T: Elem>(
        &self,
        absmax: &[f32],
        start: usize,
        out: &mut [T],
    ) -> Result<()> {
        let (n, bs) = (self.elem_count(), self.blocksize);
        let end = start + out.len();
        if end > n || absmax.len() < n.div_ceil(bs) {
            bail!("nf4: range {start}..{end} out of the weight's {n} values and absmaxes");
        }
        let (s, l) = self.packed.storage_and_layout();
        let packed = match (&*s, l.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::U8(v)), Some((a, b))) => &v[a..b],
            _ => bail!("nf4: the packed codes must be contiguous u8 on the host"),
        };
        let round = state_rounding(self.dtype);
        // pieces of whole pairs of values, one per thread at least PIECE long
        let chunk = out
            .len()
            .div_ceil(pool::parts())
            .max(PIECE)
            .next_multiple_of(2);
        pool::map_chunks_mut(out, chunk, |i, piece| {
            let lo = start + i * chunk;
            fill_piece(packed, absmax, bs, round, lo, piece);
        });
        Ok(())
    }
}

/// Values `lo..lo + out.len()` into `out`, a block at a time.
fn fill_piece<T: Elem>(
    packed: &[u8],
    absmax: &[f32],
    bs: usize,
    round: fn(f32) -> f32,
    lo: usize,
    out: &mut [T],
) {
    let hi = lo + out.len();
    let mut i = lo;
    while i < hi {
        let block = i / bs;
        let stop = ((block + 1) * bs).min(hi);
        let a = absmax[block];
        let table: [T; 16] = std::array::from_fn(|c| from_f32(round(NF4_VALUES[c] * a)));
        let dst = &mut out[i - lo..stop - lo];
        let mut k = 0;
        if i % 2 == 1 {
            dst[0] = table[(packed[i / 2] & 0x0f) as usize];
            k = 1;
        }
        let pairs = (dst.len() - k) / 2;
        let bytes = &packed[(i + k) / 2..(i + k) / 2 + pairs];
        for (o, &b) in dst[k..k + 2 * pairs].chunks_exact_mut(2).zip(bytes) {
            o[0] = table[(b >> 4) as usize];
            o[1] = table[(b & 0x0f) as usize];
        }
        if k + 2 * pairs < dst.len() {
            dst[k + 2 * pairs] = table[(packed[(stop - 1) / 2] >> 4) as usize];
        }
        i = stop;
    }
}
