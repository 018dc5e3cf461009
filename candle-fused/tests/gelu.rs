//! Bias + tanh GELU: the vectorising `tanh_f32` / `exp_f32` against f64 libm, the fused op
//! against the composite reference (values and gradients, with and without bias), the fallback
//! path, 16-bit dtypes, finite differences, NaN propagation and thread-count independence.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3)):
//! * `tanh_f32`: at most 1.5 ulp of the correctly rounded f32 (measured 1.29 ulp on this grid, near |x| =
//!   0.63 where the polynomial hands over to the exponential form); `exp_f32`: at most 1 ulp.
//! * f64: 1e-12: the same formula, both on std's `tanh`, evaluated in a different order.
//! * f32: 1e-5: the kernel's tanh differs from Candle's by ~1-2 ulp, which the backward's
//!   `1 - t^2` turns into ~1e-7 absolute at |z| ~ 3.
//! * bf16 / f16: 2e-2 / 4e-3, about two units of the format's rounding.
//! * finite differences (f64, h = 1e-5): 1e-6.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::gelu::{bias_gelu, bias_gelu_composite, exp_f32, gelu, gelu_composite, tanh_f32};
use common::*;

/// `[x]` or `[x, b]`; x spans the interesting range of GELU (about [-6, 6]).
fn inputs(shape: &[usize], bias: bool, dt: DType, rng: &mut Lcg) -> Result<Vec<Tensor>> {
    let mut v = vec![rand(shape, dt, rng, 5.0, 0.0)?];
    if bias {
        v.push(rand(&[*shape.last().unwrap_or(&1)], dt, rng, 1.0, 0.0)?);
    }
    Ok(v)
}

fn fused(t: &[Tensor]) -> candle_core::Result<Tensor> {
    bias_gelu(&t[0], t.get(1))
}

fn reference(t: &[Tensor]) -> candle_core::Result<Tensor> {
    bias_gelu_composite(&t[0], t.get(1))
}

const SHAPES: [&[usize]; 6] = [&[1], &[3, 7], &[1, 65], &[2, 3, 33], &[127, 65], &[5000]];

/// The error of `approx(x)` in units in the last place of the correctly rounded f32 of `exact`.
fn ulps(approx: f32, exact: f64) -> f64 {
    let r = (exact as f32).abs();
    let ulp = if r < f32::MIN_POSITIVE {
        2f64.powi(-149)
    } else {
        2f64.powi((r.to_bits() >> 23) as i32 - 127 - 23)
    };
    (approx as f64 - exact).abs() / ulp
}

#[test]
fn tanh_f32_is_accurate_to_f32_rounding() {
    let mut worst = (0f32, 0f64);
    let mut check = |x: f32| {
        let e = ulps(tanh_f32(x), (x as f64).tanh());
        if e > worst.1 {
            worst = (x, e);
        }
    };
    // A dense grid over [-12, 12] (step 1.2e-5)...
    let n = 2_000_000;
    for i in 0..=n {
        check((-12.0 + 24.0 * i as f64 / n as f64) as f32);
    }
    // ...and every 61st f32 from 1e-30 to 10, both signs (tiny arguments, the hand-over at
    // 0.625, saturation).
    let mut b = 1e-30f32.to_bits();
    while f32::from_bits(b) < 10.0 {
        check(f32::from_bits(b));
        check(-f32::from_bits(b));
        b += 61;
    }
    assert!(worst.1 <= 1.5, "tanh_f32: {} ulp at {}", worst.1, worst.0);
    assert!(worst.1 > 0.5, "the check measures something: {}", worst.1);
    for (x, want) in [
        (9.5f32, 1f32),
        (20.0, 1.0),
        (1e30, 1.0),
        (f32::INFINITY, 1.0),
        (0.0, 0.0),
    ] {
        assert_eq!(tanh_f32(x), want, "tanh_f32({x})");
        assert_eq!(tanh_f32(-x), -want, "tanh_f32(-{x})");
    }
    assert_eq!(tanh_f32(1e-40), 1e-40);
    assert!(tanh_f32(f32::NAN).is_nan() && tanh_f32(-f32::NAN).is_nan());
}

#[test]
fn exp_f32_is_accurate_to_f32_rounding() {
    let mut worst = (0f32, 0f64);
    let n = 2_000_000;
    for i in 0..=n {
        // The normal range of results: [-87.3, 88.7].
        let x = (-87.3 + 176.0 * i as f64 / n as f64) as f32;
        let e = ulps(exp_f32(x), (x as f64).exp());
        if e > worst.1 {
            worst = (x, e);
        }
    }
    assert!(worst.1 <= 1.0, "exp_f32: {} ulp at {}", worst.1, worst.0);
    // Subnormal results, overflow, limits.
    for x in [-88.0f32, -95.0, -100.0, -103.0] {
        let exact = (x as f64).exp();
        assert!(
            (exp_f32(x) as f64 - exact).abs() <= 2f64.powi(-149),
            "exp_f32({x})"
        );
    }
    assert_eq!(exp_f32(88.8), f32::INFINITY);
    assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
    assert_eq!(exp_f32(-105.0), 0.0);
    assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_f32(0.0), 1.0);
    assert!(exp_f32(f32::NAN).is_nan());
}

#[test]
fn matches_composite_f64_and_f32() -> Result<()> {
    let mut rng = Lcg(1);
    for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for bias in [false, true] {
            for shape in SHAPES {
                let ins = inputs(shape, bias, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("bias {bias} {dt:?} {shape:?}");
                assert_matches_reference(&fused, &reference, &ins, &probe, (tol, tol), &what)?;
            }
        }
    }
    // gelu(x) is bias_gelu(x, None), also for a scalar, and far into the tails.
    let x = Tensor::new(
        &[-1e4f32, -30.0, -9.0, -3.0, 0.0, 2.5, 9.0, 30.0, 1e4],
        &Device::Cpu,
    )?;
    assert_close(&gelu(&x)?, &gelu_composite(&x)?, 1e-6, "tails")?;
    let s = Tensor::new(0.5f64, &Device::Cpu)?;
    assert_close(&gelu(&s)?, &gelu_composite(&s)?, 1e-15, "scalar")?;
    Ok(())
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg(2);
    for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for bias in [false, true] {
            for shape in [&[3usize, 7][..], &[2, 3, 33], &[127, 65]] {
                let ins = inputs(shape, bias, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("fallback bias {bias} {dt:?} {shape:?}");
                assert_fallback_matches(&fused, &ins, &probe, tol, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_close_to_f32_composite() -> Result<()> {
    let mut rng = Lcg(3);
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        for bias in [false, true] {
            for shape in [&[3usize, 7][..], &[33, 65]] {
                let ins = inputs(shape, bias, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("bias {bias} {dt:?} {shape:?}");
                assert_matches_reference(&fused, &reference, &ins, &probe, (tol, tol), &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(4);
    for bias in [false, true] {
        for shape in [&[3usize, 7][..], &[2, 1, 5], &[1]] {
            let ins = inputs(shape, bias, DType::F64, &mut rng)?;
            check_fd(&fused, &ins, 40 + shape.len() as u64)?;
        }
    }
    Ok(())
}

#[test]
fn nan_propagates() -> Result<()> {
    let mut rng = Lcg(5);
    let (rows, c) = (9usize, 33usize);
    for bias in [false, true] {
        for dt in [DType::F32, DType::F64, DType::BF16] {
            let mut ins = inputs(&[rows, c], bias, dt, &mut rng)?;
            let idx = 1 + rng.below(rows * c - 1);
            let mut xv = values(&ins[0]);
            xv[idx] = f64::NAN;
            ins[0] = Tensor::from_vec(xv, (rows, c), &Device::Cpu)?.to_dtype(dt)?;
            let probe = rand(&[rows, c], dt, &mut rng, 1.0, 0.0)?;
            let (y, g) = value_and_grads(&fused, &ins, &probe)?;
            let what = format!("bias {bias} {dt:?} NaN at {idx}");
            assert_eq!((nan_count(&y), nan_count(&g[0])), (1, 1), "{what}");
            let yv = values(&y);
            let dx = values(&g[0]);
            for i in 0..rows * c {
                assert_eq!(yv[i].is_nan(), i == idx, "{what}: y[{i}]");
                assert_eq!(dx[i].is_nan(), i == idx, "{what}: dx[{i}]");
            }
            if bias {
                let db = values(&g[1]);
                for (j, v) in db.iter().enumerate() {
                    assert_eq!(v.is_nan(), j == idx % c, "{what}: db[{j}]");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let mut rng = Lcg(6);
    // 2100 rows of 128 (268,800 elements, over PAR_MIN_WORK; 17 row blocks for db), and a flat
    // tensor for the bias-free path.
    for shape in [&[3usize, 700, 128][..], &[270_001]] {
        assert!(shape.iter().product::<usize>() > PAR_MIN_WORK);
        for dt in [DType::F32, DType::BF16, DType::F64] {
            for bias in [false, true] {
                let ins = inputs(shape, bias, dt, &mut rng)?;
                let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
                let what = format!("bias {bias} {dt:?} {shape:?}");
                assert_same_bits_on_thread_counts(&fused, &ins, &probe, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn strided_input_and_rejected_arguments() -> Result<()> {
    let mut rng = Lcg(7);
    let x = rand(&[16, 5], DType::F32, &mut rng, 3.0, 0.0)?.t()?;
    let b = rand(&[16], DType::F32, &mut rng, 1.0, 0.0)?;
    assert!(!x.is_contiguous());
    assert_close(
        &bias_gelu(&x, Some(&b))?,
        &bias_gelu_composite(&x, Some(&b))?,
        1e-5,
        "strided",
    )?;
    let e = bias_gelu(&x, Some(&b.narrow(0, 0, 5)?))
        .unwrap_err()
        .to_string();
    assert!(e.contains("b must have shape [16]"), "{e}");
    let e = bias_gelu(&x, Some(&b.to_dtype(DType::F64)?))
        .unwrap_err()
        .to_string();
    assert!(e.contains("dtype"), "{e}");
    let i = Tensor::new(&[1u32, 2], &Device::Cpu)?;
    assert!(gelu(&i).is_err());
    // Empty tensors are fine.
    let z = Tensor::zeros((0, 16), DType::F32, &Device::Cpu)?;
    assert_eq!(bias_gelu(&z, Some(&b))?.dims(), [0, 16]);
    Ok(())
}
