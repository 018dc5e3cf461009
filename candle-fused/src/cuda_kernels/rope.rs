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

use super::{KernelSpec, Rule};

/// Pairs `(i, i + D/2)` per block of a program's loop (`BLOCK`).
pub const BLOCK: usize = 512;

const HALVES: &[Rule] = &[Rule::Product("D", &["HALF"], 2), Rule::Divides("TB", "B")];

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[("rope_fwd", HALVES), ("rope_bwd", HALVES)];

/// RoPE forward and backward, for f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::ROPE;
