//! Flash attention (`triton/attention.py`): forward (saves the log-sum-exp), the backward's
//! `D = rowsum(dO * O)`, `dK`/`dV` (one program per key block of a kv head, looping over the
//! query heads of its group in order: no atomics) and `dQ`.
//!
//! Layouts: `Q`, `O`, `dO`, `dQ` `[B, H, T, D]`; `K`, `V`, `dK`, `dV` `[B, KV, T, D]` (grouped
//! query heads: `KV` divides `H`, K and V are not repeated), each with its own strides along
//! B, heads and T (`Param::Stride`: `sqb`, `sqh`, `sqt`, ...; D has stride 1), so the
//! launcher passes GPT-2's packed `[B, T, 3C]` projection, a transposed `[B, T, KV, D]` view
//! or merged `[B, T, H * D]` rows in place and the gradients are written into such layouts;
//! `DOC` `[B, T]` i32 document ids (zeros when there are none); `LSE`, `DELTA` `[B, H, T]`
//! f32, contiguous. `D <= 128`.
//!
//! Builds ([`builds`], tried in order by [`super::check_variants`]): for bf16 and f16, head-size
//! builds whose tile is exactly 64 or 128 columns, compiled with `D` and every stride a
//! multiple of 16 (their rules [`Rule::MultipleOf`]: rows then load as 16-byte vectors, no
//! register spills) and with
//! dropout compiled in (`attn_fwd_d64`) or out (`attn_fwd_d64_nodrop`); then the generic
//! build (`attn_fwd`: any `D <= 128` in a 128-column tile, 2-byte loads, dropout decided at
//! run time), the only one for f32. Head size 256 (Gemma 3) has no build: a D = 256 bf16
//! build measured without a GPU spilled 24-528 bytes per thread with 64 x 64 tiles and 16 with
//! 32 x 32 (`candle-fused/triton/README.md`), so the op takes the composite path there (it
//! sends `D > BLOCK_D` to it).
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
/// Query rows / keys per program for bf16 and f16 in the generic build (`BLOCK_M = BLOCK_N`).
pub const BLOCK_16: usize = 64;
/// Rows per program of `attn_bwd_delta`.
pub const DELTA_BLOCK_M: usize = 64;

const TILED: &[Rule] = &[Rule::AtMost("D", BLOCK_D), Rule::Divides("KV", "H")];

// The head-size builds (bf16 and f16; `triton/attention.py`'s `_variants` and `VARIANT_TILES`):
// a tile of exactly 64 or 128 columns, D and every row stride declared a multiple of 16 (its
// rows load as 16-byte vectors), dropout compiled in or out, tiles and warps chosen for no
// register spills.
macro_rules! sized {
    ($d:literal, $($tensor:literal),*) => {
        &[
            Rule::AtMost("D", $d),
            Rule::MultipleOf("D", 16),
            Rule::Divides("KV", "H"),
            $(
                Rule::MultipleOf(concat!("s", $tensor, "b"), 16),
                Rule::MultipleOf(concat!("s", $tensor, "h"), 16),
                Rule::MultipleOf(concat!("s", $tensor, "t"), 16),
            )*
        ]
    };
}
const D64_FWD: &[Rule] = sized!(64, "q", "k", "v", "o");
const D64_DKDV: &[Rule] = sized!(64, "q", "k", "v", "do", "dk", "dv");
const D64_DQ: &[Rule] = sized!(64, "q", "k", "v", "do", "dq");
const D128_FWD: &[Rule] = sized!(128, "q", "k", "v", "o");
const D128_DKDV: &[Rule] = sized!(128, "q", "k", "v", "do", "dk", "dv");
const D128_DQ: &[Rule] = sized!(128, "q", "k", "v", "do", "dq");
/// The delta kernel's rules at head size `$d`: O's and dO's strides multiples of 16.
macro_rules! delta {
    ($d:literal) => {
        &[
            Rule::AtMost("D", $d),
            Rule::MultipleOf("D", 16),
            Rule::MultipleOf("sob", 16),
            Rule::MultipleOf("soh", 16),
            Rule::MultipleOf("sot", 16),
            Rule::MultipleOf("sdob", 16),
            Rule::MultipleOf("sdoh", 16),
            Rule::MultipleOf("sdot", 16),
        ]
    };
}
const D64_DELTA_RULES: &[Rule] = delta!(64);
const D128_DELTA_RULES: &[Rule] = delta!(128);

const GENERIC: [&str; 3] = ["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"];
const D64: [&str; 3] = ["attn_fwd_d64", "attn_bwd_dkdv_d64", "attn_bwd_dq_d64"];
const D64_NODROP: [&str; 3] = [
    "attn_fwd_d64_nodrop",
    "attn_bwd_dkdv_d64_nodrop",
    "attn_bwd_dq_d64_nodrop",
];
const D128: [&str; 3] = ["attn_fwd_d128", "attn_bwd_dkdv_d128", "attn_bwd_dq_d128"];
const D128_NODROP: [&str; 3] = [
    "attn_fwd_d128_nodrop",
    "attn_bwd_dkdv_d128_nodrop",
    "attn_bwd_dq_d128_nodrop",
];

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("attn_fwd", TILED),
    ("attn_bwd_delta", &[Rule::AtMost("D", BLOCK_D)]),
    ("attn_bwd_dkdv", TILED),
    ("attn_bwd_dq", TILED),
    ("attn_bwd_delta_d64", D64_DELTA_RULES),
    ("attn_bwd_delta_d128", D128_DELTA_RULES),
    ("attn_fwd_d64", D64_FWD),
    ("attn_bwd_dkdv_d64", D64_DKDV),
    ("attn_bwd_dq_d64", D64_DQ),
    ("attn_fwd_d64_nodrop", D64_FWD),
    ("attn_bwd_dkdv_d64_nodrop", D64_DKDV),
    ("attn_bwd_dq_d64_nodrop", D64_DQ),
    ("attn_fwd_d128", D128_FWD),
    ("attn_bwd_dkdv_d128", D128_DKDV),
    ("attn_bwd_dq_d128", D128_DQ),
    ("attn_fwd_d128_nodrop", D128_FWD),
    ("attn_bwd_dkdv_d128_nodrop", D128_DKDV),
    ("attn_bwd_dq_d128_nodrop", D128_DQ),
];

/// Attention forward, backward delta, dK/dV and dQ: the generic build for f32, bf16 and f16,
/// the head-size builds for bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::ATTENTION;

/// The builds of each attention kernel, in the order a launcher tries them
/// ([`super::check_variants`]): the head-size builds for D up to 64, then up to 128 (D a
/// multiple of 16; bf16 and f16), then the generic one (any D <= 128, every dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Builds {
    /// `attn_fwd` and its head-size builds.
    pub fwd: [&'static str; 3],
    /// `attn_bwd_delta` and its head-size builds (no dropout in it).
    pub delta: [&'static str; 3],
    /// `attn_bwd_dkdv` and its head-size builds.
    pub dkdv: [&'static str; 3],
    /// `attn_bwd_dq` and its head-size builds.
    pub dq: [&'static str; 3],
}

/// The builds to try for a launch with dropout (`p > 0`) or without; the head-size builds
/// without dropout compile it out (the generic build decides at run time).
pub fn builds(dropout: bool) -> Builds {
    let (d64, d128) = if dropout {
        (D64, D128)
    } else {
        (D64_NODROP, D128_NODROP)
    };
    let at = |i: usize| [d64[i], d128[i], GENERIC[i]];
    Builds {
        fwd: at(0),
        delta: [
            "attn_bwd_delta_d64",
            "attn_bwd_delta_d128",
            "attn_bwd_delta",
        ],
        dkdv: at(1),
        dq: at(2),
    }
}
