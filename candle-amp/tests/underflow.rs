//! f16 gradient underflow: lost without loss scaling, kept with it.

mod common;

use candle_amp::{Amp, MasterWeights, ScaledUpdate, ScalerConfig, WeightMode};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::seeded_var;
use test_support::compare::values;
use test_support::random::{rng, uniform};

/// `loss = sum(w16 * a16) * 1e-5` with `a` in `[1e-3, 2e-3)`: the true gradient of `w` is
/// `a * 1e-5` (1e-8 .. 2e-8), below half the smallest f16 subnormal (2^-25 ~ 3e-8), so an
/// f16 backward flushes it to zero.
fn loss(w: &Var, a: &Tensor, mode_dtype: DType) -> candle_core::Result<Tensor> {
    let h = (w.as_tensor().to_dtype(mode_dtype)? * a.to_dtype(mode_dtype)?)?;
    h.to_dtype(DType::F32)?.affine(1e-5, 0.0)?.sum_all()
}

/// Keeps the gradient the optimiser would apply: `coef * grad` of the first variable.
#[derive(Default)]
struct Keep(Option<Tensor>);

impl ScaledUpdate for Keep {
    type Error = candle_core::Error;

    fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> candle_core::Result<()> {
        let g = grads.get(&vars[0]).expect("gradient");
        self.0 = Some(g.affine(coef, 0.0)?);
        Ok(())
    }
}

/// Runs one Amp step and returns the f32 gradient the optimiser applies.
fn amp_grad(w: &Var, a: &Tensor, cfg: ScalerConfig) -> anyhow::Result<Vec<f64>> {
    let mw = MasterWeights::new([("w".to_string(), w.clone())], DType::F16, WeightMode::Cast)?;
    let mut amp = Amp::new(mw, cfg)?;
    let grads = amp.backward(&loss(w, a, DType::F16)?)?;
    let mut keep = Keep::default();
    assert!(amp.step(&grads, &mut keep)?.is_applied());
    Ok(values(&keep.0.expect("gradient")))
}

#[test]
fn f16_underflow_lost_without_scaling_kept_with_it() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (seed, shape) in [(1u64, vec![64usize]), (2, vec![8, 16]), (3, vec![3, 5, 7])] {
        let w = seeded_var(seed, &shape, &dev);
        let a = uniform(&mut rng(seed + 100), &shape, 1e-3, 2e-3, &dev);
        // Reference gradient in f32.
        let reference = values(
            loss(&w, &a, DType::F32)?
                .backward()?
                .get(w.as_tensor())
                .expect("g"),
        );
        assert!(reference.iter().all(|g| *g > 5e-9));

        let unscaled = amp_grad(&w, &a, ScalerConfig::none())?;
        assert!(
            unscaled.iter().all(|g| *g == 0.0),
            "f16 gradients should underflow"
        );

        let scaled = amp_grad(&w, &a, ScalerConfig::dynamic())?;
        // Tolerance: the scaled f16 path rounds a (2^-11 relative), the upstream 1e-5 * 2^16
        // and the product (2^-11 each): < 3 * 2^-11 ~ 1.5e-3 relative; we allow 2e-3.
        for (g, r) in scaled.iter().zip(&reference) {
            let rel = ((g - r) / r).abs();
            assert!(rel < 2e-3, "scaled {g} vs reference {r} (rel {rel})");
        }
    }
    Ok(())
}
