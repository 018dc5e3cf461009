//! RMSNorm (`triton/rms_norm.py`): forward (saves `rstd`), backward `dx` with `dW` partial
//! sums over fixed blocks of rows, and the ordered `dW` reduction.

use super::{KernelSpec, Rule};

/// The largest row a program holds (`BLOCK_C` of the forward and `dx` kernels).
pub const BLOCK_C: usize = 4096;
/// Rows per program of `rms_norm_bwd_dx` (`ROWS_PER_PROGRAM`): `DW_PARTIAL` has
/// `cdiv(N, ROWS_PER_PROGRAM)` rows.
pub const ROWS_PER_PROGRAM: usize = 32;
/// Columns per program of `rms_norm_bwd_dw` (its `BLOCK_C`).
pub const DW_BLOCK_C: usize = 256;

/// The rules of the one-row-per-program kernels (also LayerNorm's).
pub(super) const ROW_TILE: &[Rule] = &[Rule::AtMost("C", BLOCK_C)];
/// The rules of the `dx` kernels that also write partial sums (also LayerNorm's).
pub(super) const DX_RULES: &[Rule] = &[
    Rule::AtMost("C", BLOCK_C),
    Rule::Cdiv("P", &["N"], ROWS_PER_PROGRAM),
];

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("rms_norm_fwd", ROW_TILE),
    ("rms_norm_bwd_dx", DX_RULES),
    ("rms_norm_bwd_dw", &[]),
];

/// RMSNorm forward, backward `dx` (+ `dW` partial sums) and the ordered `dW` reduction, for
/// f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::RMS_NORM;
