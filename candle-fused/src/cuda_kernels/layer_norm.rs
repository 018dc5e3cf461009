//! LayerNorm (`triton/layer_norm.py`): forward (saves `mean` and `rstd`), backward `dx` with
//! `dW` (and `dB`) partial sums over fixed blocks of rows, and the ordered reduction of the
//! partial sums.
//!
//! The bias is optional: the kernels that touch it come in two entries, `layer_norm_fwd` /
//! `layer_norm_bwd_dx` (with `B` / `DB_PARTIAL`) and `layer_norm_fwd_no_bias` /
//! `layer_norm_bwd_dx_no_bias` (without). `layer_norm_bwd_reduce` sums one `[P, C]` partial
//! buffer into a `[C]` gradient: launched once for `dW`, and once more for `dB` with a bias.

use super::{KernelSpec, Rule};

/// The row tiling is RMSNorm's (`triton/layer_norm.py` and `triton/rms_norm.py` use the same
/// block sizes; the launch audit checks each against its own source): the largest row a
/// program holds (`BLOCK_C` of the forward and `dx` kernels) and the rows per program of the
/// `dx` kernels (`ROWS_PER_PROGRAM`: `DW_PARTIAL` and `DB_PARTIAL` have
/// `cdiv(N, ROWS_PER_PROGRAM)` rows).
#[cfg_attr(not(all(feature = "cuda", test)), allow(unused_imports))] // as in `mod.rs`
pub use super::rms_norm::{BLOCK_C, ROWS_PER_PROGRAM};
use super::rms_norm::{DX_RULES, ROW_TILE};

/// Columns per program of `layer_norm_bwd_reduce` (its `BLOCK_C`).
pub const REDUCE_BLOCK_C: usize = 256;

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("layer_norm_fwd", ROW_TILE),
    ("layer_norm_fwd_no_bias", ROW_TILE),
    ("layer_norm_bwd_dx", DX_RULES),
    ("layer_norm_bwd_dx_no_bias", DX_RULES),
    ("layer_norm_bwd_reduce", &[]),
];

/// LayerNorm forward (with and without bias), backward `dx` (+ `dW`, `dB` partial sums; with
/// and without bias) and the ordered reduction of the partial sums, for f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::LAYER_NORM;
