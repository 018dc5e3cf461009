//! The optimiser step through Amp against plain computations.

mod common;

use std::fmt;

use candle_amp::{
    Amp, AmpError, MasterWeights, Plain, ScaledUpdate, ScalerConfig, StepOutcome, WeightMode,
};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::{seeded_var, Record};
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
        let mut opt_m = AdamW::new(amp.weights().master_vars(), params)?;
        for step in 0..5 {
            let (x, y) = data(seed + step, *n, *d_in, *d_out, &dev);
            opt_p.backward_step(&plain.loss(DType::F32, &x, &y)?)?;
            let grads = amp.backward(&mixed.loss(DType::F32, &x, &y)?)?;
            let o = amp.step(&grads, &mut Plain(&mut opt_m))?;
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
        let mut opt_a = AdamW::new_lr(amp_a.weights().master_vars(), 1e-2)?;
        let mut opt_b = AdamW::new_lr(amp_b.weights().master_vars(), 1e-2)?;
        for step in 0..4 {
            let (x, y) = data(step, n, d_in, d_out, &dev);
            let oa = amp_a.step(
                &amp_a.backward(&a.loss(dt, &x, &y)?)?,
                &mut Plain(&mut opt_a),
            )?;
            let lb = b.loss_with(c1.as_tensor(), c2.as_tensor(), &x, &y)?;
            let ob = amp_b.step(&amp_b.backward(&lb)?, &mut Plain(&mut opt_b))?;
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
        let mut opt = candle_nn::SGD::new(amp.weights().master_vars(), lr)?;
        let grads = amp.backward(&mixed.loss(DType::F32, &x, &y)?)?;
        let o = amp.step(&grads, &mut Plain(&mut opt))?;
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

/// A caller retries a skipped step by running the backward of the same loss again at the new
/// scale (Candle keeps the graph alive while the loss lives): the retried step equals a step
/// started at the scale that worked, bit for bit. `b`'s f16 gradient is `4 * scale`, finite
/// only for scale <= 8192 (f16 max 65504).
#[test]
fn retry_after_a_skip_equals_a_step_at_the_lower_scale() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let run = |init: f64| -> anyhow::Result<(Vec<StepOutcome>, Vec<f64>)> {
        let (a, b) = (seeded_var(1, &[3, 4], &dev), seeded_var(2, &[5], &dev));
        let x = uniform(&mut rng(3), &[3, 4], -0.5, 0.5, &dev);
        let named = [("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let mw = MasterWeights::new(named, DType::F16, WeightMode::Cast)?;
        let mut amp = Amp::new(mw, ScalerConfig::dynamic().init_scale(init))?;
        let mut opt = candle_nn::SGD::new(amp.weights().master_vars(), 0.1)?;
        let la = (a.as_tensor().to_dtype(DType::F16)? * x.to_dtype(DType::F16)?)?.sum_all()?;
        let lb = b.as_tensor().to_dtype(DType::F16)?.affine(4.0, 0.0)?;
        let loss = (la.to_dtype(DType::F32)? + lb.sum_all()?.to_dtype(DType::F32)?)?;
        let mut outcomes = Vec::new();
        while outcomes.last().is_none_or(StepOutcome::is_skipped) {
            outcomes.push(amp.step(&amp.backward(&loss)?, &mut Plain(&mut opt))?);
        }
        let mut w = values(a.as_tensor());
        w.extend(values(b.as_tensor()));
        Ok((outcomes, w))
    };
    let (retried, w) = run(65536.0)?;
    let scales: Vec<f64> = retried.iter().map(StepOutcome::next_scale).collect();
    assert_eq!(scales, [32768.0, 16384.0, 8192.0, 8192.0]);
    let (direct, w2) = run(8192.0)?;
    assert_eq!(direct.len(), 1);
    assert_eq!(w, w2);
    Ok(())
}

/// An update that records which variables had a gradient.
struct Seen(Vec<bool>);

impl ScaledUpdate for Seen {
    type Error = candle_core::Error;

    fn apply(&mut self, grads: &GradStore, vars: &[Var], _: f64) -> candle_core::Result<()> {
        self.0 = vars.iter().map(|v| grads.get(v).is_some()).collect();
        Ok(())
    }
}

/// Parameters without a gradient are handed to the update without one (it leaves them
/// alone), in registration order.
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
    let mut seen = Seen(Vec::new());
    assert!(amp.step(&amp.backward(&loss)?, &mut seen)?.is_applied());
    assert_eq!(seen.0, [true, false]);
    Ok(())
}

/// An update that checks it is handed the backward's own gradient (not a copy).
struct Same(Tensor, Vec<f64>);

impl ScaledUpdate for Same {
    type Error = candle_core::Error;

    fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> candle_core::Result<()> {
        let g = grads.get(&vars[0]).expect("gradient");
        assert_eq!(g.id(), self.0.id(), "the update got a copy");
        self.1.push(coef);
        Ok(())
    }
}

/// f32 with `ScalerConfig::none()` is a no-op scaler (PyTorch's `GradScaler(enabled=False)`):
/// the update gets the backward's gradients themselves with coefficient exactly 1 (or exactly
/// the clip coefficient), and Amp with `Plain(AdamW)` equals plain AdamW bit for bit.
#[test]
fn f32_without_scaling_is_a_no_op() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (n, d_in, d_hid, d_out) = SHAPES[2];
    let plain = Mlp::new(5, d_in, d_hid, d_out, &dev);
    let mixed = plain.copy()?;
    let mut opt_p = AdamW::new_lr(vec![plain.w1.clone(), plain.w2.clone()], 1e-2)?;
    let mw = MasterWeights::new(mixed.named(), DType::F32, WeightMode::Cast)?;
    let mut amp = Amp::new(mw, ScalerConfig::none())?;
    let mut opt_m = AdamW::new_lr(amp.weights().master_vars(), 1e-2)?;
    for step in 0..4 {
        let (x, y) = data(step, n, d_in, d_out, &dev);
        opt_p.backward_step(&plain.loss(DType::F32, &x, &y)?)?;
        let grads = amp.backward(&mixed.loss(DType::F32, &x, &y)?)?;
        let mut same = Same(grads.get(mixed.w1.as_tensor()).expect("g").clone(), vec![]);
        let o = amp.clone().step(&grads, &mut same)?;
        assert_eq!((o.next_scale(), same.1.as_slice()), (1.0, &[1.0][..]));
        assert!(amp.step(&grads, &mut Plain(&mut opt_m))?.is_applied());
    }
    assert_eq!(values(mixed.w1.as_tensor()), values(plain.w1.as_tensor()));
    assert_eq!(values(mixed.w2.as_tensor()), values(plain.w2.as_tensor()));
    // With clipping, the coefficient is exactly the clip coefficient.
    let mut clipped = amp.with_clip_norm(Some(1e-3))?;
    let (x, y) = data(9, n, d_in, d_out, &dev);
    let grads = clipped.backward(&mixed.loss(DType::F32, &x, &y)?)?;
    let mut same = Same(grads.get(mixed.w1.as_tensor()).expect("g").clone(), vec![]);
    let StepOutcome::Applied { clip_coef, .. } = clipped.step(&grads, &mut same)? else {
        panic!("skipped")
    };
    assert!(clip_coef < 1.0);
    assert_eq!(same.1, [clip_coef]);
    Ok(())
}

/// A norm can overflow f32 (squares past 3.4e38) while every gradient is finite: the step is
/// then applied with the norm recomputed scaled down, not skipped as non-finite.
#[test]
fn applies_when_only_the_norm_overflows() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::new(&[0f32, 0.0, 0.0], &dev)?)?;
    let weights = MasterWeights::new([("w".into(), w.clone())], DType::F32, WeightMode::Cast)?;
    let mut amp = Amp::new(weights, ScalerConfig::none())?.with_clip_norm(Some(1.0))?;
    // grad = (0, 3e20, 4e20): finite, its norm 5e20 is too, but its square is not.
    let g = Tensor::new(&[0f32, 3e20, 4e20], &dev)?;
    let grads = (w.as_tensor() * &g)?.sum_all()?.backward()?;
    assert!(g.sqr()?.sum_all()?.to_scalar::<f32>()?.is_infinite());
    let mut rec = Record::default();
    match amp.step(&grads, &mut rec)? {
        StepOutcome::Applied { grad_norm, .. } => {
            assert!((grad_norm / 5e20 - 1.0).abs() < 1e-5, "norm {grad_norm}")
        }
        other => panic!("skipped a finite step: {other:?}"),
    }
    let [coef] = rec.coefs[..] else {
        panic!("{:?}", rec.coefs)
    };
    assert!((coef * 5e20 - 1.0).abs() < 1e-5, "clip coefficient {coef}");
    Ok(())
}

/// An update's own error type.
#[derive(Debug)]
enum UpdateError {
    Candle(candle_core::Error),
    OutOfMemory { needed: usize },
}

impl fmt::Display for UpdateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Candle(e) => e.fmt(f),
            Self::OutOfMemory { needed } => write!(f, "out of memory ({needed} bytes needed)"),
        }
    }
}

impl std::error::Error for UpdateError {}

impl From<candle_core::Error> for UpdateError {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(e)
    }
}

/// Computes the norm (the default), then fails to apply.
struct Failing;

impl ScaledUpdate for Failing {
    type Error = UpdateError;

    fn apply(&mut self, _: &GradStore, _: &[Var], _: f64) -> Result<(), UpdateError> {
        Err(UpdateError::OutOfMemory { needed: 42 })
    }
}

/// An update's error reaches the caller as `AmpError::Update` with the update's own error
/// as its cause (not formatted into a string), and the failed step is not counted.
#[test]
fn update_errors_keep_their_cause() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = seeded_var(1, &[3], &dev);
    let weights = MasterWeights::new([("w".into(), w.clone())], DType::F32, WeightMode::Cast)?;
    let mut amp = Amp::new(weights, ScalerConfig::none())?;
    let grads = amp.backward(&w.as_tensor().sum_all()?)?;
    let err = amp
        .step(&grads, &mut Failing)
        .expect_err("the update fails");
    let cause = std::error::Error::source(&err).expect("a cause");
    assert!(
        matches!(
            cause.downcast_ref::<UpdateError>(),
            Some(UpdateError::OutOfMemory { needed: 42 })
        ),
        "{err:?}"
    );
    assert!(matches!(err, AmpError::Update(_)));
    assert_eq!(amp.state().steps, 0);
    Ok(())
}
