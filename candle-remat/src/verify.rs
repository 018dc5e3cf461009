//! Verify mode: comparing a recomputed segment with its forward values, and choosing which
//! mismatch to report.

use candle_core::{DType, Tensor};

use crate::error::{RematError, Result};

/// The position of a segment path (`"3"`, `"3/1"`) in forward order: compared component by
/// component, and a nested segment (longer path) before the segment containing it.
pub(crate) fn forward_order(a: &str, b: &str) -> std::cmp::Ordering {
    let parse = |p: &str| -> Vec<u64> {
        p.split('/')
            .map(|c| c.parse().unwrap_or(u64::MAX))
            .collect()
    };
    let (a, b) = (parse(a), parse(b));
    for (x, y) in a.iter().zip(&b) {
        if x != y {
            return x.cmp(y);
        }
    }
    b.len().cmp(&a.len())
}

/// The mismatch of the segment that comes first in forward order (see [`forward_order`]).
pub(crate) fn first_in_forward_order(mismatches: Vec<RematError>) -> Option<RematError> {
    let path = |e: &RematError| match e {
        RematError::RecomputeMismatch { segment, .. } => segment.clone(),
        _ => String::new(),
    };
    mismatches
        .into_iter()
        .min_by(|a, b| forward_order(&path(a), &path(b)))
}

/// Compares a recomputed output with the kept forward value: `Some` mismatch error if they
/// are not bit-identical (a NaN counts as a mismatch).
pub(crate) fn verify_same(
    path: &str,
    output: usize,
    recomputed: &Tensor,
    kept: &Tensor,
) -> Result<Option<RematError>> {
    let elements = kept.elem_count();
    let r = recomputed.to_device(kept.device())?;
    if r.shape() != kept.shape() || r.dtype() != kept.dtype() {
        return Ok(Some(RematError::RecomputeMismatch {
            segment: path.to_string(),
            output,
            mismatches: elements,
            elements,
            max_abs_diff: f64::INFINITY,
        }));
    }
    let mismatches = r
        .ne(kept)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()? as usize;
    if mismatches > 0 {
        // Read back on the host: Candle's `max_all` drops a NaN that is not at element 0.
        let diffs = (r.to_dtype(DType::F64)? - kept.to_dtype(DType::F64)?)?
            .abs()?
            .flatten_all()?
            .to_vec1::<f64>()?;
        let max_abs_diff = diffs.iter().fold(0.0f64, |m, &d| {
            if m.is_nan() || d.is_nan() {
                f64::NAN
            } else {
                m.max(d)
            }
        });
        return Ok(Some(RematError::RecomputeMismatch {
            segment: path.to_string(),
            output,
            mismatches,
            elements,
            max_abs_diff,
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::forward_order;
    use std::cmp::Ordering::{Greater, Less};

    #[test]
    fn paths_sort_in_forward_order() {
        // Numeric, not lexicographic; a nested segment before its parent, after its siblings.
        assert_eq!(forward_order("9", "10"), Less);
        assert_eq!(forward_order("3/1", "3"), Less);
        assert_eq!(forward_order("3/1", "3/0/2"), Greater);
        assert_eq!(forward_order("2", "3/0"), Less);
        assert_eq!(forward_order("3/10", "3/9"), Greater);
    }
}
