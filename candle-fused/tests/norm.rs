//! LayerNorm / RMSNorm: the fused op against the composite reference (values and gradients),
//! the fallback path, 16-bit dtypes, finite differences, NaN propagation and thread-count
//! independence.
//!
//! Tolerances (relative to the largest magnitude of the reference):
//! * f64: 1e-10. Kernel and reference compute the same quantities in a different order
//!   (two-pass variance vs `mean_keepdim`; the closed-form backward vs the autograd chain):
//!   differences are a few ulp times the row length.
//! * f32: 2e-5 (values) / 1e-4 (gradients): the same reordering at 6e-8 per operation, with the
//!   backward's cancellation `g - mean(g) - xhat mean(g xhat)` amplifying it.
//! * bf16 / f16: 2e-2 / 4e-3, about two units of the format's rounding (both sides round the
//!   same f32 value, which can straddle a rounding boundary).
//! * finite differences (f64, h = 1e-5): 1e-6 (truncation ~h^2, roundoff ~1e-16/h).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::norm::{layer_norm, layer_norm_composite, rms_norm, rms_norm_composite};
use common::*;

#[derive(Clone, Copy, Debug)]
enum Case {
    Ln,
    LnBias,
    Rms,
}

const CASES: [Case; 3] = [Case::Ln, Case::LnBias, Case::Rms];
const EPS: f64 = 1e-5;

fn fused(case: Case) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> {
    move |t: &[Tensor]| match case {
        Case::Ln => layer_norm(&t[0], &t[1], None, EPS),
        Case::LnBias => layer_norm(&t[0], &t[1], Some(&t[2]), EPS),
        Case::Rms => rms_norm(&t[0], &t[1], EPS),
    }
}

fn reference(case: Case) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> {
    move |t: &[Tensor]| match case {
        Case::Ln => layer_norm_composite(&t[0], &t[1], None, EPS),
        Case::LnBias => layer_norm_composite(&t[0], &t[1], Some(&t[2]), EPS),
        Case::Rms => rms_norm_composite(&t[0], &t[1], EPS),
    }
}

/// `[x, w]` or `[x, w, b]`; x has a non-zero mean so LayerNorm's centring matters.
fn inputs(case: Case, shape: &[usize], dt: DType, rng: &mut Lcg) -> Result<Vec<Tensor>> {
    let c = *shape.last().unwrap_or(&1);
    let mut v = vec![
        rand(shape, dt, rng, 2.0, 0.7)?,
        rand(&[c], dt, rng, 0.5, 1.0)?,
    ];
    if matches!(case, Case::LnBias) {
        v.push(rand(&[c], dt, rng, 0.5, 0.0)?);
    }
    Ok(v)
}

const SHAPES: [&[usize]; 7] = [
    &[1, 1],
    &[3, 7],
    &[1, 65],
    &[2, 5, 33],
    &[127, 65],
    &[7, 3],
    &[4, 1, 128],
];

#[test]
fn matches_composite_f64_and_f32() -> Result<()> {
    let mut rng = Lcg(1);
    for (dt, vtol, gtol) in [(DType::F64, 1e-10, 1e-10), (DType::F32, 2e-5, 1e-4)] {
        for case in CASES {
            for shape in SHAPES {
                let ins = inputs(case, shape, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("{case:?} {dt:?} {shape:?}");
                let (f, r) = (fused(case), reference(case));
                assert_matches_reference(&f, &r, &ins, &probe, (vtol, gtol), &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg(2);
    for (dt, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        for case in CASES {
            for shape in [&[3usize, 7][..], &[2, 5, 33], &[127, 65]] {
                let ins = inputs(case, shape, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("fallback {case:?} {dt:?} {shape:?}");
                assert_fallback_matches(&fused(case), &ins, &probe, tol, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_close_to_f32_composite() -> Result<()> {
    let mut rng = Lcg(3);
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        for case in CASES {
            for shape in [&[3usize, 7][..], &[33, 65]] {
                let ins = inputs(case, shape, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("{case:?} {dt:?} {shape:?}");
                let (f, r) = (fused(case), reference(case));
                assert_matches_reference(&f, &r, &ins, &probe, (tol, 2.0 * tol), &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(4);
    for case in CASES {
        for shape in [&[3usize, 7][..], &[2, 1, 5], &[1, 1]] {
            let ins = inputs(case, shape, DType::F64, &mut rng)?;
            check_fd(&fused(case), &ins, 40 + shape.len() as u64)?;
        }
    }
    Ok(())
}

#[test]
fn nan_propagates() -> Result<()> {
    let mut rng = Lcg(5);
    let (rows, c) = (9usize, 33usize);
    for case in CASES {
        for dt in [DType::F32, DType::F64, DType::BF16] {
            let mut ins = inputs(case, &[rows, c], dt, &mut rng)?;
            let idx = 1 + rng.below(rows * c - 1);
            let mut xv = values(&ins[0]);
            xv[idx] = f64::NAN;
            ins[0] = Tensor::from_vec(xv, (rows, c), &Device::Cpu)?.to_dtype(dt)?;
            let probe = rand(&[rows, c], dt, &mut rng, 1.0, 0.0)?;
            let (y, g) = value_and_grads(&fused(case), &ins, &probe)?;
            let row = idx / c;
            let yv = values(&y);
            let dx = values(&g[0]);
            for r in 0..rows {
                let want = if r == row { c } else { 0 };
                let ny = yv[r * c..(r + 1) * c].iter().filter(|v| v.is_nan()).count();
                let nd = dx[r * c..(r + 1) * c].iter().filter(|v| v.is_nan()).count();
                assert_eq!(
                    ny, want,
                    "{case:?} {dt:?}: NaNs of y in row {r} (NaN at {idx})"
                );
                assert_eq!(
                    nd, want,
                    "{case:?} {dt:?}: NaNs of dx in row {r} (NaN at {idx})"
                );
            }
            // dw (and db: sum of dy, unaffected) over all rows: every dw entry is NaN.
            assert_eq!(nan_count(&g[1]), c, "{case:?} {dt:?}: dw");
            if g.len() > 2 {
                assert_eq!(nan_count(&g[2]), 0, "{case:?} {dt:?}: db");
            }
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let mut rng = Lcg(6);
    // 2100 rows of 128: 268,800 elements (over PAR_MIN_WORK), 17 row blocks.
    let shape = [3usize, 700, 128];
    assert!(shape.iter().product::<usize>() > PAR_MIN_WORK);
    for dt in [DType::F32, DType::BF16] {
        for case in CASES {
            let ins = inputs(case, &shape, dt, &mut rng)?;
            let probe = rand(&shape, dt, &mut rng, 1.0, 0.0)?;
            let what = format!("{case:?} {dt:?}");
            assert_same_bits_on_thread_counts(&fused(case), &ins, &probe, &what)?;
        }
    }
    Ok(())
}

#[test]
fn strided_input_and_untracked_weight() -> Result<()> {
    let mut rng = Lcg(7);
    let x = rand(&[16, 5], DType::F32, &mut rng, 1.0, 0.3)?.t()?; // [5, 16], not contiguous
    let w = rand(&[16], DType::F32, &mut rng, 0.5, 1.0)?;
    let b = rand(&[16], DType::F32, &mut rng, 0.5, 0.0)?;
    assert!(!x.is_contiguous());
    let y = layer_norm(&x, &w, Some(&b), EPS)?;
    let r = layer_norm_composite(&x, &w, Some(&b), EPS)?;
    assert_close(&y, &r, 2e-5, "strided")?;
    // Only x tracks a graph: x gets a gradient, w and b none.
    let xv = Var::from_tensor(&x)?;
    let g = layer_norm(xv.as_tensor(), &w, Some(&b), EPS)?
        .sum_all()?
        .backward()?;
    assert!(g.get(xv.as_tensor()).is_some());
    assert!(g.get(&w).is_none() && g.get(&b).is_none());
    Ok(())
}

#[test]
fn rejects_bad_arguments() -> Result<()> {
    let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
    let w4 = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let w3 = Tensor::ones(3, DType::F32, &Device::Cpu)?;
    let e = layer_norm(&x, &w3, None, EPS).unwrap_err().to_string();
    assert!(e.contains("w must have shape [4]"), "{e}");
    let e = layer_norm(&x, &w4, Some(&w3), EPS).unwrap_err().to_string();
    assert!(e.contains("b must have shape [4]"), "{e}");
    let e = rms_norm(&x, &w4.to_dtype(DType::F64)?, EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dtype"), "{e}");
    let e = rms_norm(&x, &w4, -1.0).unwrap_err().to_string();
    assert!(e.contains("eps"), "{e}");
    let s = Tensor::new(1f32, &Device::Cpu)?;
    assert!(layer_norm(&s, &w4, None, EPS).is_err());
    Ok(())
}
