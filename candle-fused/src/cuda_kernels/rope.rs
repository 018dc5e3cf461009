//! RoPE (`triton/rope.py`): transformers' split-halves rotation fused with the
//! `[B, T, H, D] -> [B, H, T, D]` transpose (forward), and the rotation by `-angle` with the
//! inverse transpose (backward).
//!
//! One program per position `(b, t)`, grid `(B*T, 1, 1)`; it covers the `H * D/2` pairs of the
//! position in blocks of [`BLOCK`] with a mask, so `H` and `D` are free: `D` need only be even
//! ([`Rule::Product`]`("D", ["HALF"], 2)`, the CPU op's requirement), not a power of two, and
//! there is no tile limit. The f32 tables are `[TB, T, D/2]`: `TB = B` for the CPU op's
//! per-row `[B, T, D/2]` tables, `TB = 1` for tables shared by the batch (the CPU op's
//! `[T, D/2]` or `[1, T, D/2]`: describe them as `[1, T, D/2]`); batch row `b` reads table
//! `b % TB`, so the table checks `TB` divides `B` ([`Rule::Divides`]). All tensors are
//! contiguous: a strided `x` (a view of a packed projection, which the CPU op reads in
//! place) is made contiguous by the launcher first.

use super::Elem::{Io, F32};
use super::{Extent, KernelSpec, Param, Rule};
use candle_core::DType;

/// Pairs `(i, i + D/2)` per block of a program's loop (`BLOCK`).
pub const BLOCK: usize = 512;

const FWD: &[Param] = &[
    Param::Tensor("X", &["B", "T", "H", "D"], Io),
    Param::Tensor("COS", &["TB", "T", "HALF"], F32),
    Param::Tensor("SIN", &["TB", "T", "HALF"], F32),
    Param::Tensor("Y", &["B", "H", "T", "D"], Io),
    Param::Dim("T", "T"),
    Param::Dim("H", "H"),
    Param::Dim("HALF", "HALF"),
    Param::Dim("TB", "TB"),
];
const BWD: &[Param] = &[
    Param::Tensor("DY", &["B", "H", "T", "D"], Io),
    Param::Tensor("COS", &["TB", "T", "HALF"], F32),
    Param::Tensor("SIN", &["TB", "T", "HALF"], F32),
    Param::Tensor("DX", &["B", "T", "H", "D"], Io),
    Param::Dim("T", "T"),
    Param::Dim("H", "H"),
    Param::Dim("HALF", "HALF"),
    Param::Dim("TB", "TB"),
];

const RULES: &[Rule] = &[Rule::Product("D", &["HALF"], 2), Rule::Divides("TB", "B")];

const fn rope(dtype: DType) -> [KernelSpec; 2] {
    let grid = [Extent::of(&["B", "T"]), Extent::ONE, Extent::ONE];
    [
        KernelSpec {
            family: "rope",
            entry: "rope_fwd",
            dtype,
            num_warps: 4,
            shared_bytes: [0; 2],
            grid,
            rules: RULES,
            params: FWD,
        },
        KernelSpec {
            family: "rope",
            entry: "rope_bwd",
            dtype,
            num_warps: 4,
            shared_bytes: [0; 2],
            grid,
            rules: RULES,
            params: BWD,
        },
    ]
}

const F: [KernelSpec; 2] = rope(DType::F32);
const B: [KernelSpec; 2] = rope(DType::BF16);
const H: [KernelSpec; 2] = rope(DType::F16);

/// RoPE forward and backward, for f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[F[0], F[1], B[0], B[1], H[0], H[1]];
