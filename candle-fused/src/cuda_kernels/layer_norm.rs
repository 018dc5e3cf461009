//! LayerNorm (`triton/layer_norm.py`): forward (saves `mean` and `rstd`), backward `dx` with
//! `dW` (and `dB`) partial sums over fixed blocks of rows, and the ordered reduction of the
//! partial sums.
//!
//! The bias is optional: the kernels that touch it come in two entries, `layer_norm_fwd` /
//! `layer_norm_bwd_dx` (with `B` / `DB_PARTIAL`) and `layer_norm_fwd_no_bias` /
//! `layer_norm_bwd_dx_no_bias` (without). `layer_norm_bwd_reduce` sums one `[P, C]` partial
//! buffer into a `[C]` gradient: launched once for `dW`, and once more for `dB` with a bias.

use super::Elem::{Io, F32};
use super::{Extent, KernelSpec, Param, Rule};
use candle_core::DType;

/// The largest row a program holds (`BLOCK_C` of the forward and `dx` kernels).
pub const BLOCK_C: usize = 4096;
/// Rows per program of the `dx` kernels (`ROWS_PER_PROGRAM`): `DW_PARTIAL` and `DB_PARTIAL`
/// have `cdiv(N, ROWS_PER_PROGRAM)` rows.
pub const ROWS_PER_PROGRAM: usize = 32;
/// Columns per program of `layer_norm_bwd_reduce` (its `BLOCK_C`).
pub const REDUCE_BLOCK_C: usize = 256;

const FWD: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("W", &["C"], Io),
    Param::Tensor("B", &["C"], Io),
    Param::Tensor("Y", &["N", "C"], Io),
    Param::Tensor("MEAN", &["N"], F32),
    Param::Tensor("RSTD", &["N"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
    Param::Float("eps"),
];
const FWD_NO_BIAS: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("W", &["C"], Io),
    Param::Tensor("Y", &["N", "C"], Io),
    Param::Tensor("MEAN", &["N"], F32),
    Param::Tensor("RSTD", &["N"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
    Param::Float("eps"),
];
const BWD_DX: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("W", &["C"], Io),
    Param::Tensor("DY", &["N", "C"], Io),
    Param::Tensor("MEAN", &["N"], F32),
    Param::Tensor("RSTD", &["N"], F32),
    Param::Tensor("DX", &["N", "C"], Io),
    Param::Tensor("DW_PARTIAL", &["P", "C"], F32),
    Param::Tensor("DB_PARTIAL", &["P", "C"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
];
const BWD_DX_NO_BIAS: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("W", &["C"], Io),
    Param::Tensor("DY", &["N", "C"], Io),
    Param::Tensor("MEAN", &["N"], F32),
    Param::Tensor("RSTD", &["N"], F32),
    Param::Tensor("DX", &["N", "C"], Io),
    Param::Tensor("DW_PARTIAL", &["P", "C"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
];
const REDUCE: &[Param] = &[
    Param::Tensor("PARTIAL", &["P", "C"], F32),
    Param::Tensor("OUT", &["C"], Io),
    Param::Dim("P", "P"),
    Param::Dim("C", "C"),
];

const ROW_TILE: &[Rule] = &[Rule::AtMost("C", BLOCK_C)];
const DX_RULES: &[Rule] = &[
    Rule::AtMost("C", BLOCK_C),
    Rule::Cdiv("P", &["N"], ROWS_PER_PROGRAM),
];
const ROWS: [Extent; 3] = [Extent::of(&["N"]), Extent::ONE, Extent::ONE];
const ROW_BLOCKS: [Extent; 3] = [
    Extent::cdiv(&["N"], ROWS_PER_PROGRAM),
    Extent::ONE,
    Extent::ONE,
];

/// A row kernel (forward or `dx`): 8 warps, `shared` bytes for its row reductions.
const fn row_kernel(
    entry: &'static str,
    dtype: DType,
    shared: u32,
    grid: [Extent; 3],
    rules: &'static [Rule],
    params: &'static [Param],
) -> KernelSpec {
    KernelSpec {
        family: "layer_norm",
        entry,
        dtype,
        num_warps: 8,
        shared_bytes: [shared; 2],
        grid,
        rules,
        params,
    }
}

/// The five kernels for `dtype`; `shared` is the row kernels' shared memory (from the
/// metadata: 4096 bytes for f32, 8192 for 16-bit).
const fn ln(dtype: DType, shared: u32) -> [KernelSpec; 5] {
    let (fwd, dx) = ("layer_norm_fwd", "layer_norm_bwd_dx");
    let (fwd_nb, dx_nb) = ("layer_norm_fwd_no_bias", "layer_norm_bwd_dx_no_bias");
    [
        row_kernel(fwd, dtype, shared, ROWS, ROW_TILE, FWD),
        row_kernel(fwd_nb, dtype, shared, ROWS, ROW_TILE, FWD_NO_BIAS),
        row_kernel(dx, dtype, shared, ROW_BLOCKS, DX_RULES, BWD_DX),
        row_kernel(dx_nb, dtype, shared, ROW_BLOCKS, DX_RULES, BWD_DX_NO_BIAS),
        KernelSpec {
            family: "layer_norm",
            entry: "layer_norm_bwd_reduce",
            dtype,
            num_warps: 2,
            shared_bytes: [0; 2],
            grid: [
                Extent::cdiv(&["C"], REDUCE_BLOCK_C),
                Extent::ONE,
                Extent::ONE,
            ],
            rules: &[],
            params: REDUCE,
        },
    ]
}

const F: [KernelSpec; 5] = ln(DType::F32, 4096);
const B: [KernelSpec; 5] = ln(DType::BF16, 8192);
const H: [KernelSpec; 5] = ln(DType::F16, 8192);

/// LayerNorm forward (with and without bias), backward `dx` (+ `dW`, `dB` partial sums; with
/// and without bias) and the ordered reduction of the partial sums, for f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[
    F[0], F[1], F[2], F[3], F[4], B[0], B[1], B[2], B[3], B[4], H[0], H[1], H[2], H[3], H[4],
];
