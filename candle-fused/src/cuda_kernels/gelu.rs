//! Tanh GELU (`triton/gelu.py`), GPT-2's, with and without a bias: the elementwise forward and
//! backward over the flattened tensor (`[E]`), the bias forward over `[N, C]`, the bias
//! backward `dx` with `db` partial sums over fixed blocks of 16 rows, and the ordered `db`
//! reduction; GeGLU (`gelu(gate) * up`, `crate::geglu`) forward and backward over the flattened
//! tensors. `y` and `dx` (and GeGLU's outputs) are bit-identical to the CPU kernels
//! (`crate::gelu`, `crate::gated`), whose `exp_f32` / `tanh_f32` the kernels reproduce; so is
//! `db` up to 4096 rows.

use super::{KernelSpec, Rule};

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

const DX_RULES: &[Rule] = &[Rule::Cdiv("P", &["N"], ROWS_PER_PROGRAM)];

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("gelu_fwd", &[]),
    ("gelu_bwd", &[]),
    ("bias_gelu_fwd", &[]),
    ("bias_gelu_bwd_dx", DX_RULES),
    ("bias_gelu_bwd_db", &[]),
    ("geglu_fwd", &[]),
    ("geglu_bwd", &[]),
];

/// GELU without a bias (forward, backward) and with one (forward, backward `dx` + `db`
/// partial sums, ordered `db` reduction), and GeGLU (forward, backward), for f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::GELU;
