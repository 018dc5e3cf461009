//! Scale dynamics: injected overflow, growth, hysteresis, collapse, static scaling.

mod common;

use candle_amp::{
    Amp, AmpError, CollapsePolicy, MasterWeights, Plain, ScaleChange, ScaledUpdate, ScalerConfig,
    SkipReason, StepOutcome, WeightMode,
};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use common::{poisoned, seeded_var, Record};
use test_support::compare::values;
use test_support::random::{rng, uniform};

/// Two parameters: `a` gets gradient `x` (small), `b` gets gradient `k` everywhere, both
/// computed in f16, so `b`'s scaled gradient `k * scale` overflows f16 (max 65504) when
/// `k * scale > 65504`.
fn model(dev: &Device, k: f32) -> (Var, Var, Tensor, f32) {
    let a = seeded_var(1, &[3, 4], dev);
    let b = seeded_var(2, &[5], dev);
    let x = uniform(&mut rng(3), &[3, 4], 0.0, 0.5, dev);
    (a, b, x, k)
}

fn loss(a: &Var, b: &Var, x: &Tensor, k: f32) -> anyhow::Result<Tensor> {
    let a16 = a.as_tensor().to_dtype(DType::F16)?;
    let b16 = b.as_tensor().to_dtype(DType::F16)?;
    let la = (a16 * x.to_dtype(DType::F16)?)?.sum_all()?;
    let lb = b16.affine(f64::from(k), 0.0)?.sum_all()?;
    Ok((la.to_dtype(DType::F32)? + lb.to_dtype(DType::F32)?)?)
}

fn amp_for(a: &Var, b: &Var, cfg: ScalerConfig) -> anyhow::Result<Amp> {
    let w = MasterWeights::new(
        [("a".to_string(), a.clone()), ("b".to_string(), b.clone())],
        DType::F16,
        WeightMode::Cast,
    )?;
    Ok(Amp::new(w, cfg)?)
}

/// One step over injected gradients: `a`'s gradient is all ones, or holds a NaN when
/// `overflow`; the update records its coefficients.
fn inject(amp: &mut Amp, a: &Var, overflow: bool, rec: &mut Record) -> anyhow::Result<StepOutcome> {
    let dev = a.device();
    let bad = if overflow { f32::NAN } else { 1.0 };
    let mut g = GradStore::default();
    g.insert(a.as_tensor(), poisoned(a.dims(), 1.0, bad, 5, dev));
    Ok(amp.step(&g, rec)?)
}

/// The scale change a step made.
fn change(o: &StepOutcome) -> ScaleChange {
    match o {
        StepOutcome::Applied { change, .. } | StepOutcome::Skipped { change, .. } => *change,
    }
}

#[test]
fn injected_overflow_skips_backs_off_and_reports() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    // k = 4: scaled gradient 4 * scale overflows f16 for scale >= 16384 (65536 > 65504).
    // Start at 2^15: at 2^16 the upstream gradient of `a`'s f16 branch (= scale) overflows too.
    let (a, b, x, k) = model(&dev, 4.0);
    let mut amp = amp_for(&a, &b, ScalerConfig::dynamic().init_scale(32768.0))?;
    let mut opt = candle_nn::SGD::new(amp.weights().master_vars(), 0.1)?;
    let (a0, b0) = (values(a.as_tensor()), values(b.as_tensor()));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let grads = amp.backward(&loss(&a, &b, &x, k)?)?;
        seen.push(amp.step(&grads, &mut Plain(&mut opt))?);
        if seen.len() < 3 {
            // Skipped steps leave the weights bit-identical.
            assert_eq!(values(a.as_tensor()), a0);
            assert_eq!(values(b.as_tensor()), b0);
        }
    }
    for (i, o) in seen.iter().take(2).enumerate() {
        let before = 32768.0 / f64::from(1u32 << i);
        assert_eq!(
            o,
            &StepOutcome::Skipped {
                step: i as u64,
                reason: SkipReason::NonFiniteGradients,
                scale_before: before,
                scale_after: before / 2.0,
                change: ScaleChange::BackedOff,
                nonfinite_params: vec!["b".to_string()],
            }
        );
    }
    assert_eq!(
        seen[0].to_string(),
        "step 0: skipped (NonFiniteGradients), scale 32768 -> 16384, non-finite gradients in b"
    );
    match &seen[2] {
        StepOutcome::Applied { scale, .. } => assert_eq!(*scale, 8192.0),
        o => panic!("expected applied, got {o:?}"),
    }
    // b's unscaled gradient is exactly k, so SGD moved it by exactly 0.1 * 4 (in f32).
    let b1 = values(b.as_tensor());
    for (x0, x1) in b0.iter().zip(&b1) {
        assert_eq!(*x1, f64::from(*x0 as f32 - 0.1f32 * 4.0));
    }
    let st = amp.state();
    assert_eq!(
        (st.steps, st.applied, st.skipped, st.backoffs),
        (3, 1, 2, 2)
    );
    assert_eq!(st.consecutive_skips, 0);
    Ok(())
}

#[test]
fn nan_and_inf_are_detected_and_named() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b) = (seeded_var(1, &[2, 3], &dev), seeded_var(2, &[4], &dev));
    let mut amp = amp_for(&a, &b, ScalerConfig::none())?;
    let mut rec = Record::default();
    let mut step = |g: &GradStore| -> anyhow::Result<Vec<String>> {
        match amp.step(g, &mut rec)? {
            StepOutcome::Skipped {
                nonfinite_params, ..
            } => Ok(nonfinite_params),
            o => panic!("applied non-finite gradients: {o}"),
        }
    };
    // The bad value sits at a seeded random index other than 0 (see `poisoned`).
    for seed in 0..8 {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut g = GradStore::default();
            g.insert(a.as_tensor(), Tensor::zeros((2, 3), DType::F32, &dev)?);
            g.insert(b.as_tensor(), poisoned(&[4], 1.0, bad, seed, &dev));
            assert_eq!(step(&g)?, ["b"], "{bad} (seed {seed})");
        }
        // -inf in one and +inf in another: still caught (squares are +inf).
        let mut g = GradStore::default();
        g.insert(
            a.as_tensor(),
            poisoned(&[2, 3], 0.0, f32::NEG_INFINITY, seed, &dev),
        );
        g.insert(
            b.as_tensor(),
            poisoned(&[4], 0.0, f32::INFINITY, seed, &dev),
        );
        assert_eq!(step(&g)?, ["a", "b"]);
    }
    assert!(rec.coefs.is_empty(), "a skipped step reached the update");
    // Huge but finite gradients overflow the f32 sum of squares but are not an overflow.
    let mut g = GradStore::default();
    g.insert(a.as_tensor(), Tensor::full(3e30f32, (2, 3), &dev)?);
    let norm = amp.step(&g, &mut rec)?.grad_norm().expect("applied");
    let expect = 6f64.sqrt() * 3e30;
    assert!((norm - expect).abs() / expect < 1e-5, "{norm} vs {expect}");
    assert_eq!(rec.coefs, [1.0]);
    Ok(())
}

#[test]
fn growth_after_interval_and_max_scale() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b) = (seeded_var(1, &[2], &dev), seeded_var(2, &[2], &dev));
    let cfg = ScalerConfig::dynamic()
        .growth_interval(3)
        .max_scale(262144.0);
    let mut amp = amp_for(&a, &b, cfg)?;
    let mut rec = Record::default();
    let mut scales = Vec::new();
    for overflow in [
        false, false, false, false, true, false, false, false, false, false, false,
    ] {
        scales.push(inject(&mut amp, &a, overflow, &mut rec)?.next_scale());
    }
    let k = 65536.0;
    let expect = [
        k,
        k,
        2. * k,
        2. * k,
        k,
        k,
        k,
        2. * k,
        2. * k,
        2. * k,
        4. * k,
    ];
    assert_eq!(scales, expect);
    // Applied steps were unscaled by the scale they ran at.
    assert_eq!(rec.coefs[..4], [1.0 / k, 1.0 / k, 1.0 / k, 0.5 / k]);
    // Capped at max_scale.
    for _ in 0..3 {
        inject(&mut amp, &a, false, &mut rec)?;
    }
    assert_eq!(amp.scale(), 262144.0);
    assert_eq!(amp.state().growths, 3);
    // The PyTorch defaults: 2000 clean steps.
    let mut d = amp_for(&a, &b, ScalerConfig::dynamic())?;
    for _ in 0..1999 {
        inject(&mut d, &a, false, &mut rec)?;
    }
    assert_eq!(d.scale(), 65536.0);
    assert_eq!(
        change(&inject(&mut d, &a, false, &mut rec)?),
        ScaleChange::Grew
    );
    assert_eq!(d.scale(), 131072.0);
    Ok(())
}

#[test]
fn hysteresis_delays_backoff() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b) = (seeded_var(1, &[2], &dev), seeded_var(2, &[2], &dev));
    let mut rec = Record::default();
    let cfg = ScalerConfig::dynamic().hysteresis(3).growth_interval(2);
    let mut s = amp_for(&a, &b, cfg.clone())?;
    let mut step = |amp: &mut Amp, overflow: bool| -> anyhow::Result<ScaleChange> {
        Ok(change(&inject(amp, &a, overflow, &mut rec)?))
    };
    let ch: Vec<ScaleChange> = (0..4)
        .map(|_| step(&mut s, true))
        .collect::<anyhow::Result<_>>()?;
    use ScaleChange::*;
    assert_eq!(
        ch,
        [HysteresisAbsorbed, HysteresisAbsorbed, BackedOff, BackedOff]
    );
    assert_eq!(s.scale(), 16384.0);
    // Non-consecutive: a clean step does not refill, a growth does.
    assert_eq!(step(&mut s, false)?, Unchanged);
    assert_eq!(step(&mut s, true)?, BackedOff);
    assert_eq!(step(&mut s, false)?, Unchanged);
    assert_eq!(step(&mut s, false)?, Grew);
    assert_eq!(s.state().hysteresis_left, 3);
    assert_eq!(step(&mut s, true)?, HysteresisAbsorbed);
    // Consecutive: one clean step refills.
    let mut c = amp_for(&a, &b, cfg.consecutive_hysteresis(true))?;
    for _ in 0..3 {
        step(&mut c, true)?;
    }
    assert_eq!(c.scale(), 32768.0);
    step(&mut c, false)?;
    assert_eq!(step(&mut c, true)?, HysteresisAbsorbed);
    // Every overflow is a skipped step even when the scale holds.
    assert_eq!(c.state().skipped, 4);
    Ok(())
}

#[test]
fn collapse_errors_with_diagnosis_or_continues() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b) = (seeded_var(1, &[2, 2], &dev), seeded_var(2, &[3], &dev));
    let bad = |dev: &Device| -> anyhow::Result<GradStore> {
        let mut g = GradStore::default();
        g.insert(a.as_tensor(), Tensor::ones((2, 2), DType::F32, dev)?);
        g.insert(b.as_tensor(), poisoned(&[3], 1.0, f32::NAN, 7, dev));
        Ok(g)
    };
    let cfg = ScalerConfig::dynamic().init_scale(8.0).min_scale(4.0);
    let mut amp = amp_for(&a, &b, cfg.clone())?;
    let mut rec = Record::default();
    let o = amp.step(&bad(&dev)?, &mut rec)?;
    assert_eq!(o.next_scale(), 4.0);
    match amp.step(&bad(&dev)?, &mut rec) {
        Err(AmpError::ScaleCollapse {
            step,
            scale,
            min_scale,
            consecutive_skips,
            nonfinite_params,
            diagnosis,
        }) => {
            assert_eq!(
                (step, scale, min_scale, consecutive_skips),
                (1, 4.0, 4.0, 2)
            );
            assert_eq!(nonfinite_params, ["b"]);
            assert!(
                diagnosis.contains("NaN") && diagnosis.contains('b'),
                "{diagnosis}"
            );
        }
        other => panic!("expected collapse error, got {other:?}"),
    }
    assert_eq!(amp.state().skipped, 2);
    // Continue: keeps the minimum scale and reports.
    let mut amp = amp_for(&a, &b, cfg.collapse_policy(CollapsePolicy::Continue))?;
    amp.step(&bad(&dev)?, &mut rec)?;
    for step in 1..3 {
        let o = amp.step(&bad(&dev)?, &mut rec)?;
        assert!(matches!(
            o,
            StepOutcome::Skipped { reason: SkipReason::ScaleCollapsed, scale_before: 4.0, scale_after: 4.0, step: s, .. } if s == step
        ));
    }
    assert!(rec.coefs.is_empty(), "a skipped step reached the update");
    Ok(())
}

#[test]
fn static_scaler_skips_without_changing_scale() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b, x, _) = model(&dev, 0.0);
    let mut amp = amp_for(&a, &b, ScalerConfig::static_scale(16384.0))?;
    let mut opt = candle_nn::SGD::new(amp.weights().master_vars(), 0.1)?;
    let o = amp.step(
        &amp.backward(&loss(&a, &b, &x, 4.0)?)?,
        &mut Plain(&mut opt),
    )?;
    assert!(matches!(
        o,
        StepOutcome::Skipped {
            scale_after: 16384.0,
            change: ScaleChange::Unchanged,
            ..
        }
    ));
    let o = amp.step(
        &amp.backward(&loss(&a, &b, &x, 0.5)?)?,
        &mut Plain(&mut opt),
    )?;
    assert!(o.is_applied());
    assert_eq!(amp.scale(), 16384.0);
    Ok(())
}

#[test]
fn invalid_configs_are_rejected() -> anyhow::Result<()> {
    let a = seeded_var(1, &[2], &Device::Cpu);
    let weights = MasterWeights::new([("a".to_string(), a)], DType::F16, WeightMode::Cast)?;
    for cfg in [
        ScalerConfig::dynamic().init_scale(0.0),
        ScalerConfig::dynamic().backoff_factor(1.0),
        ScalerConfig::dynamic().growth_factor(0.5),
        ScalerConfig::dynamic().growth_interval(0),
        ScalerConfig::dynamic().hysteresis(0),
        ScalerConfig::dynamic().min_scale(10.0).init_scale(2.0),
        ScalerConfig::dynamic().max_scale(f64::INFINITY),
    ] {
        let r = Amp::new(weights.clone(), cfg);
        assert!(matches!(r, Err(AmpError::Config(_))));
    }
    let r = Amp::new(weights, ScalerConfig::none())?.with_clip_norm(Some(0.0));
    assert!(matches!(r, Err(AmpError::Config(_))));
    Ok(())
}

/// SGD that computes the norm with its own reduction and multiplies each gradient by the
/// coefficient as it reads it (what a fused AdamW does).
struct FusedSgd {
    lr: f64,
    norms: usize,
}

impl ScaledUpdate for FusedSgd {
    type Error = candle_core::Error;

    fn grad_norm(&mut self, grads: &GradStore, vars: &[Var]) -> candle_core::Result<f64> {
        self.norms += 1;
        let parts: Vec<Tensor> = vars
            .iter()
            .filter_map(|v| grads.get(v))
            .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all())
            .collect::<candle_core::Result<_>>()?;
        let sq = Tensor::stack(&parts, 0)?.sum_all()?.sqrt()?;
        Ok(f64::from(sq.to_scalar::<f32>()?))
    }

    fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> candle_core::Result<()> {
        for v in vars {
            if let Some(g) = grads.get(v) {
                v.set(&v.as_tensor().sub(&g.affine(self.lr * coef, 0.0)?)?)?;
            }
        }
        Ok(())
    }
}

/// A fused update (its own norm, the coefficient applied by itself) makes the same decisions
/// and the same update as `Plain` SGD: a clean step applies `lr * coef * grad`, an overflow
/// skips, names the parameter and backs off. Tolerance: the two norms are reduced in another
/// order (1e-5 relative), the weights agree to 1e-6.
#[test]
fn fused_update_matches_plain() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b, x, k) = model(&dev, 4.0);
    let (a2, b2) = (
        Var::from_tensor(&a.as_tensor().copy()?)?,
        Var::from_tensor(&b.as_tensor().copy()?)?,
    );
    let cfg = ScalerConfig::dynamic().init_scale(32768.0);
    let mut amp = amp_for(&a, &b, cfg.clone())?.with_clip_norm(Some(0.5))?;
    let mut fused = amp_for(&a2, &b2, cfg)?.with_clip_norm(Some(0.5))?;
    let mut opt = candle_nn::SGD::new(amp.weights().master_vars(), 0.1)?;
    let mut sgd = FusedSgd { lr: 0.1, norms: 0 };
    for step in 0..4 {
        let grads = amp.backward(&loss(&a, &b, &x, k)?)?;
        let want = amp.step(&grads, &mut Plain(&mut opt))?;
        let got = fused.step(&fused.backward(&loss(&a2, &b2, &x, k)?)?, &mut sgd)?;
        assert_eq!(want.is_applied(), got.is_applied(), "step {step}");
        match (&want, &got) {
            (
                StepOutcome::Skipped {
                    nonfinite_params: n1,
                    scale_after: s1,
                    ..
                },
                StepOutcome::Skipped {
                    nonfinite_params: n2,
                    scale_after: s2,
                    ..
                },
            ) => assert_eq!((n1, s1), (n2, s2), "step {step}"),
            (
                StepOutcome::Applied { grad_norm: n1, .. },
                StepOutcome::Applied { grad_norm: n2, .. },
            ) => {
                assert!(
                    (n1 - n2).abs() <= 1e-5 * n1,
                    "step {step}: norm {n1} vs {n2}"
                )
            }
            _ => unreachable!(),
        }
        for (p, q) in [(&a, &a2), (&b, &b2)] {
            let (p, q) = (values(p.as_tensor()), values(q.as_tensor()));
            for (u, v) in p.iter().zip(&q) {
                assert!(
                    (u - v).abs() <= 1e-6 * u.abs().max(1.0),
                    "step {step}: {u} vs {v}"
                );
            }
        }
    }
    assert!(fused.state().skipped > 0 && fused.state().applied > 0);
    assert_eq!(sgd.norms, 4, "one norm per step");
    Ok(())
}
