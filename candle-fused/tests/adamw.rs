//! Fused AdamW against the composite reference, fallback, thread independence, NaN handling,
//! sum of squares / global norm / clip coefficient; the multi-tensor forms against the
//! per-tensor ones, bit for bit.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::adamw::{
    adamw_composite, adamw_update, adamw_update_multi, clip_coefficient, global_norm,
    sum_of_squares, sum_of_squares_multi, AdamWParam, AdamWStep,
};
use common::{
    assert_same_on_thread_counts, f32s, fallback_if, randn, with_fallback, Lcg31, PAR_MIN_WORK,
};

/// |a - b| <= rel * |b| + rel * max|b| elementwise (NaN-aware: NaN only matches NaN).
fn assert_close(a: &Tensor, b: &Tensor, rel: f32, what: &str) -> Result<()> {
    let (a, b) = (f32s(a)?, f32s(b)?);
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || (x - y).abs() <= rel * (y.abs() + scale);
        assert!(ok, "{what}: element {i}: {x} vs {y}");
    }
    Ok(())
}

fn step(step: usize, wd: f64, gs: f64) -> AdamWStep {
    AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: wd,
        step,
        grad_scale: gs,
    }
}

/// Runs `steps` fused steps and the composite reference side by side from the same start,
/// comparing param, exp_avg and exp_avg_sq after every step.
fn run_vs_composite(shape: &[usize], gdtype: DType, wd: f64, gs: f64, seed: u64) -> Result<()> {
    let mut rng = Lcg31(seed);
    let p0 = randn(shape, DType::F32, &mut rng, 1.0)?;
    let param = Var::from_tensor(&p0)?;
    let m = p0.zeros_like()?;
    let v = p0.zeros_like()?;
    let (mut rp, mut rm, mut rv) = (p0.clone(), p0.zeros_like()?, p0.zeros_like()?);
    // A second handle to the moments' storage: must see the in-place update.
    let m_alias = m.clone();
    for t in 1..=5 {
        let g = randn(shape, gdtype, &mut rng, 0.1)?;
        let s = step(t, wd, gs);
        adamw_update(&param, &g, &m, &v, &s)?;
        (rp, rm, rv) = adamw_composite(&rp, &g, &rm, &rv, &s)?;
        // f32 rounding: the kernel performs the composite's operations in the same order, so
        // it agrees to ~1 ulp; allow 1e-6 relative (plus 1e-6 of the tensor's max for values
        // near 0).
        let what = format!("{shape:?} {gdtype:?} wd={wd} gs={gs} step {t}");
        assert_close(param.as_tensor(), &rp, 1e-6, &format!("param {what}"))?;
        assert_close(&m, &rm, 1e-6, &format!("exp_avg {what}"))?;
        assert_close(&v, &rv, 1e-6, &format!("exp_avg_sq {what}"))?;
    }
    assert_eq!(f32s(&m_alias)?, f32s(&m)?, "exp_avg updated in place");
    assert!(f32s(param.as_tensor())? != f32s(&p0)?, "param changed");
    Ok(())
}

#[test]
fn fused_matches_composite() -> Result<()> {
    let shapes: &[&[usize]] = &[&[1], &[7], &[33, 65], &[127, 3], &[4099], &[3, 5, 7]];
    let mut seed = 1;
    for shape in shapes {
        for (wd, gs) in [(0.0, 1.0), (0.1, 1.0), (0.1, 0.37), (0.0, 2.5)] {
            seed += 1;
            run_vs_composite(shape, DType::F32, wd, gs, seed)?;
        }
    }
    Ok(())
}

#[test]
fn low_and_high_precision_gradients() -> Result<()> {
    for (i, dt) in [DType::BF16, DType::F16, DType::F64]
        .into_iter()
        .enumerate()
    {
        run_vs_composite(&[33, 65], dt, 0.1, 0.5, 100 + i as u64)?;
        run_vs_composite(&[7], dt, 0.0, 1.0, 200 + i as u64)?;
    }
    Ok(())
}

#[test]
fn large_tensor_matches_composite() -> Result<()> {
    // Crosses the parallel threshold.
    run_vs_composite(&[3 * PAR_MIN_WORK + 7], DType::F32, 0.1, 0.8, 9)
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg31(42);
    let shape = [65, 33];
    let p0 = randn(&shape, DType::F32, &mut rng, 1.0)?;
    let grads: Vec<Tensor> = (0..3)
        .map(|_| randn(&shape, DType::BF16, &mut rng, 0.1))
        .collect::<Result<_>>()?;
    let run = |force: bool| -> Result<Vec<Vec<f32>>> {
        fallback_if(force, || {
            let p = Var::from_tensor(&p0)?;
            let (m, v) = (p0.zeros_like()?, p0.zeros_like()?);
            for (t, g) in grads.iter().enumerate() {
                adamw_update(&p, g, &m, &v, &step(t + 1, 0.1, 0.7))?;
            }
            Ok(vec![f32s(p.as_tensor())?, f32s(&m)?, f32s(&v)?])
        })
    };
    let (k, f) = (run(false)?, run(true)?);
    for (a, b) in k.iter().zip(&f) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }
    Ok(())
}

#[test]
fn identical_for_any_thread_count() -> Result<()> {
    let n = 3 * PAR_MIN_WORK + 4097;
    let mut rng = Lcg31(7);
    let p0 = randn(&[n], DType::F32, &mut rng, 1.0)?;
    let g = randn(&[n], DType::F32, &mut rng, 0.1)?;
    let g2 = randn(&[n], DType::F16, &mut rng, 0.1)?;
    assert_same_on_thread_counts("adamw", || {
        let p = Var::from_tensor(&p0)?;
        let (m, v) = (p0.zeros_like()?, p0.zeros_like()?);
        adamw_update(&p, &g, &m, &v, &step(1, 0.1, 0.9))?;
        adamw_update(&p, &g2, &m, &v, &step(2, 0.1, 0.9))?;
        let ss = sum_of_squares(&g)?.to_scalar::<f32>()?.to_bits();
        Ok((bits(p.as_tensor())?, bits(&m)?, bits(&v)?, ss))
    })
}

#[test]
fn nan_gradient_poisons_only_its_element() -> Result<()> {
    // A NaN gradient element makes m, v and the parameter NaN at that index only (every
    // element is updated independently); +inf gives NaN there too (inf / inf).
    let mut rng = Lcg31(11);
    let n = 1000;
    for bad in [f32::NAN, f32::INFINITY] {
        let i = 1 + rng.below(n - 1);
        let p = Var::from_tensor(&randn(&[n], DType::F32, &mut rng, 1.0)?)?;
        let (m, v) = (p.zeros_like()?, p.zeros_like()?);
        let mut g = rng.normal_vec(n, 0.1);
        g[i] = bad;
        let g = Tensor::from_vec(g, n, &Device::Cpu)?;
        adamw_update(&p, &g, &m, &v, &step(1, 0.1, 1.0))?;
        let nan_at = |t: &Tensor| -> Result<Vec<usize>> {
            Ok(f32s(t)?
                .iter()
                .enumerate()
                .filter(|(_, x)| !x.is_finite())
                .map(|(j, _)| j)
                .collect())
        };
        assert_eq!(nan_at(p.as_tensor())?, vec![i], "param, bad={bad}");
        assert_eq!(nan_at(&m)?, vec![i], "exp_avg, bad={bad}");
        assert_eq!(nan_at(&v)?, vec![i], "exp_avg_sq, bad={bad}");
        assert!(f32s(p.as_tensor())?[i].is_nan());
    }
    Ok(())
}

/// Asserts that `r` is an error whose message contains `what`.
fn fails_with(r: candle_core::Result<()>, what: &str) {
    match r {
        Ok(()) => panic!("expected an error about {what:?}"),
        Err(e) => assert!(e.to_string().contains(what), "{what:?} not in {e}"),
    }
}

#[test]
fn argument_errors() -> Result<()> {
    let dev = Device::Cpu;
    let p = Var::zeros((2, 3), DType::F32, &dev)?;
    let z = p.zeros_like()?;
    let fresh = || p.zeros_like();
    let ok = step(1, 0.0, 1.0);
    adamw_update(&p, &z, &fresh()?, &fresh()?, &ok)?;
    // Operands sharing storage are rejected before anything is written.
    let m = Tensor::ones((2, 3), DType::F32, &dev)?;
    fails_with(adamw_update(&p, &z, &m, &m.clone(), &ok), "share storage");
    fails_with(adamw_update(&p, &z, &z.clone(), &m, &ok), "share storage");
    assert_eq!(f32s(&m)?, vec![1.0; 6], "nothing written");
    let g_bad = Tensor::zeros((3, 2), DType::F32, &dev)?;
    let m64 = Tensor::zeros((2, 3), DType::F64, &dev)?;
    let p64 = Var::zeros((2, 3), DType::F64, &dev)?;
    let gi = Tensor::zeros((2, 3), DType::U32, &dev)?;
    let mt = Tensor::zeros((3, 2), DType::F32, &dev)?.t()?;
    for (param, grad, exp_avg, msg) in [
        (&p, &g_bad, &m, "grad has shape"),
        (&p, &z, &m64, "exp_avg must be f32"),
        (&p64, &m64, &m, "param must be f32"),
        (&p, &gi, &m, "grad must be a float"),
        (&p, &z, &mt, "contiguous"),
    ] {
        fails_with(adamw_update(param, grad, exp_avg, &fresh()?, &ok), msg);
    }
    for (bad, msg) in [
        (AdamWStep { step: 0, ..ok }, "1-based"),
        (AdamWStep { beta1: 1.0, ..ok }, "betas"),
        (AdamWStep { beta2: -0.1, ..ok }, "betas"),
        (AdamWStep { lr: f64::NAN, ..ok }, ">= 0"),
        (AdamWStep { eps: -1.0, ..ok }, ">= 0"),
    ] {
        fails_with(adamw_update(&p, &z, &m, &fresh()?, &bad), msg);
    }
    // A strided gradient is accepted (copied first).
    let gt = Tensor::ones((3, 2), DType::F32, &dev)?.t()?;
    let (m, v) = (fresh()?, fresh()?);
    adamw_update(&p, &gt, &m, &v, &ok)?;
    assert!(f32s(&m)?.iter().all(|&x| (x - 0.1).abs() < 1e-7));
    Ok(())
}

#[test]
fn sum_of_squares_and_global_norm() -> Result<()> {
    let mut rng = Lcg31(5);
    let a = randn(&[33, 65], DType::F32, &mut rng, 1.0)?;
    let b = randn(&[3 * PAR_MIN_WORK + 5], DType::F32, &mut rng, 0.5)?;
    let c = randn(&[7], DType::BF16, &mut rng, 2.0)?;
    let exact =
        |t: &Tensor| -> Result<f64> { Ok(f32s(t)?.iter().map(|&x| (x as f64) * (x as f64)).sum()) };
    // f64 accumulation, rounded once to f32: ~1e-7 relative (allow 1e-6).
    for t in [&a, &b, &c] {
        let s = sum_of_squares(t)?;
        assert_eq!(s.dtype(), DType::F32);
        assert_eq!(s.rank(), 0);
        let (got, want) = (s.to_scalar::<f32>()? as f64, exact(t)?);
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    }
    let f64t = a.to_dtype(DType::F64)?;
    let got = sum_of_squares(&f64t)?.to_scalar::<f32>()? as f64;
    assert!((got - exact(&a)?).abs() <= 1e-6 * got);
    // Fallback path.
    let fb = with_fallback(|| sum_of_squares(&b))?.to_scalar::<f32>()? as f64;
    assert!((fb - exact(&b)?).abs() <= 1e-5 * fb, "fallback {fb}");

    let want = (exact(&a)? + exact(&b)? + exact(&c)?).sqrt();
    let got = global_norm(&[&a, &b, &c])? as f64;
    assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    assert_eq!(global_norm(&[])?, 0.0);

    // NaN or +inf at a random index of the second tensor: a non-finite norm.
    let n = b.elem_count();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut vals = f32s(&b)?;
        let i = 1 + rng.below(n - 1);
        vals[i] = bad;
        let bb = Tensor::from_vec(vals, n, &Device::Cpu)?;
        let norm = global_norm(&[&a, &bb, &c])?;
        assert!(!norm.is_finite(), "bad={bad}: {norm}");
        if bad.is_nan() {
            assert!(norm.is_nan());
        }
    }
    Ok(())
}

#[test]
fn clip_coefficient_like_pytorch() {
    assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
    // Like PyTorch, the 1e-6 makes a norm equal to max_norm clip very slightly.
    assert_eq!(clip_coefficient(1.0, 1.0), 1.0 / (1.0 + 1e-6));
    let c = clip_coefficient(10.0, 1.0);
    assert!((c - 1.0 / (10.0 + 1e-6)).abs() < 1e-15, "{c}");
    assert_eq!(clip_coefficient(10.0, 0.0), 1.0);
    assert_eq!(clip_coefficient(10.0, -1.0), 1.0);
    assert_eq!(clip_coefficient(f32::INFINITY, 1.0), 0.0);
    assert!(clip_coefficient(f32::NAN, 1.0).is_nan());
}

/// The bits of a tensor (as f32).
fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(f32s(t)?.iter().map(|v| v.to_bits()).collect())
}

/// One parameter's tensors: param, grad, exp_avg, exp_avg_sq (moments after a few steps).
type Member = (Var, Tensor, Tensor, Tensor);

fn member(shape: &[usize], gdtype: DType, rng: &mut Lcg31) -> Result<Member> {
    let p = Var::from_tensor(&randn(shape, DType::F32, rng, 1.0)?)?;
    let g = randn(shape, DType::F32, rng, 0.3)?.to_dtype(gdtype)?;
    let m = randn(shape, DType::F32, rng, 0.1)?;
    let v = randn(shape, DType::F32, rng, 0.1)?.sqr()?;
    Ok((p, g, m, v))
}

fn copy(a: &Member) -> Result<Member> {
    let p = Var::from_tensor(&a.0.as_tensor().copy()?)?;
    Ok((p, a.1.copy()?, a.2.copy()?, a.3.copy()?))
}

/// A group of odd-sized tensors (one past the parallel threshold, scalars, mixed gradient
/// dtypes) stepped by `adamw_update_multi` and tensor by tensor by `adamw_update`, three
/// steps with clipping and decay on some members: every bit of every result agrees; so do
/// `sum_of_squares_multi` and the per-tensor sums added in order, and `global_norm`.
#[test]
fn multi_tensor_matches_per_tensor_bit_for_bit() -> Result<()> {
    let mut rng = Lcg31(77);
    let shapes: [(&[usize], DType); 6] = [
        (&[PAR_MIN_WORK + 3001], DType::F32),
        (&[1], DType::F32),
        (&[37, 29], DType::BF16),
        (&[5], DType::F16),
        (&[3, 1001], DType::F32),
        (&[2, 3, 7], DType::F64),
    ];
    let multi: Vec<Member> = (shapes.iter())
        .map(|(s, dt)| member(s, *dt, &mut rng))
        .collect::<Result<_>>()?;
    let single: Vec<Member> = multi.iter().map(copy).collect::<Result<_>>()?;
    for k in 1..=3 {
        let s = step(k, 0.1, 0.7);
        let group: Vec<AdamWParam> = (multi.iter().enumerate())
            .map(|(i, (p, g, m, v))| AdamWParam {
                param: p,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                decay: i % 2 == 0,
            })
            .collect();
        adamw_update_multi(&group, &s)?;
        for (i, (p, g, m, v)) in single.iter().enumerate() {
            let wd = if i % 2 == 0 { 0.1 } else { 0.0 };
            adamw_update(p, g, m, v, &step(k, wd, 0.7))?;
        }
        for (i, (a, b)) in multi.iter().zip(&single).enumerate() {
            assert_eq!(
                bits(a.0.as_tensor())?,
                bits(b.0.as_tensor())?,
                "param {i}, step {k}"
            );
            assert_eq!(bits(&a.2)?, bits(&b.2)?, "exp_avg {i}, step {k}");
            assert_eq!(bits(&a.3)?, bits(&b.3)?, "exp_avg_sq {i}, step {k}");
        }
    }
    let grads: Vec<&Tensor> = multi.iter().map(|a| &a.1).collect();
    let mut sum = sum_of_squares(grads[0])?;
    for g in &grads[1..] {
        sum = (sum + sum_of_squares(g)?)?;
    }
    let got = sum_of_squares_multi(&grads)?.expect("a group");
    assert_eq!(
        got.to_scalar::<f32>()?.to_bits(),
        sum.to_scalar::<f32>()?.to_bits()
    );
    let norm = global_norm(&grads)?;
    assert_eq!(norm.to_bits(), sum.to_scalar::<f32>()?.sqrt().to_bits());
    assert!(sum_of_squares_multi(&[])?.is_none());
    adamw_update_multi(&[], &step(1, 0.0, 1.0))?;
    Ok(())
}

/// A bad group fails before anything is written, naming the member.
#[test]
fn multi_tensor_argument_errors() -> Result<()> {
    let dev = Device::Cpu;
    let p = Var::ones((2, 3), DType::F32, &dev)?;
    let q = Var::ones(4, DType::F32, &dev)?;
    let z = || p.zeros_like();
    let (g, m, v) = (z()?, z()?, z()?);
    let (gq, mq, vq) = (q.zeros_like()?, q.zeros_like()?, q.zeros_like()?);
    let a = AdamWParam {
        param: &p,
        grad: &g,
        exp_avg: &m,
        exp_avg_sq: &v,
        decay: true,
    };
    let b = AdamWParam {
        param: &q,
        grad: &gq,
        exp_avg: &mq,
        exp_avg_sq: &vq,
        decay: true,
    };
    let s = step(1, 0.1, 1.0);
    // the same parameter twice
    fails_with(
        adamw_update_multi(&[a, b, a], &s),
        "tensors 0 and 2 overlap",
    );
    // a bad member (its grad the wrong shape), after a good one that must stay untouched
    let bad = AdamWParam { grad: &g, ..b };
    let e = adamw_update_multi(&[a, bad], &s).expect_err("a shape mismatch");
    assert!(format!("{e:#}").contains("tensor 1"), "{e:#}");
    assert_eq!(p.as_tensor().flatten_all()?.to_vec1::<f32>()?, [1.0; 6]);
    // non-overlapping views of one storage are fine (gradients narrowed from one buffer);
    // overlapping ones are not
    let flat = Tensor::ones(10, DType::F32, &dev)?;
    let (g0, g1, g2) = (
        flat.narrow(0, 0, 4)?,
        flat.narrow(0, 4, 4)?,
        flat.narrow(0, 2, 4)?,
    );
    let q2 = Var::ones(4, DType::F32, &dev)?;
    let (mq2, vq2) = (q2.zeros_like()?, q2.zeros_like()?);
    let c = AdamWParam { grad: &g0, ..b };
    let d = AdamWParam {
        param: &q2,
        grad: &g1,
        exp_avg: &mq2,
        exp_avg_sq: &vq2,
        decay: true,
    };
    adamw_update_multi(&[c, d], &s)?;
    let e = AdamWParam { grad: &g2, ..d };
    fails_with(adamw_update_multi(&[c, e], &s), "overlap");
    Ok(())
}
