//! Token-embedding backward (`triton/embedding.py`): `embedding_bwd`, one program per (table
//! row, column block) adding the row's segment of `dy` in f32 in the host's order (ascending
//! position) and writing the row once (zeros for absent ids: no memset, one launch).
//! Bit-identical to the CPU kernel (`crate::embedding`).

use super::{KernelSpec, Rule};

/// Columns per program (`BLOCK_C`).
pub const BLOCK_C: usize = 256;

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[("embedding_bwd", &[])];

/// The embedding backward for f32, bf16 and f16 tables.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::EMBEDDING;
