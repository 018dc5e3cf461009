//! The optimiser step through Amp against plain computations.

mod common;

use candle_amp::{Amp, MasterWeights, ScalerConfig, SkipReason, StepOutcome, WeightMode};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::seeded_var;
use test_support::compare::values;
use test_support::random::{rng, uniform};

/// A two-layer MLP with a softmax cross-entropy loss; weights cast to `dt` in the forward.
struct Mlp {
    w1: Var,
    w2: Var,
}

impl Mlp {
    fn new(seed: u64, d_in: usize, d_hid: usize, d_out: usize, dev: &Device) -> Self {
        Self {
            w1: seeded_var(seed, &[d_in, d_hid], dev),
            w2: seeded_var(seed + 1, &[d_hid, d_out], dev),
        }
    }

    fn copy(&self) -> anyhow::Result<Self> {
        Ok(Self {
            w1: Var::from_tensor(&self.w1.as_tensor().copy()?)?,
            w2: Var::from_tensor(&self.w2.as_tensor().copy()?)?,
        })
    }

    fn named(&self) -> Vec<(String, Var)> {
        vec![
            ("w1".into(), self.w1.clone()),
            ("w2".into(), self.w2.clone()),
        ]
    }

    fn loss_with(
        &self,
        w1: &Tensor,
        w2: &Tensor,
        x: &Tensor,
        y: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let dt = w1.dtype();
        let h = x.to_dtype(dt)?.matmul(w1)?.tanh()?;
        let logits = h.matmul(w2)?.to_dtype(DType::F32)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        candle_nn::loss::nll(&logp, y)
    }

    fn loss(&self, dt: DType, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let w1 = self.w1.as_tensor().to_dtype(dt)?;
        let w2 = self.w2.as_tensor().to_dtype(dt)?;
        self.loss_with(&w1, &w2, x, y)
    }
}

fn data(seed: u64, n: usize, d_in: usize, d_out: usize, dev: &Device) -> (Tensor, Tensor) {
    let x = uniform(&mut rng(seed), &[n, d_in], -2.0, 2.0, dev);
    let y: Vec<u32> = (0..n as u32)
        .map(|i| (i * 7 + seed as u32) % d_out as u32)
        .collect();
    (x, Tensor::from_vec(y, n, dev).expect("targets"))
}

const SHAPES: [(usize, usize, usize, usize); 3] = [(8, 4, 16, 3), (5, 7, 9, 5), (16, 32, 24, 10)];

/// With f32 compute and a power-of-two scale, scaling commutes exactly with every rounding
/// (no f32 overflow or subnormals at these magnitudes), so Amp's AdamW trajectory must equal
/// plain AdamW bit for bit: tolerance 0.
#[test]
fn master_step_equals_plain_f32_step() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (seed, (n, d_in, d_hid, d_out)) in SHAPES.iter().enumerate() {
        let seed = seed as u64 * 10;
        let plain = Mlp::new(seed, *d_in, *d_hid, *d_out, &dev);
        let mixed = plain.copy()?;
        let params = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let mut opt_p = AdamW::new(vec![plain.w1.clone(), plain.w2.clone()], params.clone())?;
        let mw = MasterWeights::new(mixed.named(), DType::F32, WeightMode::Cast)?;
        let mut amp = Amp::new(mw, ScalerConfig::dynamic().growth_interval(2))?;
        let mut opt_m = AdamW::new(amp.master_vars(), params)?;
        for step in 0..5 {
            let (x, y) = data(seed + step, *n, *d_in, *d_out, &dev);
            opt_p.backward_step(&plain.loss(DType::F32, &x, &y)?)?;
            let o = amp.step(&mut opt_m, &amp.backward(&mixed.loss(DType::F32, &x, &y)?)?)?;
            assert!(o.is_applied());
        }
        assert!(amp.scale() > 65536.0, "growth happened");
        assert_eq!(values(mixed.w1.as_tensor()), values(plain.w1.as_tensor()));
        assert_eq!(values(mixed.w2.as_tensor()), values(plain.w2.as_tensor()));
    }
    Ok(())
}

/// Compute copies and compute-time casts run the same f16 forward and backward, so they
/// must produce bit-identical masters (tolerance 0); the copies are refreshed every step.
#[test]
fn copies_equal_casts_in_f16_and_bf16() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for dt in [DType::F16, DType::BF16] {
        let (n, d_in, d_hid, d_out) = SHAPES[1];
        let a = Mlp::new(3, d_in, d_hid, d_out, &dev);
        let b = a.copy()?;
        let mut amp_a = Amp::new(
            MasterWeights::new(a.named(), dt, WeightMode::Cast)?,
            ScalerConfig::dynamic(),
        )?;
        let wb = MasterWeights::new(b.named(), dt, WeightMode::Copies)?;
        let (c1, c2) = (
            wb.compute_var("w1").expect("c").clone(),
            wb.compute_var("w2").expect("c").clone(),
        );
        let mut amp_b = Amp::new(wb, ScalerConfig::dynamic())?;
        let mut opt_a = AdamW::new_lr(amp_a.master_vars(), 1e-2)?;
        let mut opt_b = AdamW::new_lr(amp_b.master_vars(), 1e-2)?;
        for step in 0..4 {
            let (x, y) = data(step, n, d_in, d_out, &dev);
            let oa = amp_a.step(&mut opt_a, &amp_a.backward(&a.loss(dt, &x, &y)?)?)?;
            let lb = b.loss_with(c1.as_tensor(), c2.as_tensor(), &x, &y)?;
            let ob = amp_b.step(&mut opt_b, &amp_b.backward(&lb)?)?;
            assert_eq!(oa, ob);
        }
        assert_eq!(values(a.w1.as_tensor()), values(b.w1.as_tensor()));
        assert_eq!(values(a.w2.as_tensor()), values(b.w2.as_tensor()));
        // Refreshed copies hold the masters rounded to the compute dtype.
        assert_eq!(
            values(c1.as_tensor()),
            values(&b.w1.as_tensor().to_dtype(dt)?)
        );
    }
    Ok(())
}

/// Clipping is applied to the unscaled gradients: the update must equal plain f32 clipping
/// (`g * min(1, max / (norm + 1e-6))`, SGD). Tolerance: the reference norm is computed in f64
/// on the host, Amp's in f32 on the device (relative difference ~1e-7), so the clip factor
/// and the weights agree to 1e-6 relative.
#[test]
fn clipping_on_unscaled_grads_equals_plain_clipping() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let lr = 0.5;
    for (seed, (n, d_in, d_hid, d_out)) in SHAPES.iter().enumerate() {
        let seed = seed as u64 + 40;
        let plain = Mlp::new(seed, *d_in, *d_hid, *d_out, &dev);
        let mixed = plain.copy()?;
        let (x, y) = data(seed, *n, *d_in, *d_out, &dev);
        let grads = plain.loss(DType::F32, &x, &y)?.backward()?;
        let gs: Vec<Vec<f64>> = [&plain.w1, &plain.w2]
            .iter()
            .map(|w| values(grads.get(w.as_tensor()).expect("grad")))
            .collect();
        let norm = gs.iter().flatten().map(|g| g.powi(2)).sum::<f64>().sqrt();
        let max_norm = norm * 0.3;
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        let expect: Vec<Vec<f64>> = [&plain.w1, &plain.w2]
            .iter()
            .zip(&gs)
            .map(|(w, g)| {
                values(w.as_tensor())
                    .iter()
                    .zip(g)
                    .map(|(w, g)| w - lr * coef * g)
                    .collect()
            })
            .collect();

        let mw = MasterWeights::new(mixed.named(), DType::F32, WeightMode::Cast)?;
        let mut amp =
            Amp::new(mw, ScalerConfig::static_scale(1024.0))?.with_clip_norm(Some(max_norm))?;
        let mut opt = candle_nn::SGD::new(amp.master_vars(), lr)?;
        let o = amp.step(&mut opt, &amp.backward(&mixed.loss(DType::F32, &x, &y)?)?)?;
        let StepOutcome::Applied {
            grad_norm,
            clip_coef,
            ..
        } = o
        else {
            panic!("{o:?}")
        };
        assert!(
            (grad_norm - norm).abs() / norm < 1e-6,
            "{grad_norm} vs {norm}"
        );
        assert!((clip_coef - coef).abs() < 1e-6 && clip_coef < 0.31);
        for (w, e) in [&mixed.w1, &mixed.w2].iter().zip(&expect) {
            for (a, b) in values(w.as_tensor()).iter().zip(e) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
    }
    Ok(())
}

/// Recompute-until-finite: the same batch's backward is re-run at lower scales until finite.
/// `b`'s f16 gradient is `4 * scale`, finite only for scale <= 8192 (f16 max 65504).
#[test]
fn recompute_until_finite() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let run =
        |retries: u32, init: f64, loss_api: bool| -> anyhow::Result<(StepOutcome, Vec<f64>, Amp)> {
            let a = seeded_var(1, &[3, 4], &dev);
            let b = seeded_var(2, &[5], &dev);
            let x = uniform(&mut rng(3), &[3, 4], -0.5, 0.5, &dev);
            let named = [("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
            let mw = MasterWeights::new(named, DType::F16, WeightMode::Cast)?;
            let mut amp = Amp::new(mw, ScalerConfig::dynamic().init_scale(init))?;
            let mut opt = candle_nn::SGD::new(amp.master_vars(), 0.1)?;
            // One forward; the graph stays alive, the closure only re-runs the backward.
            let la = (a.as_tensor().to_dtype(DType::F16)? * x.to_dtype(DType::F16)?)?.sum_all()?;
            let lb = b
                .as_tensor()
                .to_dtype(DType::F16)?
                .affine(4.0, 0.0)?
                .sum_all()?;
            let loss = (la.to_dtype(DType::F32)? + lb.to_dtype(DType::F32)?)?;
            let mut scales = Vec::new();
            let o = if loss_api {
                scales = vec![65536.0, 32768.0, 16384.0, 8192.0];
                amp.step_recompute_loss(&mut opt, &loss, retries)?
            } else {
                amp.step_recompute(&mut opt, retries, |s| {
                    scales.push(s);
                    loss.affine(s, 0.0)?.backward()
                })?
            };
            let mut w = values(a.as_tensor());
            w.extend(values(b.as_tensor()));
            if retries == 5 {
                assert_eq!(scales, [65536.0, 32768.0, 16384.0, 8192.0]);
            }
            Ok((o, w, amp))
        };
    let (o, w, amp) = run(5, 65536.0, false)?;
    assert!(
        matches!(
            o,
            StepOutcome::Applied {
                retries: 3,
                scale: 8192.0,
                step: 0,
                ..
            }
        ),
        "{o:?}"
    );
    let st = amp.state();
    assert_eq!(
        (st.steps, st.applied, st.skipped, st.overflows),
        (1, 1, 0, 3)
    );
    // The loss-based API does the same.
    let (o4, w4, _) = run(5, 65536.0, true)?;
    assert_eq!(o4, o);
    assert_eq!(w4, w);
    // Same result as a plain step started at the scale that worked.
    let (o2, w2, _) = run(0, 8192.0, false)?;
    assert!(o2.is_applied());
    assert_eq!(w, w2);
    // Bounded retries.
    let (o3, _, amp3) = run(1, 65536.0, false)?;
    match o3 {
        StepOutcome::Skipped {
            reason,
            scale_before,
            scale_after,
            retries,
            nonfinite_params,
            ..
        } => {
            assert_eq!(reason, SkipReason::RetriesExhausted);
            assert_eq!((scale_before, scale_after, retries), (32768.0, 16384.0, 1));
            assert_eq!(nonfinite_params, ["b"]);
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(amp3.state().skipped, 1);
    Ok(())
}

/// Parameters without a gradient are simply not handed to the optimiser.
#[test]
fn params_without_grad_are_left_alone() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (a, b) = (seeded_var(1, &[4], &dev), seeded_var(2, &[4], &dev));
    let named = [("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
    let cfg = ScalerConfig::dynamic().init_scale(1024.0);
    let mut amp = Amp::new(
        MasterWeights::new(named, DType::F16, WeightMode::Cast)?,
        cfg,
    )?;
    let loss = a.as_tensor().to_dtype(DType::F16)?.sum_all()?;
    let mut keys = 0;
    let o = amp.step_with(&amp.backward(&loss)?, |g: &GradStore| {
        keys = g.get_ids().count();
        assert!(g.get(b.as_tensor()).is_none());
        Ok(())
    })?;
    assert!(o.is_applied());
    assert_eq!(keys, 1);
    Ok(())
}
