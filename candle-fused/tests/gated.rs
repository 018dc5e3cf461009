//! The gated activations SwiGLU (`silu(gate) * up`) and GeGLU (`gelu_tanh(gate) * up`): each
//! fused op against its composite reference (values and both gradients, every dtype, odd and
//! strided shapes, the tails of the activation), the fallback path, finite differences, NaN
//! propagation, thread-count independence and rejected arguments; GeGLU also against the bits
//! of `gelu(gate) * up` from `candle_fused::gelu`.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3)):
//! * f64: 1e-12. The same formula on std's `exp` / `tanh`; the composite's terms in another
//!   order: a few ulp.
//! * f32: SwiGLU 1e-6: the kernel's `exp_f32` (< 1 ulp) against libm's `expf` puts the sigmoid
//!   within ~2 ulp, `y` within ~4 ulp (~5e-7 relative) of the composite's. GeGLU 1e-5 (as
//!   `tests/gelu.rs`): the kernel's `tanh_f32` differs from Candle's by ~1-2 ulp, which the
//!   backward's `1 - t^2` turns into ~1e-7 absolute at |g| ~ 3.
//! * bf16 / f16 against the composite in the same dtype (which also computes in f32 and rounds
//!   once): 8e-3 / 1e-3, one unit of the format's rounding (the two f32 values, a few f32 ulp
//!   apart, can straddle a rounding boundary).
//! * finite differences (f64, h = 1e-5): 1e-6 (truncation ~h^2, roundoff ~1e-16/h).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_fused::geglu::{geglu, geglu_composite};
use candle_fused::gelu::gelu;
use candle_fused::swiglu::{swiglu, swiglu_composite};
use common::*;

type Pair = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;
/// An op on a list of inputs.
type Fused<'a> = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + 'a;

/// One gated op: its name, the fused op, its composite, its tolerances by dtype (f32's also
/// for the tails).
struct Op {
    name: &'static str,
    fused: Pair,
    reference: Pair,
    dtypes: [(DType, f64); 4],
}

impl Op {
    /// The dtypes' tolerances with `f32` for f32 (the others are the same for both ops).
    const fn new(name: &'static str, fused: Pair, reference: Pair, f32: f64) -> Self {
        let dtypes = [
            (DType::F64, 1e-12),
            (DType::F32, f32),
            (DType::BF16, 8e-3),
            (DType::F16, 1e-3),
        ];
        Op {
            name,
            fused,
            reference,
            dtypes,
        }
    }
}

const OPS: [Op; 2] = [
    Op::new("swiglu", swiglu, swiglu_composite, 1e-6),
    Op::new("geglu", geglu, geglu_composite, 1e-5),
];

/// Every op with each dtype and its tolerance.
fn cases() -> impl Iterator<Item = (&'static Op, DType, f64)> {
    OPS.iter()
        .flat_map(|op| op.dtypes.map(|(dt, tol)| (op, dt, tol)))
}

impl Op {
    fn fused(&self, t: &[Tensor]) -> candle_core::Result<Tensor> {
        (self.fused)(&t[0], &t[1])
    }

    fn reference(&self, t: &[Tensor]) -> candle_core::Result<Tensor> {
        (self.reference)(&t[0], &t[1])
    }
}

/// `[gate, up]`; gate spans the activations' range (about [-8, 8]).
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

/// Asserts `f` and `g` give the same value and gradients (dtype, shape, values within `tol`)
/// for `ins`.
fn assert_matches(
    fns: [&Fused<'_>; 2],
    ins: &[Tensor],
    probe: &Tensor,
    tol: f64,
    what: &str,
) -> Result<()> {
    let mut runs = Vec::new();
    for h in fns {
        let (y, grads) = value_and_grads(h, ins, probe)?;
        runs.push([vec![y], grads].concat());
    }
    for (k, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        let name = match k {
            0 => "y".to_string(),
            _ => format!("grad {}", k - 1),
        };
        let want = if k == 0 { b.dims() } else { ins[k - 1].dims() };
        assert_eq!((a.dtype(), a.dims()), (b.dtype(), want), "{what} {name}");
        assert_close(a, b, tol, &format!("{what} {name}"))?;
    }
    Ok(())
}

#[test]
fn matches_composite() -> Result<()> {
    let mut rng = Lcg(1);
    for (op, dt, tol) in cases() {
        for shape in SHAPES {
            let ins = inputs(shape, dt, &mut rng)?;
            let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
            let what = format!("{} {dt:?} {shape:?}", op.name);
            let (f, r) = (|t: &[Tensor]| op.fused(t), |t: &[Tensor]| op.reference(t));
            assert_matches([&f, &r], &ins, &probe, tol, &what)?;
            assert!(op.fused(&ins)?.is_contiguous());
        }
    }
    Ok(())
}

#[test]
fn f32_error_is_a_few_ulp() -> Result<()> {
    // The kernel's f32 error against the f64 composite, next to the f32 composite's own: the
    // vectorised exponential / tanh cost at most a few f32 ulp.
    let mut rng = Lcg(2);
    let shape = [64, 1000];
    for (op, bound) in OPS.iter().zip([2.5e-7, 2.5e-7]) {
        let ins = inputs(&shape, DType::F32, &mut rng)?;
        let ins64: Vec<Tensor> = ins
            .iter()
            .map(|t| t.to_dtype(DType::F64))
            .collect::<candle_core::Result<_>>()?;
        let exact = op.reference(&ins64)?;
        let ours = compare::rel_err(&op.fused(&ins)?, &exact);
        let candle = compare::rel_err(&op.reference(&ins)?, &exact);
        let what = format!(
            "{} fused f32 vs f64: {ours:e} (composite f32: {candle:e})",
            op.name
        );
        assert!(ours < bound, "{what}");
        assert!(candle > 0.0 && ours > 0.0, "the check measures something");
    }
    Ok(())
}

#[test]
fn tails_of_the_activation() -> Result<()> {
    // The sigmoid's and tanh's saturation, the exponential's clamp, a subnormal-size gate.
    let g = Tensor::new(
        &[
            -1e4f32, -150.0, -104.0, -90.0, -88.5, -30.0, -9.1, -1.2785, 0.0, 1e-30, 0.63, 9.1,
            17.0, 30.0, 89.0, 1e4,
        ],
        &Device::Cpu,
    )?;
    let u = g.ones_like()?.affine(1.5, 0.0)?;
    let probe = g.ones_like()?;
    let ins = [g, u];
    let ins64: Vec<Tensor> = ins
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<candle_core::Result<_>>()?;
    for op in &OPS {
        let (f, r) = (|t: &[Tensor]| op.fused(t), |t: &[Tensor]| op.reference(t));
        let what = format!("{} tails", op.name);
        let tol = op.dtypes[1].1;
        assert_matches([&f, &r], &ins, &probe, tol, &format!("{what} f32"))?;
        let probe64 = probe.to_dtype(DType::F64)?;
        assert_matches([&f, &r], &ins64, &probe64, 1e-12, &format!("{what} f64"))?;
    }
    Ok(())
}

#[test]
fn geglu_is_gelu_times_up() -> Result<()> {
    // The same tanh GELU as `gelu::gelu`'s kernel: y is the bits of gelu(gate) * up (rounded
    // once in 16 bits, so compared in f32 there), d_up those of dy * gelu(gate).
    let mut rng = Lcg(9);
    for dt in [DType::F32, DType::F64] {
        let ins = inputs(&[37, 129], dt, &mut rng)?;
        let probe = rand(&[37, 129], dt, &mut rng, 1.0, 0.0)?;
        let a = gelu(&ins[0])?;
        let (y, g) = value_and_grads(&|t: &[Tensor]| geglu(&t[0], &t[1]), &ins, &probe)?;
        same_bits(&y, &(&a * &ins[1])?, &format!("{dt:?} y"))?;
        // (+ 0: Candle's backprop adds each gradient to zeros, turning -0 into +0)
        let d_up = ((&probe * &a)? + 0.0)?;
        same_bits(&g[1], &d_up, &format!("{dt:?} d_up"))?;
    }
    Ok(())
}

#[test]
fn geglu_matches_torch() -> Result<()> {
    // torch 2.15's `gelu(gate, approximate="tanh") * up` (transformers' `gelu_pytorch_tanh`,
    // Gemma's MLP) and its autograd gradients, from scripts/python/make_geglu_fixtures.py. f64:
    // 1e-12, the same formula in another order (measured 4e-16). f32: 2e-6 of the largest
    // value, ours through `tanh_f32` against torch's own vectorised tanh, each output rounded
    // once; `d_gate`'s `1 - t^2` cancels: ours and torch's are each 4.6e-7 from the f64 value,
    // 7.3e-7 apart (y 1.1e-8, d_up 4.6e-9).
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/geglu/geglu.safetensors"
    );
    let t = candle_core::safetensors::load(path, &Device::Cpu)?;
    for (dt, tol) in [("f64", 1e-12), ("f32", 2e-6)] {
        let get = |k: &str| {
            let key = format!("{dt}.{k}");
            t.get(&key)
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("no {key} in {path}"))
        };
        let ins = [get("gate")?, get("up")?];
        let (y, g) = value_and_grads(&|t: &[Tensor]| geglu(&t[0], &t[1]), &ins, &get("dy")?)?;
        for (ours, name) in [(&y, "y"), (&g[0], "d_gate"), (&g[1], "d_up")] {
            assert_close(
                ours,
                &get(name)?,
                tol,
                &format!("{dt} {name} against torch"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn strided_inputs() -> Result<()> {
    let mut rng = Lcg(3);
    for (op, dt, tol) in cases() {
        for (n, i) in [(1usize, 1usize), (7, 33), (2 * 3, 1536)] {
            strided_case(op, dt, tol, n, i, &mut rng)?;
        }
    }
    Ok(())
}

/// `op` on strided views of `[n, i]` and `[n, 2i]` inputs against its composite.
fn strided_case(op: &Op, dt: DType, tol: f64, n: usize, i: usize, rng: &mut Lcg) -> Result<()> {
    // gate and up as the two halves of one packed [N, 2I] projection: the gradient comes back
    // in the packed tensor.
    let h = rand(&[n, 2 * i], dt, rng, 6.0, 0.0)?;
    let probe = rand(&[n, i], dt, rng, 1.0, 0.0)?;
    let halves = |t: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![
            t[0].narrow(D::Minus1, 0, i)?,
            t[0].narrow(D::Minus1, i, i)?,
        ])
    };
    let f = |t: &[Tensor]| op.fused(&halves(t)?);
    let r = |t: &[Tensor]| op.reference(&halves(t)?);
    let what = format!("{} {dt:?} packed [{n}, 2 x {i}]", op.name);
    assert_matches([&f, &r], std::slice::from_ref(&h), &probe, tol, &what)?;
    // up contiguous, gate transposed (its last stride is not 1), 3-D with a strided middle dim.
    let gt = rand(&[i, n], dt, rng, 6.0, 0.0)?;
    let u = rand(&[n, i], dt, rng, 2.0, 0.0)?;
    let f = |t: &[Tensor]| op.fused(&[t[0].t()?, t[1].clone()]);
    let r = |t: &[Tensor]| op.reference(&[t[0].t()?, t[1].clone()]);
    let what = format!("{} {dt:?} transposed gate [{n}, {i}]", op.name);
    assert_matches([&f, &r], &[gt, u], &probe, tol, &what)?;
    let big = rand(&[2, 5, n, i], dt, rng, 6.0, 0.0)?;
    let pick = |t: &Tensor| t.narrow(1, 1, 3);
    let p3 = rand(&[2, 3, n, i], dt, rng, 1.0, 0.0)?;
    let f = |t: &[Tensor]| op.fused(&[pick(&t[0])?, pick(&t[1])?]);
    let r = |t: &[Tensor]| op.reference(&[pick(&t[0])?, pick(&t[1])?]);
    let ins = [big.clone(), big.affine(0.5, 0.1)?];
    let what = format!("{} {dt:?} narrowed dim 1", op.name);
    assert_matches([&f, &r], &ins, &p3, tol, &what)
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg(4);
    for (op, dt, tol) in cases() {
        for shape in [&[1usize][..], &[3, 7], &[2, 3, 33]] {
            let ins = inputs(shape, dt, &mut rng)?;
            let probe = rand(shape, dt, &mut rng, 1.0, 0.0)?;
            let what = format!("{} fallback {dt:?} {shape:?}", op.name);
            assert_fallback_matches(&|t| op.fused(t), &ins, &probe, tol, &what)?;
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(5);
    for op in &OPS {
        for shape in [&[3usize, 7][..], &[2, 1, 5], &[1]] {
            let ins = inputs(shape, DType::F64, &mut rng)?;
            check_fd(&|t| op.reference(t), &ins, 50 + shape.len() as u64)?;
            check_fd(&|t| op.fused(t), &ins, 60 + shape.len() as u64)?;
        }
    }
    Ok(())
}

#[test]
fn nan_propagates() -> Result<()> {
    let mut rng = Lcg(6);
    let (rows, c) = (9usize, 33usize);
    for op in &OPS {
        for dt in [DType::F32, DType::F64, DType::BF16] {
            for (which, name) in [(0usize, "gate"), (1, "up")] {
                let mut ins = inputs(&[rows, c], dt, &mut rng)?;
                let idx = 1 + rng.below(rows * c - 1);
                let mut v = values(&ins[which]);
                v[idx] = f64::NAN;
                ins[which] = Tensor::from_vec(v, (rows, c), &Device::Cpu)?.to_dtype(dt)?;
                let probe = rand(&[rows, c], dt, &mut rng, 1.0, 0.0)?;
                let (y, g) = value_and_grads(&|t| op.fused(t), &ins, &probe)?;
                let what = format!("{} {dt:?} NaN in {name} at {idx}", op.name);
                // y and d_gate see both inputs; d_up = dy act(gate) sees gate only.
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
    }
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let mut rng = Lcg(7);
    // Contiguous (CHUNK pieces) and packed (rows) paths, both over PAR_MIN_WORK.
    let (n, i) = (180, 1536);
    assert!(n * i > PAR_MIN_WORK);
    for op in &OPS {
        for dt in [DType::F32, DType::BF16, DType::F64] {
            let ins = inputs(&[n, i], dt, &mut rng)?;
            let probe = rand(&[n, i], dt, &mut rng, 1.0, 0.0)?;
            let what = format!("{} {dt:?}", op.name);
            let f = |t: &[Tensor]| op.fused(t);
            assert_same_bits_on_thread_counts(&f, &ins, &probe, &format!("{what} contiguous"))?;
            let h = rand(&[n, 2 * i], dt, &mut rng, 6.0, 0.0)?;
            let f = |t: &[Tensor]| (op.fused)(&t[0].narrow(1, 0, i)?, &t[0].narrow(1, i, i)?);
            assert_same_bits_on_thread_counts(&f, &[h], &probe, &format!("{what} packed"))?;
        }
    }
    Ok(())
}

#[test]
fn rejects_bad_arguments() -> Result<()> {
    let mut rng = Lcg(8);
    let g = rand(&[4, 6], DType::F32, &mut rng, 1.0, 0.0)?;
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    for op in &OPS {
        let name = op.name;
        let e = err((op.fused)(&g, &g.narrow(1, 0, 5)?));
        let want = format!("{name}: gate and up must have the same shape, got [4, 6] and [4, 5]");
        assert!(e.contains(&want), "{e}");
        let e = err((op.reference)(&g, &g.t()?));
        let want = format!("{name}_composite: gate and up must have the same shape");
        assert!(e.contains(&want), "{e}");
        let e = err((op.fused)(&g, &g.to_dtype(DType::F64)?));
        assert!(
            e.contains(&format!("{name}: gate has dtype F32, up has F64")),
            "{e}"
        );
        let i = g.to_dtype(DType::U32)?;
        let e = err((op.fused)(&i, &i));
        assert!(
            e.contains(&format!("{name}: gate must be a float tensor")),
            "{e}"
        );
        // Empty tensors are fine.
        let z = Tensor::zeros((0, 6), DType::F32, &Device::Cpu)?;
        assert_eq!((op.fused)(&z, &z)?.dims(), [0, 6]);
    }
    Ok(())
}
