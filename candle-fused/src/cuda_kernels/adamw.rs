//! AdamW (`triton/adamw.py`): the fused in-place update of `param`, `exp_avg`, `exp_avg_sq`
//! (f32) from a gradient of the variant's dtype, in one pass, bit-identical to the CPU kernel
//! (`crate::adamw::adamw_update`); and the sum of squares of a gradient (`sumsq_partial`: f64
//! partial sums over fixed blocks, `sumsq_total`: their ordered sum, rounded to f32), as
//! `crate::adamw::sum_of_squares`. [`scalars`] gives the update's f32 constants.

use super::{KernelSpec, Rule, Scalar};
use crate::adamw::AdamWStep;
use candle_core::Result;

/// Elements per program of `adamw_update` (`BLOCK`).
pub const BLOCK: usize = 1024;
/// Elements per program of `sumsq_partial` (its `BLOCK`): `PARTIAL` has `cdiv(E, SUMSQ_BLOCK)`
/// elements.
pub const SUMSQ_BLOCK: usize = 1024;

// `OUT` holds one element (its dimension is written `1` in the metadata)
const ONE_ELEMENT: &[Rule] = &[Rule::Cdiv("1", &[], 1)];

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("adamw_update", &[]),
    ("sumsq_partial", &[Rule::Cdiv("P", &["E"], SUMSQ_BLOCK)]),
    ("sumsq_total", ONE_ELEMENT),
    ("adamw_update_multi", TABLE_ROWS_OF_8),
    ("sumsq_partial_multi", TABLE_ROWS_OF_4),
    ("sumsq_total_multi", ONE_ELEMENT),
];

// the multi-tensor kernels' tables: `[T, W]` i64, one row of `W` columns per tensor
const TABLE_ROWS_OF_8: &[Rule] = &[Rule::Product("W", &[], 8)];
const TABLE_ROWS_OF_4: &[Rule] = &[Rule::Product("W", &[], 4)];

/// The AdamW update for f32, bf16 and f16 gradients, the sum-of-squares partial sums for the
/// same, and their total (one f32 variant: it reads only f64 partials).
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::ADAMW;

/// The nine f32 scalars of `adamw_update` for `step`, in order (grad scale, b1, 1 - b1, b2,
/// 1 - b2, `1 - lr wd`, `lr / bc1`, `1 / bc2`, eps): each rounded from f64 exactly as the
/// CPU kernel rounds it, so the update is bit-identical. Errors on the hyper-parameters the
/// CPU step rejects (step 0, betas outside `[0, 1)`, negative lr / eps / weight decay).
pub fn scalars(step: &AdamWStep) -> Result<[Scalar; 9]> {
    Ok(step.kernel_scalars()?.map(Scalar::F32))
}
