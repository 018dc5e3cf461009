//! RMSNorm (`triton/rms_norm.py`): forward (saves `rstd`), backward `dx` with `dW` partial
//! sums over fixed blocks of rows, and the ordered `dW` reduction.

use super::Elem::{Io, F32};
use super::{Extent, KernelSpec, Param, Rule};
use candle_core::DType;

/// The largest row a program holds (`BLOCK_C` of the forward and `dx` kernels).
pub const BLOCK_C: usize = 4096;
/// Rows per program of `rms_norm_bwd_dx` (`ROWS_PER_PROGRAM`): `DW_PARTIAL` has
/// `cdiv(N, ROWS_PER_PROGRAM)` rows.
pub const ROWS_PER_PROGRAM: usize = 32;
/// Columns per program of `rms_norm_bwd_dw` (its `BLOCK_C`).
pub const DW_BLOCK_C: usize = 256;

const FWD: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("W", &["C"], Io),
    Param::Tensor("Y", &["N", "C"], Io),
    Param::Tensor("RSTD", &["N"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
    Param::Float("eps"),
];
const BWD_DX: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("W", &["C"], Io),
    Param::Tensor("DY", &["N", "C"], Io),
    Param::Tensor("RSTD", &["N"], F32),
    Param::Tensor("DX", &["N", "C"], Io),
    Param::Tensor("DW_PARTIAL", &["P", "C"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
];
const BWD_DW: &[Param] = &[
    Param::Tensor("DW_PARTIAL", &["P", "C"], F32),
    Param::Tensor("DW", &["C"], Io),
    Param::Dim("P", "P"),
    Param::Dim("C", "C"),
];

const ROW_TILE: &[Rule] = &[Rule::AtMost("C", BLOCK_C)];
const DX_RULES: &[Rule] = &[
    Rule::AtMost("C", BLOCK_C),
    Rule::Cdiv("P", &["N"], ROWS_PER_PROGRAM),
];

const fn rms(dtype: DType, shared_io: u32) -> [KernelSpec; 3] {
    [
        KernelSpec {
            family: "rms_norm",
            entry: "rms_norm_fwd",
            dtype,
            num_warps: 8,
            shared_bytes: [shared_io; 2],
            grid: [Extent::of(&["N"]), Extent::ONE, Extent::ONE],
            rules: ROW_TILE,
            params: FWD,
        },
        KernelSpec {
            family: "rms_norm",
            entry: "rms_norm_bwd_dx",
            dtype,
            num_warps: 8,
            shared_bytes: [shared_io; 2],
            grid: [
                Extent::cdiv(&["N"], ROWS_PER_PROGRAM),
                Extent::ONE,
                Extent::ONE,
            ],
            rules: DX_RULES,
            params: BWD_DX,
        },
        KernelSpec {
            family: "rms_norm",
            entry: "rms_norm_bwd_dw",
            dtype,
            num_warps: 2,
            shared_bytes: [0; 2],
            grid: [Extent::cdiv(&["C"], DW_BLOCK_C), Extent::ONE, Extent::ONE],
            rules: &[],
            params: BWD_DW,
        },
    ]
}

const F: [KernelSpec; 3] = rms(DType::F32, 4096);
const B: [KernelSpec; 3] = rms(DType::BF16, 8192);
const H: [KernelSpec; 3] = rms(DType::F16, 8192);

/// RMSNorm forward, backward `dx` (+ `dW` partial sums) and the ordered `dW` reduction, for
/// f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[F[0], F[1], F[2], B[0], B[1], B[2], H[0], H[1], H[2]];
