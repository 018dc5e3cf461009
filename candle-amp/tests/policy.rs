//! PrecisionPolicy helpers against the plain computations.

mod common;

use candle_amp::PrecisionPolicy;
use candle_core::{DType, Device, Tensor, Var, D};
use common::seeded_var;
use test_support::compare::{tensor_diff, values};
use test_support::random::{rng, uniform};

const SHAPES: [&[usize]; 3] = [&[4, 8], &[2, 3, 16], &[1, 5, 7, 33]];

/// In f32 the helpers are the textbook formulas: they must agree with candle-nn's
/// differentiable reference ops up to f32 rounding of a differently ordered computation
/// (values are O(1): 1e-5 absolute).
#[test]
fn f32_helpers_match_candle_reference_ops() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let p = PrecisionPolicy::full_f32();
    for (i, shape) in SHAPES.iter().enumerate() {
        let s = i as u64 * 10;
        let c = *shape.last().expect("dim");
        let x = uniform(&mut rng(s), shape, -3.0, 3.0, &dev);
        let g = uniform(&mut rng(s + 1), &[c], 0.5, 1.5, &dev);
        let b = uniform(&mut rng(s + 2), &[c], -0.5, 0.5, &dev);
        let ln = p.layer_norm(&x, &g, Some(&b), 1e-5)?;
        let reference = candle_nn::ops::layer_norm_slow(&x, &g, &b, 1e-5)?;
        assert!(tensor_diff(&ln, &reference).max_abs < 1e-5);
        let rms = p.rms_norm(&x, &g, 1e-6)?;
        let reference = candle_nn::ops::rms_norm_slow(&x, &g, 1e-6)?;
        assert!(tensor_diff(&rms, &reference).max_abs < 1e-5);
        let sm = p.softmax(&x, D::Minus1)?;
        let reference = candle_nn::ops::softmax(&x, D::Minus1)?;
        assert_eq!(values(&sm), values(&reference));
    }
    // Cross-entropy equals candle-nn's on the same f32 logits.
    let logits = uniform(&mut rng(5), &[6, 9], -2.0, 2.0, &dev);
    let y = Tensor::new(&[0u32, 3, 8, 1, 1, 5], &dev)?;
    let ce = p.cross_entropy(&logits, &y)?;
    let reference = candle_nn::loss::cross_entropy(&logits, &y)?;
    assert_eq!(ce.to_scalar::<f32>()?, reference.to_scalar::<f32>()?);
    Ok(())
}

/// Mixed policy: outputs come back in the compute dtype, and the f32 islands are closer to the
/// f32 result than the same op done entirely in f16.
#[test]
fn mixed_policy_keeps_f32_islands() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mixed = PrecisionPolicy::mixed(DType::F16);
    let pure = PrecisionPolicy::pure(DType::F16);
    let exact = PrecisionPolicy::full_f32();
    for (i, shape) in SHAPES.iter().enumerate() {
        let s = 100 + i as u64;
        let c = *shape.last().expect("dim");
        // Large offset: variance in f16 suffers from cancellation.
        let x = (uniform(&mut rng(s), shape, -1.0, 1.0, &dev) + 200.0)?;
        let g = Tensor::ones(c, DType::F32, &dev)?;
        let b = Tensor::zeros(c, DType::F32, &dev)?;
        let x16 = x.to_dtype(DType::F16)?;
        // Reference on the f16-rounded input, so only the computation's precision differs.
        let want16 = exact.layer_norm(&x16.to_dtype(DType::F32)?, &g, Some(&b), 1e-5)?;
        let m = mixed.layer_norm(&x16, &g, Some(&b), 1e-5)?;
        let p = pure.layer_norm(&x16, &g, Some(&b), 1e-5)?;
        assert_eq!(m.dtype(), DType::F16);
        let (em, ep) = (
            tensor_diff(&m, &want16).max_abs,
            tensor_diff(&p, &want16).max_abs,
        );
        // Mixed: only the final f16 rounding of O(1) outputs (2^-11 * 4).
        assert!(em < 2e-3, "mixed error {em}");
        assert!(
            ep > 10.0 * em,
            "pure f16 should be much worse: {ep} vs {em}"
        );
    }
    // Reductions: an f16 accumulation of 10k ones stalls at 2048; the f32 island does not.
    let ones = Tensor::ones(10_000, DType::F16, &dev)?;
    let m = mixed
        .sum_keepdim(&ones, 0)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?[0];
    assert_eq!(m, 10_000.0);
    let p = pure
        .sum_keepdim(&ones, 0)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?[0];
    assert_ne!(p, 10_000.0, "f16 accumulation is expected to lose counts");
    Ok(())
}

/// Gradients flow through every helper to an f32 master used via `policy.weight`.
#[test]
fn helpers_are_differentiable_to_f32_masters() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for dt in [DType::F16, DType::BF16, DType::F32] {
        let p = PrecisionPolicy::mixed(dt);
        let w: Var = seeded_var(1, &[8, 8], &dev);
        let g: Var = Var::from_tensor(&Tensor::ones(8, DType::F32, &dev)?)?;
        let x = p.cast(&uniform(&mut rng(2), &[4, 8], -1.0, 1.0, &dev))?;
        let h = x.matmul(&p.weight(w.as_tensor())?)?;
        let h = p.layer_norm(&h, &p.weight(g.as_tensor())?, None, 1e-5)?;
        let h = p.rms_norm(&h, &p.weight(g.as_tensor())?, 1e-6)?;
        let h = p.softmax(&h, D::Minus1)?;
        let h = p.log_softmax(&h, D::Minus1)?;
        let y = Tensor::new(&[1u32, 2, 3, 4], &dev)?;
        let loss = p.cross_entropy(&h, &y)?;
        assert_eq!(loss.dtype(), DType::F32);
        let grads = loss.backward()?;
        for v in [&w, &g] {
            let gr = grads
                .get(v.as_tensor())
                .expect("gradient reaches the master");
            assert_eq!(gr.dtype(), DType::F32);
            assert!(
                values(gr).iter().any(|x| *x != 0.0),
                "{dt:?}: zero gradient"
            );
        }
    }
    Ok(())
}
