//! SwiGLU: the fused op against the composite reference `silu(gate) * up` (values and both
//! gradients, every dtype, odd and strided shapes, the tails of the sigmoid), the fallback path,
//! finite differences, NaN propagation, thread-count independence and rejected arguments.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3)):
//! * f64: 1e-12. The same formula on std's `exp`; `g * (1 / (1 + e))` against Candle's
//!   `g / (1 + e)` and the backward's terms in another order: a few ulp.
//! * f32: 1e-6. The kernel's `exp_f32` (< 1 ulp) against libm's `expf` puts the sigmoid within
//!   ~2 ulp, `y` within ~4 ulp (~5e-7 relative) of the composite's.
//! * bf16 / f16 against the composite in the same dtype (which also computes in f32 and rounds
//!   once): 8e-3 / 1e-3, one unit of the format's rounding (the two f32 values, a few f32 ulp
//!   apart, can straddle a rounding boundary).
//! * finite differences (f64, h = 1e-5): 1e-6 (truncation ~h^2, roundoff ~1e-16/h).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_fused::swiglu::{swiglu, swiglu_composite};
use common::*;

const DTYPES: [(DType, f64); 4] = [
    (DType::F64, 1e-12),
    (DType::F32, 1e-6),
    (DType::BF16, 8e-3),
    (DType::F16, 1e-3),
];

fn fused(t: &[Tensor]) -> candle_core::Result<Tensor> {
    swiglu(&t[0], &t[1])
}

fn reference(t: &[Tensor]) -> candle_core::Result<Tensor> {
    swiglu_composite(&t[0], &t[1])
}

/// `[gate, up]`; gate spans the sigmoid's range (about [-8, 8]).
fn inputs(shape: &[usize], dt: DType, rng: &mut Lcg) -> Result<Vec<Tensor>> {
    Ok(vec![
        rand(shape, dt, rng, 8.0, 0.0)?,
        rand(shape, dt, rng, 2.0, 0.0)?,
    ])
}

/// Sizes of 1, sizes not multiples of 8 (the vector width) nor of the 4096-element chunks, a
/// scalar.
const SHAPES: [&[usize]; 8] = [
    &[],
    &[1],
    &[3, 7],
    &[1, 65],
    &[2, 3, 33],
    &[127, 65],
    &[5000],
    &[2, 4097],
];

/// Asserts `f` and `g` give the same value and gradients within `tol` for `ins`.
fn assert_matches(
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    g: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    ins: &[Tensor],
    probe: &Tensor,
    tol: f64,
    what: &str,
) -> Result<()> {
    let (y, gr) = value_and_grads(f, ins, probe)?;
    let (yr, grr) = value_and_grads(g, ins, probe)?;
    assert_eq!(y.dtype(), yr.dtype(), "{what}");
    assert_close(&y, &yr, tol, &format!("{what} y"))?;
    for (k, (a, b)) in gr.iter().zip(&grr).enumerate() {
        assert_eq!((a.dtype(), a.dims()), (b.dtype(), ins[k].dims()), "{what}");
        assert_close(a, b, tol, &format!("{what} grad {k}"))?;
    }
    Ok(())
}

#[test]
fn matches_composite() -> Result<()> {
    let mut rng = Lcg(1);
    for (dt, tol) in DTYPES {
        for shape in SHAPES {
            let ins = inputs(shape, dt, &mut rng)?;
            let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
            let what = format!("{dt:?} {shape:?}");
            assert_matches(&fused, &reference, &ins, &probe, tol, &what)?;
            assert!(fused(&ins)?.is_contiguous());
        }
    }
    Ok(())
}

#[test]
fn f32_error_is_a_few_ulp() -> Result<()> {
    // The kernel's f32 error against the f64 composite, next to the f32 composite's own: the
    // vectorised exponential costs at most a few f32 ulp.
    let mut rng = Lcg(2);
    let shape = [64, 1000];
    let ins = inputs(&shape, DType::F32, &mut rng)?;
    let ins64: Vec<Tensor> = ins
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<candle_core::Result<_>>()?;
    let exact = reference(&ins64)?;
    let ours = compare::rel_err(&fused(&ins)?, &exact);
    let candle = compare::rel_err(&reference(&ins)?, &exact);
    assert!(
        ours < 2.5e-7,
        "fused f32 vs f64: {ours:e} (composite f32: {candle:e})"
    );
    assert!(candle > 0.0 && ours > 0.0, "the check measures something");
    Ok(())
}

#[test]
fn tails_of_the_sigmoid() -> Result<()> {
    let g = Tensor::new(
        &[
            -1e4f32, -150.0, -104.0, -90.0, -88.5, -30.0, -1.2785, 0.0, 1e-30, 17.0, 30.0, 89.0,
            1e4,
        ],
        &Device::Cpu,
    )?;
    let u = g.ones_like()?.affine(1.5, 0.0)?;
    let probe = g.ones_like()?;
    let ins = [g, u];
    assert_matches(&fused, &reference, &ins, &probe, 1e-6, "tails f32")?;
    let ins64: Vec<Tensor> = ins
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<candle_core::Result<_>>()?;
    assert_matches(
        &fused,
        &reference,
        &ins64,
        &probe.to_dtype(DType::F64)?,
        1e-12,
        "tails f64",
    )?;
    Ok(())
}

#[test]
fn strided_inputs() -> Result<()> {
    let mut rng = Lcg(3);
    for (dt, tol) in DTYPES {
        for (n, i) in [(1usize, 1usize), (7, 33), (2 * 3, 1536)] {
            // gate and up as the two halves of one packed [N, 2I] projection: the gradient
            // comes back in the packed tensor.
            let h = rand(&[n, 2 * i], dt, &mut rng, 6.0, 0.0)?;
            let probe = rand(&[n, i], dt, &mut rng, 1.0, 0.0)?;
            let halves = |t: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
                Ok(vec![
                    t[0].narrow(D::Minus1, 0, i)?,
                    t[0].narrow(D::Minus1, i, i)?,
                ])
            };
            let f = |t: &[Tensor]| fused(&halves(t)?);
            let r = |t: &[Tensor]| reference(&halves(t)?);
            let what = format!("{dt:?} packed [{n}, 2 x {i}]");
            assert_matches(&f, &r, std::slice::from_ref(&h), &probe, tol, &what)?;
            // up contiguous, gate transposed (its last stride is not 1), 3-D with a strided
            // middle dim.
            let gt = rand(&[i, n], dt, &mut rng, 6.0, 0.0)?;
            let u = rand(&[n, i], dt, &mut rng, 2.0, 0.0)?;
            let f = |t: &[Tensor]| fused(&[t[0].t()?, t[1].clone()]);
            let r = |t: &[Tensor]| reference(&[t[0].t()?, t[1].clone()]);
            let what = format!("{dt:?} transposed gate [{n}, {i}]");
            assert_matches(&f, &r, &[gt, u], &probe, tol, &what)?;
            let big = rand(&[2, 5, n, i], dt, &mut rng, 6.0, 0.0)?;
            let pick = |t: &Tensor| t.narrow(1, 1, 3);
            let p3 = rand(&[2, 3, n, i], dt, &mut rng, 1.0, 0.0)?;
            let f = |t: &[Tensor]| fused(&[pick(&t[0])?, pick(&t[1])?]);
            let r = |t: &[Tensor]| reference(&[pick(&t[0])?, pick(&t[1])?]);
            let ins = [big.clone(), big.affine(0.5, 0.1)?];
            assert_matches(&f, &r, &ins, &p3, tol, &format!("{dt:?} narrowed dim 1"))?;
        }
    }
    Ok(())
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg(4);
    for (dt, tol) in DTYPES {
        for shape in [&[1usize][..], &[3, 7], &[2, 3, 33]] {
            let ins = inputs(shape, dt, &mut rng)?;
            let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
            assert_fallback_matches(
                &fused,
                &ins,
                &probe,
                tol,
                &format!("fallback {dt:?} {shape:?}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(5);
    for shape in [&[3usize, 7][..], &[2, 1, 5], &[1]] {
        let ins = inputs(shape, DType::F64, &mut rng)?;
        check_fd(&reference, &ins, 50 + shape.len() as u64)?;
        check_fd(&fused, &ins, 60 + shape.len() as u64)?;
    }
    Ok(())
}

#[test]
fn nan_propagates() -> Result<()> {
    let mut rng = Lcg(6);
    let (rows, c) = (9usize, 33usize);
    for dt in [DType::F32, DType::F64, DType::BF16] {
        for (which, name) in [(0usize, "gate"), (1, "up")] {
            let mut ins = inputs(&[rows, c], dt, &mut rng)?;
            let idx = 1 + rng.below(rows * c - 1);
            let mut v = values(&ins[which]);
            v[idx] = f64::NAN;
            ins[which] = Tensor::from_vec(v, (rows, c), &Device::Cpu)?.to_dtype(dt)?;
            let probe = rand(&[rows, c], dt, &mut rng, 1.0, 0.0)?;
            let (y, g) = value_and_grads(&fused, &ins, &probe)?;
            let what = format!("{dt:?} NaN in {name} at {idx}");
            // y and d_gate see both inputs; d_up = dy silu(gate) sees gate only.
            let up_nan = which == 0;
            for (t, tname, hit) in [
                (&y, "y", true),
                (&g[0], "d_gate", true),
                (&g[1], "d_up", up_nan),
            ] {
                for (k, v) in values(t).iter().enumerate() {
                    assert_eq!(v.is_nan(), hit && k == idx, "{what}: {tname}[{k}]");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let mut rng = Lcg(7);
    // Contiguous (CHUNK pieces) and packed (rows) paths, both over PAR_MIN_WORK.
    let (n, i) = (180, 1536);
    assert!(n * i > PAR_MIN_WORK);
    for dt in [DType::F32, DType::BF16, DType::F64] {
        let ins = inputs(&[n, i], dt, &mut rng)?;
        let probe = rand(&[n, i], dt, &mut rng, 1.0, 0.0)?;
        assert_same_bits_on_thread_counts(&fused, &ins, &probe, &format!("{dt:?} contiguous"))?;
        let h = rand(&[n, 2 * i], dt, &mut rng, 6.0, 0.0)?;
        let f = |t: &[Tensor]| swiglu(&t[0].narrow(1, 0, i)?, &t[0].narrow(1, i, i)?);
        assert_same_bits_on_thread_counts(&f, &[h], &probe, &format!("{dt:?} packed"))?;
    }
    Ok(())
}

#[test]
fn rejects_bad_arguments() -> Result<()> {
    let mut rng = Lcg(8);
    let g = rand(&[4, 6], DType::F32, &mut rng, 1.0, 0.0)?;
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let e = err(swiglu(&g, &g.narrow(1, 0, 5)?));
    assert!(
        e.contains("swiglu: gate and up must have the same shape, got [4, 6] and [4, 5]"),
        "{e}"
    );
    let e = err(swiglu_composite(&g, &g.t()?));
    assert!(
        e.contains("swiglu_composite: gate and up must have the same shape"),
        "{e}"
    );
    let e = err(swiglu(&g, &g.to_dtype(DType::F64)?));
    assert!(e.contains("swiglu: gate has dtype F32, up has F64"), "{e}");
    let i = g.to_dtype(DType::U32)?;
    let e = err(swiglu(&i, &i));
    assert!(e.contains("swiglu: gate must be a float tensor"), "{e}");
    // Empty tensors are fine.
    let z = Tensor::zeros((0, 6), DType::F32, &Device::Cpu)?;
    assert_eq!(swiglu(&z, &z)?.dims(), [0, 6]);
    Ok(())
}
