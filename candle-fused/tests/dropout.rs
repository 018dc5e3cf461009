//! Dropout: kernel vs composite (bit for bit), fallback, thread independence, backward,
//! statistics, key handling, NaN, 16-bit types.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::dropout::{dropout, dropout_composite, dropout_mask};
use candle_fused::RngKey;
use common::{
    assert_same_on_thread_counts, f32s, fallback_if, randn, same_bits, values, Lcg31, PAR_MIN_WORK,
};

/// The bits of every element, widened to f64 (exact for every float dtype, keeps -0 and
/// NaN distinct from 0).
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() })
        .collect())
}

/// Values widened to f64, compared with `==` except that NaN equals NaN (for gradients:
/// Candle accumulates gradients onto zeros, which turns -0 into +0).
fn same_values(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    let a = a.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let b = b.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| !(a[i] == b[i] || (a[i].is_nan() && b[i].is_nan()))) {
        panic!("{what}: element {i}: {} vs {}", a[i], b[i]);
    }
    Ok(())
}

const SHAPES: &[&[usize]] = &[&[1], &[3, 7], &[33, 65], &[127, 3], &[2, 5, 129], &[4099]];

#[test]
fn kernel_equals_composite_bitwise() -> Result<()> {
    // Both compute x * mask in x's dtype with the same scale: no tolerance at all.
    let mut rng = Lcg31(1);
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (si, shape) in SHAPES.iter().enumerate() {
            for p in [0.1f32, 0.5, 0.9] {
                let x = randn(shape, dtype, &mut rng, 1.0)?;
                let key = RngKey::new(0xfeed + si as u64, 3);
                let a = dropout(&x, p, key)?;
                let b = dropout_composite(&x, p, key)?;
                assert_eq!(a.dtype(), dtype);
                assert_eq!(a.dims(), x.dims());
                same_bits(&a, &b, &format!("{dtype:?} {shape:?} p={p}"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn strided_input_uses_logical_indices() -> Result<()> {
    let mut rng = Lcg31(2);
    let x = randn(&[17, 31], DType::F32, &mut rng, 1.0)?.t()?;
    assert!(!x.is_contiguous());
    let key = RngKey::new(5, 5);
    let a = dropout(&x, 0.3, key)?;
    let b = dropout_composite(&x.contiguous()?, 0.3, key)?;
    same_bits(&a, &b, "strided")?;
    Ok(())
}

#[test]
fn fallback_matches_kernel_values_and_grads() -> Result<()> {
    let mut rng = Lcg31(3);
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        for shape in [&[7usize, 33][..], &[65, 127]] {
            let x0 = randn(shape, dtype, &mut rng, 1.0)?;
            let w = randn(shape, dtype, &mut rng, 1.0)?;
            let key = RngKey::new(99, 1);
            let run = |force: bool| -> Result<(Vec<u64>, Vec<u64>)> {
                fallback_if(force, || {
                    let x = Var::from_tensor(&x0)?;
                    let y = dropout(&x, 0.25, key)?;
                    let g = (&y * &w)?.sum_all()?.backward()?;
                    let gx = g.get(&x).expect("grad of x").clone();
                    Ok((bits(&y)?, bits(&gx)?))
                })
            };
            let (yk, gk) = run(false)?;
            let (yf, gf) = run(true)?;
            assert_eq!(yk, yf, "values {dtype:?} {shape:?}");
            assert_eq!(gk, gf, "grads {dtype:?} {shape:?}");
        }
    }
    Ok(())
}

#[test]
fn identical_for_any_thread_count() -> Result<()> {
    // Large enough for several parallel chunks (PAR_MIN_WORK is counted in elements x 16).
    let n = 3 * PAR_MIN_WORK + 123;
    let mut rng = Lcg31(4);
    let x = Var::from_tensor(&randn(&[n], DType::F32, &mut rng, 1.0)?)?;
    let key = RngKey::new(0x1234, 9);
    assert_same_on_thread_counts("dropout", || {
        let y = dropout(&x, 0.4, key)?;
        let m = dropout_mask(n, 0.4, key, DType::F32, &Device::Cpu)?;
        let g = y.sum_all()?.backward()?.get(&x).expect("grad").clone();
        Ok((bits(&y)?, bits(&m)?, bits(&g)?))
    })
}

#[test]
fn backward_is_the_mask() -> Result<()> {
    let mut rng = Lcg31(5);
    for dtype in [DType::F32, DType::F64, DType::F16] {
        let shape = [33, 65];
        let x = Var::from_tensor(&randn(&shape, dtype, &mut rng, 1.0)?)?;
        let up = randn(&shape, dtype, &mut rng, 1.0)?;
        let key = RngKey::new(11, 2);
        let y = dropout(&x, 0.3, key)?;
        let grads = (&y * &up)?.sum_all()?.backward()?;
        let gx = grads.get(&x).expect("grad");
        assert_eq!(gx.dtype(), dtype);
        let mask = dropout_mask(&shape, 0.3, key, dtype, &Device::Cpu)?;
        // Exactly upstream * mask: the backward regenerates the forward's mask (up to the sign
        // of zero, which Candle's gradient accumulation normalises).
        same_values(gx, &(&up * &mask)?, &format!("{dtype:?}"))?;
        // And the plain gradient of sum(y) is the mask itself.
        let g1 = dropout(&x, 0.3, key)?.sum_all()?.backward()?;
        same_bits(g1.get(&x).expect("grad"), &mask, "grad of sum")?;
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    // The op is linear in x, so central differences of a random functional are exact up to
    // f64 rounding: tolerance 1e-8 relative.
    let mut rng = Lcg31(6);
    let shape = [7, 13];
    let x0 = randn(&shape, DType::F64, &mut rng, 1.0)?;
    let w = randn(&shape, DType::F64, &mut rng, 1.0)?;
    let key = RngKey::new(3, 3);
    let f = |x: &Tensor| -> Result<f64> {
        Ok((dropout(x, 0.5, key)? * &w)?
            .sum_all()?
            .to_scalar::<f64>()?)
    };
    let x = Var::from_tensor(&x0)?;
    let g = values(
        (dropout(&x, 0.5, key)? * &w)?
            .sum_all()?
            .backward()?
            .get(&x)
            .expect("grad"),
    );
    let n = shape.iter().product::<usize>();
    let h = 1e-4;
    for _ in 0..10 {
        let i = rng.below(n);
        let mut e = vec![0f64; n];
        e[i] = h;
        let e = Tensor::from_vec(e, &shape, &Device::Cpu)?;
        let fd = (f(&(&x0 + &e)?)? - f(&(&x0 - &e)?)?) / (2.0 * h);
        assert!(
            (fd - g[i]).abs() <= 1e-8 * (1.0 + g[i].abs()),
            "{fd} vs {}",
            g[i]
        );
    }
    Ok(())
}

#[test]
fn drop_rate_and_scale() -> Result<()> {
    // 100k Bernoulli(p) draws: standard deviation of the rate <= 0.0016, tolerance 0.008 (5 sd).
    let n = 100_000;
    for p in [0.1f32, 0.5] {
        let m = f32s(&dropout_mask(
            n,
            p,
            RngKey::new(2024, 4),
            DType::F32,
            &Device::Cpu,
        )?)?;
        let scale = (1.0 / (1.0 - p as f64)) as f32;
        let dropped = m.iter().filter(|&&v| v == 0.0).count();
        assert_eq!(
            m.iter().filter(|&&v| v == scale).count(),
            n - dropped,
            "values are 0 or 1/(1-p)"
        );
        let rate = dropped as f64 / n as f64;
        assert!((rate - p as f64).abs() < 0.008, "p={p}: drop rate {rate}");
        // Mean of the mask ~ 1 (inverted dropout keeps the expectation).
        let mean = m.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        assert!((mean - 1.0).abs() < 0.02, "p={p}: mean {mean}");
    }
    Ok(())
}

#[test]
fn same_key_recomputes_other_keys_differ() -> Result<()> {
    let mut rng = Lcg31(7);
    let x = randn(&[64, 64], DType::F32, &mut rng, 1.0)?;
    let key = RngKey::new(77, 5);
    let a = bits(&dropout(&x, 0.5, key)?)?;
    // A "recompute" (e.g. activation checkpointing) with the same key: the same mask.
    assert_eq!(a, bits(&dropout(&x, 0.5, key)?)?);
    let differ = |other: Vec<u64>| a.iter().zip(&other).filter(|(u, v)| u != v).count();
    let d_site = differ(bits(&dropout(&x, 0.5, RngKey::new(77, 6))?)?);
    let d_seed = differ(bits(&dropout(&x, 0.5, RngKey::new(78, 5))?)?);
    // Independent masks with p = 0.5 differ at ~half the 4096 positions.
    assert!(d_site > 1500 && d_seed > 1500, "{d_site} {d_seed}");
    Ok(())
}

#[test]
fn nan_propagates_even_where_dropped() -> Result<()> {
    let mut rng = Lcg31(8);
    let shape = [37, 41];
    let n = 37 * 41;
    let key = RngKey::new(8, 8);
    let mask = f32s(&dropout_mask(&shape, 0.5, key, DType::F32, &Device::Cpu)?)?;
    // One index that is kept and one that is dropped (both away from 0).
    let pick = |rng: &mut Lcg31, keep: bool| loop {
        let i = 1 + rng.below(n - 1);
        if (mask[i] != 0.0) == keep {
            break i;
        }
    };
    for keep in [true, false] {
        let i = pick(&mut rng, keep);
        let mut v = rng.normal_vec(n, 1.0);
        v[i] = f32::NAN;
        let x = Var::from_tensor(&Tensor::from_vec(v, &shape, &Device::Cpu)?)?;
        let y = dropout(&x, 0.5, key)?;
        let out = f32s(&y)?;
        // PyTorch semantics: x * mask, so NaN * 0 = NaN.
        let nans: Vec<usize> = (0..n).filter(|&j| out[j].is_nan()).collect();
        assert_eq!(nans, vec![i], "keep={keep}");
        // The gradient wrt x is the mask: finite everywhere.
        let g = f32s(y.sum_all()?.backward()?.get(&x).expect("grad"))?;
        assert_eq!(g.iter().filter(|v| v.is_nan()).count(), 0);
        assert_eq!(g, mask);
    }
    Ok(())
}

#[test]
fn half_types_close_to_f32() -> Result<()> {
    // 16-bit output = round(x16 * round(scale)): within 2 ulps of the f32 composite of the
    // same 16-bit input (relative 2^-7 for bf16, 2^-10 for f16).
    let mut rng = Lcg31(9);
    for (dtype, tol) in [(DType::BF16, 1.6e-2), (DType::F16, 2e-3)] {
        let x = randn(&[65, 33], dtype, &mut rng, 1.0)?;
        let key = RngKey::new(1, 1);
        let y = f32s(&dropout(&x, 0.3, key)?)?;
        let r = f32s(&dropout_composite(&x.to_dtype(DType::F32)?, 0.3, key)?)?;
        for (a, b) in y.iter().zip(&r) {
            assert!((a - b).abs() <= tol * b.abs(), "{dtype:?}: {a} vs {b}");
        }
    }
    Ok(())
}

#[test]
fn p_validation_and_identity() -> Result<()> {
    let x = Tensor::new(&[1f32, -2., 3.], &Device::Cpu)?;
    let key = RngKey::new(0, 0);
    for p in [1.0f32, 1.5, -0.1, f32::NAN] {
        assert!(dropout(&x, p, key).is_err(), "p={p}");
        assert!(
            dropout_mask(3, p, key, DType::F32, &Device::Cpu).is_err(),
            "p={p}"
        );
    }
    assert!(dropout_mask(3, 0.5, key, DType::U32, &Device::Cpu).is_err());
    // p == 0: x itself.
    let y = dropout(&x, 0.0, key)?;
    assert_eq!(y.id(), x.id());
    Ok(())
}

#[test]
fn offset_key_gives_the_rows_of_the_whole_mask() -> Result<()> {
    // A slice of rows (a pipeline microbatch) keyed with its first element's index draws
    // exactly those rows of the mask of the whole batch, in the kernel and the composite.
    let mut rng = Lcg31(91);
    let (b, row) = (7usize, 3 * 37usize);
    let x = randn(&[b, 3, 37], DType::F32, &mut rng, 1.0)?;
    let key = RngKey::new(11, 4);
    let whole = dropout(&x, 0.3, key)?;
    for (start, rows) in [(0usize, 2usize), (2, 3), (5, 2), (6, 1)] {
        let part = x.narrow(0, start, rows)?;
        let keyed = key.with_offset((start * row) as u64);
        let want = whole.narrow(0, start, rows)?;
        same_bits(&dropout(&part, 0.3, keyed)?, &want, "kernel")?;
        same_bits(&dropout_composite(&part, 0.3, keyed)?, &want, "composite")?;
        // Without the offset the slice draws the first rows' mask instead.
        if start > 0 {
            assert_ne!(bits(&dropout(&part, 0.3, key)?)?, bits(&want)?);
        }
    }
    Ok(())
}
