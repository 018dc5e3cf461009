//! Cross-entropy: the fused op against the composite reference (loss and logits gradient, with
//! and without mask / ignore_index), the fallback path, 16-bit logits, finite differences, NaN
//! propagation, the all-zero mask, target validation and thread-count independence.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3)):
//! * f64: 1e-10: the same log-sum-exp, summed in a different order (8 lanes vs Candle's sum).
//! * f32: 1e-5: that reordering, and the kernel's exp (< 1 ulp) vs Candle's.
//! * bf16 / f16 logits: the loss (f32) 1e-5 against the composite on the same values widened to
//!   f32 (the kernel reads them exactly); the gradient 2e-2 / 4e-3, about two units of the
//!   format's rounding.
//! * finite differences (f64, h = 1e-5): 1e-6.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::cross_entropy::{cross_entropy, cross_entropy_composite};
use common::*;

/// Targets, mask and ignore index of one case.
struct Labels {
    targets: Tensor,
    mask: Option<Tensor>,
    ignore: Option<u32>,
}

impl Labels {
    /// Random targets for `logits` of `shape`; with `ignore`, about a quarter of the rows get
    /// the ignore index; with a mask, weights in [0, 2) with about a fifth exact zeros.
    fn new(shape: &[usize], mask: bool, ignore: Option<u32>, rng: &mut Lcg) -> Result<Self> {
        let (&v, lead) = shape.split_last().unwrap_or((&1, &[]));
        let n: usize = lead.iter().product();
        let t: Vec<u32> = (0..n)
            .map(|_| match ignore {
                Some(ig) if rng.below(4) == 0 => ig,
                _ => rng.below(v) as u32,
            })
            .collect();
        let targets = Tensor::from_vec(t, lead, &Device::Cpu)?;
        let mask = if mask {
            let w: Vec<f32> = (0..n)
                .map(|_| {
                    if rng.below(5) == 0 {
                        0.0
                    } else {
                        (rng.next() + 1.0) as f32
                    }
                })
                .collect();
            Some(Tensor::from_vec(w, lead, &Device::Cpu)?)
        } else {
            None
        };
        Ok(Self {
            targets,
            mask,
            ignore,
        })
    }

    fn fused(&self) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> + '_ {
        move |t: &[Tensor]| cross_entropy(&t[0], &self.targets, self.mask.as_ref(), self.ignore)
    }

    fn reference(&self) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> + '_ {
        move |t: &[Tensor]| {
            cross_entropy_composite(&t[0], &self.targets, self.mask.as_ref(), self.ignore)
        }
    }
}

const SHAPES: [&[usize]; 8] = [
    &[1, 1],
    &[3, 65],
    &[127, 257],
    &[1, 257],
    &[3, 1],
    &[2, 3, 7],
    &[65],
    &[127, 65],
];

/// (mask, ignore_index) options; `V / 2` as an in-range ignore index is filled in per shape.
fn options(v: usize) -> [(bool, Option<u32>); 5] {
    [
        (false, None),
        (true, None),
        (false, Some(u32::MAX)),
        (false, Some((v / 2) as u32)),
        (true, Some(u32::MAX)),
    ]
}

fn logits(shape: &[usize], dt: DType, rng: &mut Lcg) -> Result<Tensor> {
    rand(shape, dt, rng, 4.0, 0.0)
}

#[test]
fn matches_composite_f64_and_f32() -> Result<()> {
    let mut rng = Lcg(1);
    for (dt, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        for shape in SHAPES {
            for (mask, ignore) in options(shape[shape.len() - 1]) {
                let lab = Labels::new(shape, mask, ignore, &mut rng)?;
                let ins = [logits(shape, dt, &mut rng)?];
                let probe = rand(&[], dt, &mut rng, 1.0, 0.5)?;
                let (y, g) = value_and_grads(&lab.fused(), &ins, &probe)?;
                let (yr, gr) = value_and_grads(&lab.reference(), &ins, &probe)?;
                let what = format!("{dt:?} {shape:?} mask {mask} ignore {ignore:?}");
                assert_eq!((y.dtype(), y.rank()), (dt, 0), "{what}");
                assert_close(&y, &yr, tol, &format!("{what} loss"))?;
                assert_eq!(g[0].dtype(), dt);
                assert_close(&g[0], &gr[0], tol, &format!("{what} grad"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg(2);
    for (dt, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        for shape in [&[3usize, 65][..], &[2, 3, 7], &[127, 257], &[65]] {
            for (mask, ignore) in options(shape[shape.len() - 1]) {
                let lab = Labels::new(shape, mask, ignore, &mut rng)?;
                let ins = [logits(shape, dt, &mut rng)?];
                let probe = rand(&[], dt, &mut rng, 1.0, 0.5)?;
                let what = format!("fallback {dt:?} {shape:?} mask {mask} ignore {ignore:?}");
                assert_fallback_matches(&lab.fused(), &ins, &probe, tol, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_close_to_f32_composite() -> Result<()> {
    let mut rng = Lcg(3);
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        for shape in [&[3usize, 65][..], &[33, 257]] {
            for (mask, ignore) in options(shape[shape.len() - 1]) {
                let lab = Labels::new(shape, mask, ignore, &mut rng)?;
                let ins = [logits(shape, dt, &mut rng)?];
                let probe = Tensor::new(1.5f32, &Device::Cpu)?;
                let (y, g) = value_and_grads(&lab.fused(), &ins, &probe)?;
                let (yr, gr) =
                    value_and_grads(&lab.reference(), &[ins[0].to_dtype(DType::F32)?], &probe)?;
                let what = format!("{dt:?} {shape:?} mask {mask} ignore {ignore:?}");
                assert_eq!((y.dtype(), y.rank()), (DType::F32, 0), "{what}");
                assert_close(&y, &yr, 1e-5, &format!("{what} loss"))?;
                assert_eq!(g[0].dtype(), dt);
                assert_close(&g[0], &gr[0].to_dtype(dt)?, tol, &format!("{what} grad"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(4);
    for shape in [&[3usize, 7][..], &[2, 2, 5], &[1, 1], &[9]] {
        for (mask, ignore) in options(shape[shape.len() - 1]) {
            let lab = Labels::new(shape, mask, ignore, &mut rng)?;
            let ins = [logits(shape, DType::F64, &mut rng)?];
            check_fd(&lab.fused(), &ins, 40 + shape.len() as u64)?;
        }
    }
    Ok(())
}

#[test]
fn all_zero_weights_give_zero_loss_and_gradient() -> Result<()> {
    let mut rng = Lcg(5);
    let shape = [5usize, 33];
    let x = logits(&shape, DType::F32, &mut rng)?;
    let t = Tensor::new(&[1u32, 2, 3, 4, 5], &Device::Cpu)?;
    let zeros = Tensor::zeros(5, DType::F32, &Device::Cpu)?;
    let all_ignored = Tensor::new(&[7u32; 5], &Device::Cpu)?;
    for fallback in [false, true] {
        for (targets, mask, ignore) in [(&t, Some(&zeros), None), (&all_ignored, None, Some(7u32))]
        {
            let xv = Var::from_tensor(&x)?;
            let (l, g) = fallback_if(fallback, || -> Result<_> {
                let l = cross_entropy(xv.as_tensor(), targets, mask, ignore)?;
                Ok((l.to_scalar::<f32>()?, l.backward()?))
            })?;
            assert_eq!(l, 0.0, "fallback {fallback}");
            let g = values(g.get(xv.as_tensor()).expect("gradient"));
            assert!(
                g.iter().all(|v| *v == 0.0),
                "fallback {fallback}: nonzero gradient"
            );
        }
    }
    // The reference agrees.
    let r = cross_entropy_composite(&x, &t, Some(&zeros), None)?.to_scalar::<f32>()?;
    assert_eq!(r, 0.0);
    Ok(())
}

#[test]
fn nan_propagates_from_counted_rows_only() -> Result<()> {
    let mut rng = Lcg(6);
    let (rows, v) = (9usize, 65usize);
    for dt in [DType::F32, DType::F64, DType::BF16] {
        for fallback in [false, true] {
            let idx = 1 + rng.below(rows * v - 1);
            let row = idx / v;
            // Row `row` is counted, row `other` is ignored (target 99) and holds a NaN too.
            let other = (row + 1 + rng.below(rows - 1)) % rows;
            let mut t: Vec<u32> = (0..rows).map(|_| rng.below(v) as u32).collect();
            t[other] = 99;
            let targets = Tensor::from_vec(t, rows, &Device::Cpu)?;
            let mut xv = values(&logits(&[rows, v], DType::F64, &mut rng)?);
            xv[other * v + rng.below(v)] = f64::NAN;
            let clean = Tensor::from_vec(xv.clone(), (rows, v), &Device::Cpu)?.to_dtype(dt)?;
            xv[idx] = f64::NAN;
            let dirty = Tensor::from_vec(xv, (rows, v), &Device::Cpu)?.to_dtype(dt)?;
            let what = format!("{dt:?} fallback {fallback} NaN at {idx}, ignored row {other}");
            let run = |x: &Tensor| -> Result<(f64, Vec<f64>)> {
                let xv = Var::from_tensor(x)?;
                let loss = cross_entropy(xv.as_tensor(), &targets, None, Some(99))?;
                let g = loss.backward()?;
                Ok((
                    values(&loss)[0],
                    values(g.get(xv.as_tensor()).expect("gradient")),
                ))
            };
            let (r_clean, r_dirty) = fallback_if(fallback, || (run(&clean), run(&dirty)));
            let ((l_clean, g_clean), (l_dirty, g_dirty)) = (r_clean?, r_dirty?);
            // The NaN in the ignored row is skipped...
            assert!(l_clean.is_finite(), "{what}: loss {l_clean}");
            assert!(
                g_clean.iter().all(|x| x.is_finite()),
                "{what}: clean gradient"
            );
            assert!(
                g_clean[other * v..(other + 1) * v]
                    .iter()
                    .all(|x| *x == 0.0),
                "{what}"
            );
            // ...the one in a counted row is not.
            assert!(l_dirty.is_nan(), "{what}: loss {l_dirty}");
            for r in 0..rows {
                let n = g_dirty[r * v..(r + 1) * v]
                    .iter()
                    .filter(|x| x.is_nan())
                    .count();
                assert_eq!(n, if r == row { v } else { 0 }, "{what}: NaNs in row {r}");
            }
        }
    }
    Ok(())
}

#[test]
fn rejects_bad_targets_and_shapes() -> Result<()> {
    let x = Tensor::zeros((3, 5), DType::F32, &Device::Cpu)?;
    let bad = Tensor::new(&[0u32, 5, 1], &Device::Cpu)?;
    for fallback in [false, true] {
        let (e, ok) = fallback_if(fallback, || {
            (
                cross_entropy(&x, &bad, None, None),
                cross_entropy(&x, &bad, None, Some(5)),
            )
        });
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("target 5 (row 1) is out of range for 5 classes"),
            "{e}"
        );
        assert!((ok?.to_scalar::<f32>()? - 5f32.ln()).abs() < 1e-6);
    }
    let e = cross_entropy(&x, &Tensor::new(&[0u32, 1], &Device::Cpu)?, None, None).unwrap_err();
    assert!(e.to_string().contains("leading shape"), "{e}");
    let e = cross_entropy(&x, &Tensor::new(&[0i64, 1, 2], &Device::Cpu)?, None, None).unwrap_err();
    assert!(e.to_string().contains("u32"), "{e}");
    let t = Tensor::new(&[0u32, 1, 2], &Device::Cpu)?;
    let m = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let e = cross_entropy(&x, &t, Some(&m), None).unwrap_err();
    assert!(e.to_string().contains("mask"), "{e}");
    let empty = Tensor::zeros((3, 0), DType::F32, &Device::Cpu)?;
    assert!(cross_entropy(&empty, &t, None, None).is_err());
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let mut rng = Lcg(7);
    // 320 rows of 1000 logits: 320,000 elements, over PAR_MIN_WORK.
    let shape = [4usize, 80, 1000];
    assert!(shape.iter().product::<usize>() > PAR_MIN_WORK);
    for dt in [DType::F32, DType::BF16, DType::F64] {
        for (mask, ignore) in options(1000) {
            let lab = Labels::new(&shape, mask, ignore, &mut rng)?;
            let ins = [logits(&shape, dt, &mut rng)?];
            let probe = rand(&[], dt, &mut rng, 1.0, 0.5)?;
            assert_same_bits_on_thread_counts(
                &lab.fused(),
                &ins,
                &probe,
                &format!("{dt:?} mask {mask} ignore {ignore:?}"),
            )?;
        }
    }
    Ok(())
}
