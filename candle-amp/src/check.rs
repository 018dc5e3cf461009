//! The overflow check: one fused reduction and one host sync per step.
//!
//! For every parameter with a gradient, the gradient is upcast to f32 (a no-op for f32
//! gradients) and its sum of squares is taken; the per-parameter partial sums are stacked and
//! summed, and that single scalar is read back. A square is NaN or inf whenever the element
//! is, and NaN/inf propagate through sums, so the scalar is finite iff every gradient is
//! finite (unlike `abs().max_all()`, which can drop NaN). The same scalar is the squared
//! global norm of the *scaled* gradients, so clipping needs no second pass.
//!
//! Only when the scalar is not finite are the parameters scanned one by one (extra syncs
//! only on the failure path): NaN via `g.ne(g)`, inf via `abs() == inf`. If none is
//! actually non-finite, the f32 sum of squares merely overflowed (huge but finite
//! gradients); the norm is then recomputed with per-parameter rescaling and the step
//! proceeds.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::master::MasterWeights;

/// A parameter whose gradient held non-finite values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFinite {
    /// The registered name.
    pub name: String,
    /// The gradient held at least one NaN.
    pub has_nan: bool,
    /// The gradient held at least one infinity.
    pub has_inf: bool,
}

/// Result of checking one step's gradients.
#[derive(Debug, Clone)]
pub struct GradCheck {
    /// True if every gradient is finite.
    pub finite: bool,
    /// Squared global L2 norm of the unscaled gradients (meaningful when `finite`).
    pub sq_norm: f64,
    /// Parameters with non-finite gradients (empty when `finite`), registration order.
    pub nonfinite: Vec<NonFinite>,
    /// Number of parameters that had a gradient.
    pub with_grad: usize,
    /// (parameter index, f32 scaled gradient) for every parameter with a gradient.
    pub(crate) grads: Vec<(usize, Tensor)>,
}

pub(crate) fn check(weights: &MasterWeights, grads: &GradStore, scale: f64) -> Result<GradCheck> {
    let mut present = Vec::with_capacity(weights.len());
    let mut partials = Vec::with_capacity(weights.len());
    for i in 0..weights.len() {
        if let Some(g) = weights.grad(i, grads) {
            let g32 = g.to_dtype(DType::F32)?;
            partials.push(g32.sqr()?.sum_all()?);
            present.push((i, g32));
        }
    }
    let with_grad = present.len();
    if partials.is_empty() {
        return Ok(GradCheck {
            finite: true,
            sq_norm: 0.0,
            nonfinite: Vec::new(),
            with_grad,
            grads: present,
        });
    }
    // The single host sync of the happy path.
    let total = Tensor::stack(&partials, 0)?.sum_all()?.to_scalar::<f32>()?;
    drop(partials);
    let inv_sq = 1.0 / (scale * scale);
    if total.is_finite() {
        return Ok(GradCheck {
            finite: true,
            sq_norm: f64::from(total) * inv_sq,
            nonfinite: Vec::new(),
            with_grad,
            grads: present,
        });
    }
    // Failure path: find the culprits, or recompute an overflowed (finite) norm.
    let mut nonfinite = Vec::new();
    let mut sq_norm = 0.0f64;
    for (i, g) in &present {
        // Element-wise tests reduced over u8 flags: `abs().max_all()` would miss an infinity
        // whenever element 0 is NaN (Candle's max keeps a NaN only at element 0).
        let has_nan = g.ne(g)?.max_all()?.to_scalar::<u8>()? != 0;
        let has_inf = g.abs()?.eq(f32::INFINITY)?.max_all()?.to_scalar::<u8>()? != 0;
        if has_nan || has_inf {
            nonfinite.push(NonFinite {
                name: weights.params()[*i].name().to_string(),
                has_nan,
                has_inf,
            });
            continue;
        }
        let max_abs = g.abs()?.max_all()?.to_scalar::<f32>()?;
        if max_abs > 0.0 {
            let m = f64::from(max_abs);
            let s = g
                .affine(1.0 / m, 0.0)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f32>()?;
            sq_norm += m * m * f64::from(s);
        }
    }
    Ok(GradCheck {
        finite: nonfinite.is_empty(),
        sq_norm: sq_norm * inv_sq,
        nonfinite,
        with_grad,
        grads: present,
    })
}

/// A human-readable explanation of a scale collapse.
pub(crate) fn diagnose(
    check: &GradCheck,
    n_params: usize,
    min_scale: f64,
    consecutive_skips: u64,
) -> String {
    let bad = &check.nonfinite;
    let nan = bad.iter().filter(|b| b.has_nan).count();
    let inf_only = bad.len() - nan;
    let shown: Vec<&str> = bad.iter().take(5).map(|b| b.name.as_str()).collect();
    let more = if bad.len() > shown.len() {
        format!(", ... {} more", bad.len() - shown.len())
    } else {
        String::new()
    };
    let cause = if nan > 0 {
        "NaN gradients at the minimum scale usually mean the forward pass or the loss is already \
         NaN/inf (f16 overflow in activations or attention scores, log of 0, division by 0): keep \
         softmax, normalisation statistics and the loss in f32 (PrecisionPolicy) or train in bf16"
    } else {
        "gradients overflow even at the minimum scale: the model has likely diverged (lower the \
         learning rate, enable gradient clipping, check the data) or some activation exceeds the \
         f16 range (use bf16 or keep that computation in f32)"
    };
    format!(
        "gradients are still non-finite at the minimum loss scale {min_scale} after \
         {consecutive_skips} consecutive skipped step(s): {} of {n_params} parameters \
         ({nan} with NaN, {inf_only} with inf only): {}{more}. Lowering the scale cannot fix \
         this; {cause}. Use CollapsePolicy::Continue to keep going and inspect the outcomes.",
        bad.len(),
        shown.join(", "),
    )
}
