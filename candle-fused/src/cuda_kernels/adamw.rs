//! AdamW (`triton/adamw.py`): the fused in-place update of `param`, `exp_avg`, `exp_avg_sq`
//! (f32) from a gradient of the variant's dtype, in one pass, bit-identical to the CPU kernel
//! (`crate::adamw::adamw_update`); and the sum of squares of a gradient (`sumsq_partial`: f64
//! partial sums over fixed blocks, `sumsq_total`: their ordered sum, rounded to f32), as
//! `crate::adamw::sum_of_squares`. [`scalars`] gives the update's f32 constants.

use super::Elem::{Io, F32, F64};
use super::{Extent, KernelSpec, Param, Rule, Scalar};
use crate::adamw::AdamWStep;
use candle_core::{DType, Result};

/// Elements per program of `adamw_update` (`BLOCK`).
pub const BLOCK: usize = 1024;
/// Elements per program of `sumsq_partial` (its `BLOCK`): `PARTIAL` has `cdiv(E, SUMSQ_BLOCK)`
/// elements.
pub const SUMSQ_BLOCK: usize = 1024;

const UPDATE: &[Param] = &[
    Param::Tensor("PARAM", &["E"], F32),
    Param::Tensor("GRAD", &["E"], Io),
    Param::Tensor("EXP_AVG", &["E"], F32),
    Param::Tensor("EXP_AVG_SQ", &["E"], F32),
    Param::Dim("E", "E"),
    Param::Float("grad_scale"),
    Param::Float("beta1"),
    Param::Float("one_minus_beta1"),
    Param::Float("beta2"),
    Param::Float("one_minus_beta2"),
    Param::Float("decay"),
    Param::Float("step_size"),
    Param::Float("inv_bc2"),
    Param::Float("eps"),
];
const PARTIAL: &[Param] = &[
    Param::Tensor("X", &["E"], Io),
    Param::Tensor("PARTIAL", &["P"], F64),
    Param::Dim("E", "E"),
];
const TOTAL: &[Param] = &[
    Param::Tensor("PARTIAL", &["P"], F64),
    Param::Tensor("OUT", &["ONE"], F32),
    Param::Dim("P", "P"),
];

const PARTIAL_RULES: &[Rule] = &[Rule::Cdiv("P", &["E"], SUMSQ_BLOCK)];
const ONE_ELEMENT: &[Rule] = &[Rule::Cdiv("ONE", &[], 1)];

const fn update(dtype: DType, shared_bytes: u32) -> KernelSpec {
    KernelSpec {
        family: "adamw",
        entry: "adamw_update",
        dtype,
        num_warps: 4,
        shared_bytes: [shared_bytes; 2],
        grid: [Extent::cdiv(&["E"], BLOCK), Extent::ONE, Extent::ONE],
        rules: &[],
        params: UPDATE,
    }
}

const fn partial(dtype: DType) -> KernelSpec {
    KernelSpec {
        family: "adamw",
        entry: "sumsq_partial",
        dtype,
        num_warps: 4,
        shared_bytes: [32; 2],
        grid: [Extent::cdiv(&["E"], SUMSQ_BLOCK), Extent::ONE, Extent::ONE],
        rules: PARTIAL_RULES,
        params: PARTIAL,
    }
}

/// The AdamW update for f32, bf16 and f16 gradients, the sum-of-squares partial sums for the
/// same, and their total (one f32 variant: it reads only f64 partials).
pub const KERNELS: &[KernelSpec] = &[
    update(DType::F32, 0),
    update(DType::BF16, 4096),
    update(DType::F16, 4096),
    partial(DType::F32),
    partial(DType::BF16),
    partial(DType::F16),
    KernelSpec {
        family: "adamw",
        entry: "sumsq_total",
        dtype: DType::F32,
        num_warps: 4,
        shared_bytes: [32; 2],
        grid: [Extent::ONE, Extent::ONE, Extent::ONE],
        rules: ONE_ELEMENT,
        params: TOTAL,
    },
];

/// The nine f32 scalars of `adamw_update` for `step`, in order (grad scale, b1, 1 - b1, b2,
/// 1 - b2, `1 - lr wd`, `lr / bc1`, `1 / bc2`, eps): each rounded from f64 exactly as the
/// CPU kernel rounds it, so the update is bit-identical. Errors on the hyper-parameters the
/// CPU step rejects (step 0, betas outside `[0, 1)`, negative lr / eps / weight decay).
///
/// ```
/// use candle_fused::adamw::AdamWStep;
/// use candle_fused::cuda_kernels::{adamw::scalars, Scalar};
/// let s = scalars(&AdamWStep { step: 1, ..Default::default() })?;
/// assert_eq!(s[0], Scalar::F32(1.0)); // grad scale
/// assert_eq!(s[6], Scalar::F32((1e-3 / (1.0 - 0.9f64)) as f32)); // lr / bc1
/// assert!(scalars(&AdamWStep { step: 0, ..Default::default() }).is_err());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn scalars(step: &AdamWStep) -> Result<[Scalar; 9]> {
    Ok(step.kernel_scalars()?.map(Scalar::F32))
}
