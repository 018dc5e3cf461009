//! Tanh GELU (`triton/gelu.py`), GPT-2's, with and without a bias: the elementwise forward and
//! backward over the flattened tensor (`[E]`), the bias forward over `[N, C]`, the bias
//! backward `dx` with `db` partial sums over fixed blocks of 16 rows, and the ordered `db`
//! reduction. `y` and `dx` are bit-identical to the CPU kernel (`crate::gelu`), whose
//! `exp_f32` / `tanh_f32` the kernels reproduce; so is `db` up to 4096 rows.

use super::Elem::{Io, F32};
use super::{Extent, KernelSpec, Param, Rule};
use candle_core::DType;

/// Elements per program of the kernels without a bias (`BLOCK`).
pub const BLOCK: usize = 1024;
/// Rows per program of `bias_gelu_fwd` (`BLOCK_R`).
pub const FWD_BLOCK_R: usize = 8;
/// Columns per program of `bias_gelu_fwd` and `bias_gelu_bwd_dx` (`BLOCK_C`).
pub const BLOCK_C: usize = 256;
/// Rows per program of `bias_gelu_bwd_dx` (`ROWS_PER_PROGRAM`): `DB_PARTIAL` has
/// `cdiv(N, ROWS_PER_PROGRAM)` rows.
pub const ROWS_PER_PROGRAM: usize = 16;
/// Columns per program of `bias_gelu_bwd_db` (its `BLOCK_C`).
pub const DB_BLOCK_C: usize = 256;

const FWD: &[Param] = &[
    Param::Tensor("X", &["E"], Io),
    Param::Tensor("Y", &["E"], Io),
    Param::Dim("E", "E"),
];
const BWD: &[Param] = &[
    Param::Tensor("X", &["E"], Io),
    Param::Tensor("DY", &["E"], Io),
    Param::Tensor("DX", &["E"], Io),
    Param::Dim("E", "E"),
];
const BIAS_FWD: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("B", &["C"], Io),
    Param::Tensor("Y", &["N", "C"], Io),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
];
const BIAS_BWD_DX: &[Param] = &[
    Param::Tensor("X", &["N", "C"], Io),
    Param::Tensor("B", &["C"], Io),
    Param::Tensor("DY", &["N", "C"], Io),
    Param::Tensor("DX", &["N", "C"], Io),
    Param::Tensor("DB_PARTIAL", &["P", "C"], F32),
    Param::Dim("N", "N"),
    Param::Dim("C", "C"),
];
const BIAS_BWD_DB: &[Param] = &[
    Param::Tensor("DB_PARTIAL", &["P", "C"], F32),
    Param::Tensor("DB", &["C"], Io),
    Param::Dim("P", "P"),
    Param::Dim("C", "C"),
];

const FLAT: [Extent; 3] = [Extent::cdiv(&["E"], BLOCK), Extent::ONE, Extent::ONE];
const DX_RULES: &[Rule] = &[Rule::Cdiv("P", &["N"], ROWS_PER_PROGRAM)];

const fn spec(
    entry: &'static str,
    dtype: DType,
    num_warps: u32,
    shared_bytes: u32,
    grid: [Extent; 3],
    rules: &'static [Rule],
    params: &'static [Param],
) -> KernelSpec {
    KernelSpec {
        family: "gelu",
        entry,
        dtype,
        num_warps,
        shared_bytes: [shared_bytes; 2],
        grid,
        rules,
        params,
    }
}

const fn gelu(dtype: DType, fwd_shared: u32) -> [KernelSpec; 5] {
    [
        spec("gelu_fwd", dtype, 4, 0, FLAT, &[], FWD),
        spec("gelu_bwd", dtype, 4, 0, FLAT, &[], BWD),
        spec(
            "bias_gelu_fwd",
            dtype,
            4,
            fwd_shared,
            [
                Extent::cdiv(&["N"], FWD_BLOCK_R),
                Extent::cdiv(&["C"], BLOCK_C),
                Extent::ONE,
            ],
            &[],
            BIAS_FWD,
        ),
        spec(
            "bias_gelu_bwd_dx",
            dtype,
            2,
            1024,
            [
                Extent::cdiv(&["N"], ROWS_PER_PROGRAM),
                Extent::cdiv(&["C"], BLOCK_C),
                Extent::ONE,
            ],
            DX_RULES,
            BIAS_BWD_DX,
        ),
        spec(
            "bias_gelu_bwd_db",
            dtype,
            2,
            0,
            [Extent::cdiv(&["C"], DB_BLOCK_C), Extent::ONE, Extent::ONE],
            &[],
            BIAS_BWD_DB,
        ),
    ]
}

const F: [KernelSpec; 5] = gelu(DType::F32, 1024);
const B: [KernelSpec; 5] = gelu(DType::BF16, 512);
const H: [KernelSpec; 5] = gelu(DType::F16, 512);

/// GELU without a bias (forward, backward) and with one (forward, backward `dx` + `db`
/// partial sums, ordered `db` reduction), for f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[
    F[0], F[1], F[2], F[3], F[4], B[0], B[1], B[2], B[3], B[4], H[0], H[1], H[2], H[3], H[4],
];
