//! Flash attention (`triton/attention.py`): forward (saves the log-sum-exp), the backward's
//! `D = rowsum(dO * O)`, `dK`/`dV` (one program per key block of a kv head, looping over the
//! query heads of its group in order: no atomics) and `dQ`.
//!
//! Layouts: `Q`, `O`, `dO`, `dQ` `[B, H, T, D]`; `K`, `V`, `dK`, `dV` `[B, KV, T, D]` (grouped
//! query heads: `KV` divides `H`, K and V are not repeated); `DOC` `[B, T]` i32 document ids
//! (zeros when there are none); `LSE`, `DELTA` `[B, H, T]` f32. `D <= 128`.
//!
//! Builds ([`builds`], tried in order by [`super::check_variants`]): for bf16 and f16, head-size
//! builds whose tile is exactly 64 or 128 columns, compiled with `D` a multiple of 16 (their
//! rule [`Rule::MultipleOf`]: rows then load as 16-byte vectors, no register spills) and with
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

use super::Elem::{Io, F32, I32};
use super::{Extent, KernelSpec, Param, Rule};
use candle_core::DType;

/// The head dimension a tile covers (`BLOCK_D`): `D <= BLOCK_D`.
pub const BLOCK_D: usize = 128;
/// Query rows / keys per program for f32 (`BLOCK_M = BLOCK_N`).
pub const BLOCK_F32: usize = 32;
/// Query rows / keys per program for bf16 and f16 in the generic build (`BLOCK_M = BLOCK_N`).
pub const BLOCK_16: usize = 64;
/// Rows per program of `attn_bwd_delta`.
pub const DELTA_BLOCK_M: usize = 64;

const QO: &[&str] = &["B", "H", "T", "D"];
const KV: &[&str] = &["B", "KV", "T", "D"];
const STAT: &[&str] = &["B", "H", "T"];

/// The trailing dimensions and scalars of the tiled kernels.
macro_rules! dims_and_cfg {
    ($($tensors:expr),* $(,)?) => {
        &[
            $($tensors,)*
            Param::Dim("H", "H"),
            Param::Dim("KV", "KV"),
            Param::Dim("T", "T"),
            Param::Dim("D", "D"),
            Param::Float("scale"),
            Param::Int("causal"),
            Param::Int("window"),
            Param::Float("p_drop"),
            Param::Float("keep"),
            Param::Int("seed_lo"),
            Param::Int("seed_hi"),
            Param::Int("site_lo"),
            Param::Int("site_hi"),
            Param::Int("off_lo"),
            Param::Int("off_hi"),
        ]
    };
}

const FWD: &[Param] = dims_and_cfg![
    Param::Tensor("Q", QO, Io),
    Param::Tensor("K", KV, Io),
    Param::Tensor("V", KV, Io),
    Param::Tensor("DOC", &["B", "T"], I32),
    Param::Tensor("O", QO, Io),
    Param::Tensor("LSE", STAT, F32),
];
const DKDV: &[Param] = dims_and_cfg![
    Param::Tensor("Q", QO, Io),
    Param::Tensor("K", KV, Io),
    Param::Tensor("V", KV, Io),
    Param::Tensor("DOC", &["B", "T"], I32),
    Param::Tensor("DO", QO, Io),
    Param::Tensor("LSE", STAT, F32),
    Param::Tensor("DELTA", STAT, F32),
    Param::Tensor("DK", KV, Io),
    Param::Tensor("DV", KV, Io),
];
const DQ: &[Param] = dims_and_cfg![
    Param::Tensor("Q", QO, Io),
    Param::Tensor("K", KV, Io),
    Param::Tensor("V", KV, Io),
    Param::Tensor("DOC", &["B", "T"], I32),
    Param::Tensor("DO", QO, Io),
    Param::Tensor("LSE", STAT, F32),
    Param::Tensor("DELTA", STAT, F32),
    Param::Tensor("DQ", QO, Io),
];
const DELTA: &[Param] = &[
    Param::Tensor("O", QO, Io),
    Param::Tensor("DO", QO, Io),
    Param::Tensor("DELTA", STAT, F32),
    Param::Dim("T", "T"),
    Param::Dim("D", "D"),
];

const RULES: &[Rule] = &[Rule::AtMost("D", BLOCK_D), Rule::Divides("KV", "H")];
const DELTA_RULES: &[Rule] = &[Rule::AtMost("D", BLOCK_D)];

/// Shared memory per arch (sm_80, sm_90) of the forward, dK/dV and dQ kernels.
struct Shared {
    fwd: [u32; 2],
    dkdv: [u32; 2],
    dq: [u32; 2],
}

/// One build's tiles: query rows per forward / dQ program, keys per dK/dV program, and the
/// warps of the forward, dK/dV and dQ kernels.
struct Tiles {
    fwd_m: usize,
    dkdv_n: usize,
    dq_m: usize,
    warps: [u32; 3],
}

const fn spec(
    entry: &'static str,
    dtype: DType,
    num_warps: u32,
    shared_bytes: [u32; 2],
    grid: [Extent; 3],
    rules: &'static [Rule],
    params: &'static [Param],
) -> KernelSpec {
    KernelSpec {
        family: "attention",
        entry,
        dtype,
        num_warps,
        shared_bytes,
        grid,
        rules,
        params,
    }
}

/// `attn_bwd_delta` under `entry` (`rules`: its tile's).
const fn delta(entry: &'static str, dtype: DType, rules: &'static [Rule]) -> KernelSpec {
    let grid = [
        Extent::cdiv(&["T"], DELTA_BLOCK_M),
        Extent::of(&["B", "H"]),
        Extent::ONE,
    ];
    spec(entry, dtype, 4, [256, 256], grid, rules, DELTA)
}

/// The forward, dK/dV and dQ kernels of one build: `entries` in that order.
const fn tiled(
    entries: [&'static str; 3],
    dtype: DType,
    t: Tiles,
    rules: &'static [Rule],
    sh: Shared,
) -> [KernelSpec; 3] {
    const fn over(rows: usize, heads: &'static [&'static str]) -> [Extent; 3] {
        [Extent::cdiv(&["T"], rows), Extent::of(heads), Extent::ONE]
    }
    let (q, kv): (&[&str], &[&str]) = (&["B", "H"], &["B", "KV"]);
    [
        spec(
            entries[0],
            dtype,
            t.warps[0],
            sh.fwd,
            over(t.fwd_m, q),
            rules,
            FWD,
        ),
        spec(
            entries[1],
            dtype,
            t.warps[1],
            sh.dkdv,
            over(t.dkdv_n, kv),
            rules,
            DKDV,
        ),
        spec(
            entries[2],
            dtype,
            t.warps[2],
            sh.dq,
            over(t.dq_m, q),
            rules,
            DQ,
        ),
    ]
}

/// The generic build's tiles: `block` rows and keys, 4 warps forward, 8 backward.
const fn generic(block: usize) -> Tiles {
    Tiles {
        fwd_m: block,
        dkdv_n: block,
        dq_m: block,
        warps: [4, 8, 8],
    }
}

const GENERIC: [&str; 3] = ["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"];

const F: [KernelSpec; 3] = tiled(
    GENERIC,
    DType::F32,
    generic(BLOCK_F32),
    RULES,
    Shared {
        fwd: [49152, 49152],
        dkdv: [73728, 73728],
        dq: [65536, 65536],
    },
);
const B: [KernelSpec; 3] = tiled(
    GENERIC,
    DType::BF16,
    generic(BLOCK_16),
    RULES,
    Shared {
        fwd: [41216, 49408],
        dkdv: [74496, 82688],
        dq: [65792, 53504],
    },
);
const H: [KernelSpec; 3] = tiled(
    GENERIC,
    DType::F16,
    generic(BLOCK_16),
    RULES,
    Shared {
        fwd: [41216, 49408],
        dkdv: [74496, 82688],
        dq: [65792, 53504],
    },
);

// The head-size builds (bf16 and f16; `triton/attention.py`'s `_variants` and `VARIANT_TILES`):
// a tile of exactly 64 or 128 columns, D declared a multiple of 16 (its rows load as 16-byte
// vectors), dropout compiled in or out, tiles and warps chosen for no register spills. Keep
// them together: one `tiled` per (D, dropout, dtype), one `delta` per (D, dtype).

const D64_RULES: &[Rule] = &[
    Rule::AtMost("D", 64),
    Rule::MultipleOf("D", 16),
    Rule::Divides("KV", "H"),
];
const D128_RULES: &[Rule] = &[
    Rule::AtMost("D", 128),
    Rule::MultipleOf("D", 16),
    Rule::Divides("KV", "H"),
];
const D64_DELTA_RULES: &[Rule] = &[Rule::AtMost("D", 64), Rule::MultipleOf("D", 16)];
const D128_DELTA_RULES: &[Rule] = &[Rule::AtMost("D", 128), Rule::MultipleOf("D", 16)];

/// D = 64: 64-row programs, 32-key dK/dV programs (their inner query blocks: 64 rows with
/// dropout, 32 without), 8 warps throughout.
const TILES_64: Tiles = Tiles {
    fwd_m: 64,
    dkdv_n: 32,
    dq_m: 64,
    warps: [8, 8, 8],
};
/// D = 128: 64-row and 64-key programs (dK/dV loops over 32-row query blocks), 8 warps.
const TILES_128: Tiles = Tiles {
    fwd_m: 64,
    dkdv_n: 64,
    dq_m: 64,
    warps: [8, 8, 8],
};

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

const B64: [KernelSpec; 3] = tiled(
    D64,
    DType::BF16,
    TILES_64,
    D64_RULES,
    Shared {
        fwd: [28928, 45312],
        dkdv: [33536, 33536],
        dq: [41216, 57600],
    },
);
const H64: [KernelSpec; 3] = tiled(
    D64,
    DType::F16,
    TILES_64,
    D64_RULES,
    Shared {
        fwd: [28928, 45312],
        dkdv: [33536, 33536],
        dq: [41216, 57600],
    },
);
const B64_NODROP: [KernelSpec; 3] = tiled(
    D64_NODROP,
    DType::BF16,
    TILES_64,
    D64_RULES,
    Shared {
        fwd: [24832, 41216],
        dkdv: [18816, 18816],
        dq: [33024, 49408],
    },
);
const H64_NODROP: [KernelSpec; 3] = tiled(
    D64_NODROP,
    DType::F16,
    TILES_64,
    D64_RULES,
    Shared {
        fwd: [24832, 41216],
        dkdv: [18816, 18816],
        dq: [33024, 49408],
    },
);
const B128: [KernelSpec; 3] = tiled(
    D128,
    DType::BF16,
    TILES_128,
    D128_RULES,
    Shared {
        fwd: [57600, 86272],
        dkdv: [53632, 53632],
        dq: [73984, 106752],
    },
);
const H128: [KernelSpec; 3] = tiled(
    D128,
    DType::F16,
    TILES_128,
    D128_RULES,
    Shared {
        fwd: [57600, 86272],
        dkdv: [53632, 53632],
        dq: [73984, 106752],
    },
);
const B128_NODROP: [KernelSpec; 3] = tiled(
    D128_NODROP,
    DType::BF16,
    TILES_128,
    D128_RULES,
    Shared {
        fwd: [57600, 82176],
        dkdv: [53632, 53632],
        dq: [73984, 98560],
    },
);
const H128_NODROP: [KernelSpec; 3] = tiled(
    D128_NODROP,
    DType::F16,
    TILES_128,
    D128_RULES,
    Shared {
        fwd: [57600, 82176],
        dkdv: [53632, 53632],
        dq: [73984, 98560],
    },
);

/// Attention forward, backward delta, dK/dV and dQ: the generic build for f32, bf16 and f16,
/// the head-size builds for bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[
    delta("attn_bwd_delta", DType::F32, DELTA_RULES),
    F[0],
    F[1],
    F[2],
    delta("attn_bwd_delta", DType::BF16, DELTA_RULES),
    B[0],
    B[1],
    B[2],
    delta("attn_bwd_delta", DType::F16, DELTA_RULES),
    H[0],
    H[1],
    H[2],
    delta("attn_bwd_delta_d64", DType::BF16, D64_DELTA_RULES),
    delta("attn_bwd_delta_d64", DType::F16, D64_DELTA_RULES),
    delta("attn_bwd_delta_d128", DType::BF16, D128_DELTA_RULES),
    delta("attn_bwd_delta_d128", DType::F16, D128_DELTA_RULES),
    B64[0],
    B64[1],
    B64[2],
    H64[0],
    H64[1],
    H64[2],
    B64_NODROP[0],
    B64_NODROP[1],
    B64_NODROP[2],
    H64_NODROP[0],
    H64_NODROP[1],
    H64_NODROP[2],
    B128[0],
    B128[1],
    B128[2],
    H128[0],
    H128[1],
    H128[2],
    B128_NODROP[0],
    B128_NODROP[1],
    B128_NODROP[2],
    H128_NODROP[0],
    H128_NODROP[1],
    H128_NODROP[2],
];

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
///
/// ```
/// use candle_fused::cuda_kernels::attention::builds;
/// assert_eq!(builds(false).fwd, ["attn_fwd_d64_nodrop", "attn_fwd_d128_nodrop", "attn_fwd"]);
/// assert_eq!(builds(true).dq, ["attn_bwd_dq_d64", "attn_bwd_dq_d128", "attn_bwd_dq"]);
/// ```
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
