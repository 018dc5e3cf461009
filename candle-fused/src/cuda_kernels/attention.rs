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

use super::Elem::{Io, F32, I32};
use super::{Extent, KernelSpec, Param, Rule};
use candle_core::DType;

/// The head dimension a tile covers (`BLOCK_D`): `D <= BLOCK_D`.
pub const BLOCK_D: usize = 128;
/// Query rows / keys per program for f32 (`BLOCK_M = BLOCK_N`).
pub const BLOCK_F32: usize = 32;
/// Query rows / keys per program for bf16 and f16 (`BLOCK_M = BLOCK_N`).
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

const fn attn(dtype: DType, block: usize, sh: Shared) -> [KernelSpec; 4] {
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
    let over_q = [
        Extent::cdiv(&["T"], block),
        Extent::of(&["B", "H"]),
        Extent::ONE,
    ];
    let over_k = [
        Extent::cdiv(&["T"], block),
        Extent::of(&["B", "KV"]),
        Extent::ONE,
    ];
    let delta_grid = [
        Extent::cdiv(&["T"], DELTA_BLOCK_M),
        Extent::of(&["B", "H"]),
        Extent::ONE,
    ];
    [
        spec("attn_fwd", dtype, 4, sh.fwd, over_q, RULES, FWD),
        spec(
            "attn_bwd_delta",
            dtype,
            4,
            [256, 256],
            delta_grid,
            DELTA_RULES,
            DELTA,
        ),
        spec("attn_bwd_dkdv", dtype, 8, sh.dkdv, over_k, RULES, DKDV),
        spec("attn_bwd_dq", dtype, 8, sh.dq, over_q, RULES, DQ),
    ]
}

const F: [KernelSpec; 4] = attn(
    DType::F32,
    BLOCK_F32,
    Shared {
        fwd: [49152, 49152],
        dkdv: [73728, 73728],
        dq: [65536, 65536],
    },
);
const B: [KernelSpec; 4] = attn(
    DType::BF16,
    BLOCK_16,
    Shared {
        fwd: [41216, 49408],
        dkdv: [74496, 82688],
        dq: [65792, 53504],
    },
);
const H: [KernelSpec; 4] = attn(
    DType::F16,
    BLOCK_16,
    Shared {
        fwd: [41216, 49408],
        dkdv: [74496, 82688],
        dq: [65792, 53504],
    },
);

/// Attention forward, backward delta, dK/dV and dQ, for f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[
    F[0], F[1], F[2], F[3], B[0], B[1], B[2], B[3], H[0], H[1], H[2], H[3],
];
