//! Inverted dropout (`triton/dropout.py`): `y = x * mask` with the mask drawn inside the kernel
//! from Philox4x32-10, bit-identical to the CPU kernel (`crate::dropout`: the same counter
//! layout, uniforms and keep scale). The backward launches the same kernel on `dy` with the
//! same key. [`scalars`] builds the kernel's scalar arguments from `p` and the [`RngKey`].

use super::{KernelSpec, Scalar};
use crate::cpu::Elem;
use crate::dropout::{check_p, keep_scale};
use crate::RngKey;
use candle_core::{bail, DType, Result};

/// Elements per program (`BLOCK`, a multiple of 4: one Philox block per 4 elements).
pub const BLOCK: usize = 1024;

/// The [`Rule`](super::Rule)s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[super::Rule])] = &[("dropout", &[])];

/// Dropout (forward on `x`, backward on `dy`), for f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::DROPOUT;

/// The two i32 words (low, high) of a u64: its bits, reinterpreted (the kernel takes them back
/// as u32 and joins them).
pub fn words(v: u64) -> [i32; 2] {
    [v as u32 as i32, (v >> 32) as u32 as i32]
}

/// The scalar arguments of `dropout` for a tensor of `dtype` (f32, bf16 or f16), in order:
/// the seed, site and offset of `key` as i32 words (see [`words`]), `p`, and the keep scale
/// `1 / (1 - p)` rounded to `dtype` as the CPU kernel rounds it (held in an f32). Errors unless
/// `p` is in `[0, 1)` (as [`crate::dropout::dropout`]; at `p == 0` the op skips the kernel).
pub fn scalars(p: f32, key: RngKey, dtype: DType) -> Result<[Scalar; 8]> {
    check_p(p)?;
    let scale = match dtype {
        DType::F32 => keep_scale::<f32>(p),
        DType::BF16 => keep_scale::<half::bf16>(p).acc(),
        DType::F16 => keep_scale::<half::f16>(p).acc(),
        other => bail!("dropout kernel: no variant for {other:?} (f32, bf16, f16)"),
    };
    let [seed_lo, seed_hi] = words(key.seed);
    let [site_lo, site_hi] = words(key.site);
    let [offset_lo, offset_hi] = words(key.offset);
    Ok([
        Scalar::I32(seed_lo),
        Scalar::I32(seed_hi),
        Scalar::I32(site_lo),
        Scalar::I32(site_hi),
        Scalar::I32(offset_lo),
        Scalar::I32(offset_hi),
        Scalar::F32(p),
        Scalar::F32(scale),
    ])
}
