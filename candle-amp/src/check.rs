//! The overflow check: one fused reduction and one host sync per step.
//!
//! The check is the global norm of the scaled gradients ([`sum_of_squares`] by default, or
//! the update's own reduction): every gradient upcast to f32 (a no-op for f32 gradients) and
//! squared, the per-parameter sums stacked and summed, and that single scalar read back. A
//! square is NaN or inf whenever the element is, and NaN/inf propagate through sums, so the
//! scalar is finite iff every gradient is finite (unlike `abs().max_all()`, which can drop
//! NaN). The same scalar gives the clipping coefficient, so clipping needs no second pass.
//!
//! Only when the norm is not finite are the parameters scanned one by one ([`scan`], extra
//! syncs only on the failure path): NaN via `g.ne(g)`, inf via `abs() == inf`. If none is
//! actually non-finite, the f32 sum of squares merely overflowed (huge but finite
//! gradients); the norm is then recomputed with per-parameter rescaling and the step
//! proceeds.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::master::MasterWeights;

/// A parameter whose gradient held non-finite values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NonFinite {
    /// The registered name.
    pub name: String,
    /// The gradient held at least one NaN.
    pub has_nan: bool,
    /// The gradient held at least one infinity.
    pub has_inf: bool,
}

/// Result of checking one step's gradients.
#[derive(Debug, Clone)]
pub(crate) struct GradCheck {
    /// True if every gradient is finite.
    pub finite: bool,
    /// Squared global L2 norm of the unscaled gradients (meaningful when `finite`).
    pub sq_norm: f64,
    /// Parameters with non-finite gradients (empty when `finite`), registration order.
    pub nonfinite: Vec<NonFinite>,
}

/// The sum of the squares of every element of `grads`, each upcast to f32 (a no-op for f32
/// gradients): one fused reduction and one host sync; 0 for no gradient.
pub(crate) fn sum_of_squares<'a>(
    grads: impl IntoIterator<Item = &'a Tensor>,
) -> candle_core::Result<f32> {
    let partials = grads
        .into_iter()
        .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    if partials.is_empty() {
        return Ok(0.0);
    }
    Tensor::stack(&partials, 0)?.sum_all()?.to_scalar::<f32>()
}

/// Scans the gradients of `weights` in `grads` (computed at `scale`) one by one, after their
/// global norm came out non-finite: names the parameters holding inf or NaN, or, if none
/// does (the f32 sum of squares merely overflowed), recomputes the norm with per-parameter
/// rescaling. One host sync per parameter: the failure path only.
pub(crate) fn scan(weights: &MasterWeights, grads: &GradStore, scale: f64) -> Result<GradCheck> {
    let mut nonfinite = Vec::new();
    let mut sq_norm = 0.0f64;
    for i in 0..weights.len() {
        let Some(g) = weights.grad(i, grads) else {
            continue;
        };
        let g = &g.to_dtype(DType::F32)?;
        // Element-wise tests reduced over u8 flags: `abs().max_all()` would miss an infinity
        // whenever element 0 is NaN (Candle's max keeps a NaN only at element 0).
        let has_nan = g.ne(g)?.max_all()?.to_scalar::<u8>()? != 0;
        let has_inf = g.abs()?.eq(f32::INFINITY)?.max_all()?.to_scalar::<u8>()? != 0;
        if has_nan || has_inf {
            nonfinite.push(NonFinite {
                name: weights.params()[i].name().to_string(),
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
        sq_norm: sq_norm / (scale * scale),
        nonfinite,
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
         softmax, normalisation statistics and the loss in f32, or train in bf16"
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

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::master::WeightMode;

    /// NaN and inf are flagged apart, and both when they share a gradient, wherever they are
    /// (a NaN at element 0 hides every infinity from `abs().max_all()`).
    #[test]
    fn scan_flags_nan_and_inf_wherever_they_are() -> Result<()> {
        let dev = Device::Cpu;
        let b = Var::zeros(4, DType::F32, &dev)?;
        let named = [("b".to_string(), b.clone())];
        let w = MasterWeights::new(named, DType::F32, WeightMode::Cast)?;
        let cases = [
            (Some(2), None),
            (None, Some(1)),
            (Some(0), Some(3)),
            (Some(2), Some(1)),
            (Some(3), Some(0)),
            (Some(1), Some(2)),
        ];
        for (i_nan, i_inf) in cases {
            let mut data = [0.5f32; 4];
            if let Some(i) = i_nan {
                data[i] = f32::NAN;
            }
            if let Some(i) = i_inf {
                data[i] = f32::NEG_INFINITY;
            }
            let mut g = GradStore::default();
            g.insert(b.as_tensor(), Tensor::new(&data, &dev)?);
            let c = scan(&w, &g, 1.0)?;
            let want = NonFinite {
                name: "b".into(),
                has_nan: i_nan.is_some(),
                has_inf: i_inf.is_some(),
            };
            assert!(!c.finite);
            assert_eq!(c.nonfinite, [want], "NaN at {i_nan:?}, -inf at {i_inf:?}");
        }
        Ok(())
    }
}
