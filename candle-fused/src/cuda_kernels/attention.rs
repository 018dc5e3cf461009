//! Flash attention (`triton/attention.py`): forward (saves the log-sum-exp), the backward's
//! `D = rowsum(dO * O)`, `dK`/`dV` (one program per key block of a kv head, looping over the
//! query heads of its group in order: no atomics) and `dQ`.
//!
//! Layouts: `Q`, `O`, `dO`, `dQ` `[B, H, T, D]`; `K`, `V`, `dK`, `dV` `[B, KV, T, D]` (grouped
//! query heads: `KV` divides `H`, K and V are not repeated); `DOC` `[B, T]` i32 document ids
//! (zeros when there are none); `LSE`, `DELTA` `[B, H, T]` f32. `D <= 128`.
//!
//! The scalars, in order (a [`Scalar`](super::Scalar) each): `scale` (f32), `causal` (i32,
//! 0 / 1), `window` (i32, 0 = none, else >= 1), `p_drop` (f32 in `[0, 1)`), `keep` (f32, `1 /
//! (1 - p_drop)` computed in f64 and rounded, as the CPU kernel does), then the dropout key as
//! i32 bit patterns: `seed` lo, hi, `site` lo, hi, `offset` lo, hi (`RngKey`'s fields). The
//! delta kernel takes none. The CPU op's additive mask is not supported (unused by the
//! trainer).

use super::{KernelSpec, Rule};

/// The head dimension a tile covers (`BLOCK_D`): `D <= BLOCK_D`.
pub const BLOCK_D: usize = 128;
/// Query rows / keys per program for f32 (`BLOCK_M = BLOCK_N`).
pub const BLOCK_F32: usize = 32;
/// Query rows / keys per program for bf16 and f16 (`BLOCK_M = BLOCK_N`).
pub const BLOCK_16: usize = 64;
/// Rows per program of `attn_bwd_delta`.
pub const DELTA_BLOCK_M: usize = 64;

const TILED: &[Rule] = &[Rule::AtMost("D", BLOCK_D), Rule::Divides("KV", "H")];

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("attn_fwd", TILED),
    ("attn_bwd_delta", &[Rule::AtMost("D", BLOCK_D)]),
    ("attn_bwd_dkdv", TILED),
    ("attn_bwd_dq", TILED),
];

/// Attention forward, backward delta, dK/dV and dQ, for f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = super::compiled::ATTENTION;
