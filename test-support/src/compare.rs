//! Comparisons of tensors element by element on the host, NaN-aware, with the tolerance stated
//! by the caller and the offending element named on failure.
//!
//! Candle's `(a - b).abs().max_all()` cannot be trusted for this: its max keeps the running
//! value when it meets a NaN, so a NaN anywhere but at element 0 vanishes.

use std::fmt;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

/// Floor of the reference scale in relative errors, so that an all-zero reference does not
/// divide by zero.
pub const SCALE_FLOOR: f64 = 1e-12;

/// The elements of a float tensor of any dtype, flattened, as `f64` (exact for every float
/// dtype Candle has).
pub fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("tensor values")
}

/// How far values are from a reference: the largest `|a - b|` over the finite elements, the
/// element where it is, and the largest `|b|` (the scale of relative errors).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Diff {
    /// Largest `|a - b|` over the elements finite on both sides.
    pub max_abs: f64,
    /// Index (in the flattened tensor) of the element with the largest `|a - b|`.
    pub at: usize,
    /// Largest `|b|` over the elements finite on both sides.
    pub max_ref: f64,
}

impl Diff {
    /// `max_abs / max(max_ref, SCALE_FLOOR)`.
    pub fn rel(&self) -> f64 {
        self.max_abs / self.max_ref.max(SCALE_FLOOR)
    }
}

impl fmt::Display for Diff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "max |a - b| = {:e} at element {} (relative {:e}), max |b| = {:e}",
            self.max_abs,
            self.at,
            self.rel(),
            self.max_ref
        )
    }
}

/// Compares `a` with the reference `b`: the [`Diff`] over the finite elements, or a description
/// of the first bad element.
///
/// A NaN on either side is an error (even NaN against NaN), and so is a non-finite value that
/// the other side does not hold (an infinity against a finite value or the opposite infinity);
/// equal infinities are not compared further. Lengths must match.
pub fn diff(a: &[f64], b: &[f64]) -> Result<Diff, String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    let mut d = Diff {
        max_abs: 0.0,
        at: 0,
        max_ref: 0.0,
    };
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if x.is_nan() || y.is_nan() {
            return Err(format!("NaN at element {i}: {x:e} vs {y:e}"));
        }
        if x.is_finite() && y.is_finite() {
            if (x - y).abs() > d.max_abs {
                d.max_abs = (x - y).abs();
                d.at = i;
            }
            d.max_ref = d.max_ref.max(y.abs());
        } else if x != y {
            return Err(format!(
                "non-finite mismatch at element {i}: {x:e} vs {y:e}"
            ));
        }
    }
    Ok(d)
}

/// [`diff`] of two tensors of the same shape (any float dtypes); panics on a shape mismatch, a
/// NaN or a non-finite mismatch.
pub fn tensor_diff(a: &Tensor, b: &Tensor) -> Diff {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    diff(&values(a), &values(b)).unwrap_or_else(|e| panic!("{e}"))
}

/// `max |a - b| / max |b|` over the finite elements ([`Diff::rel`]); panics as [`tensor_diff`].
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    tensor_diff(a, b).rel()
}

/// Asserts `max |a - b| <= rtol * max |b|` ([`Diff::rel`]), with no NaN and matching
/// non-finite values; the message names `what`, the element and both values.
pub fn assert_close(a: &Tensor, b: &Tensor, rtol: f64, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let (va, vb) = (values(a), values(b));
    let d = diff(&va, &vb).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        d.rel() <= rtol,
        "{what}: {d} > {rtol:e} relative ({:e} vs {:e})",
        va[d.at],
        vb[d.at]
    );
}

/// Asserts the same shape and bit-identical values (compared widened to f64, which is exact). A
/// NaN on either side fails, even where both sides hold the same NaN bits.
pub fn assert_bits_eq(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let (fa, fb) = (values(a), values(b));
    for (i, (x, y)) in fa.iter().zip(&fb).enumerate() {
        assert!(
            !x.is_nan() && !y.is_nan(),
            "{what}: NaN at element {i}: {x:e} vs {y:e}"
        );
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}: element {i} differs: {x:e} vs {y:e}"
        );
    }
}

/// The largest [`rel_err`] of the gradients `got` against `want` over `vars` (each gradient
/// relative to its own reference's scale); panics if a var lacks a gradient on either side, or
/// on a NaN or a non-finite mismatch anywhere.
pub fn grads_rel_err(vars: &[Var], got: &GradStore, want: &GradStore) -> f64 {
    let mut worst: f64 = 0.0;
    for (i, v) in vars.iter().enumerate() {
        let g = got
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("var {i}: no gradient"));
        let r = want
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("var {i}: no reference"));
        assert_eq!(g.dims(), r.dims(), "var {i}: shapes differ");
        let d = diff(&values(g), &values(r))
            .unwrap_or_else(|e| panic!("var {i}: non-finite gradient: {e}"));
        worst = worst.max(d.rel());
    }
    worst
}
