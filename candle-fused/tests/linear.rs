//! `linear`: values and gradients against the composite (`matmul` + `broadcast_add`), with and
//! without bias, with a transposed (strided) weight, leading dims; the fallback path; 16-bit
//! dtypes; f64 finite differences; NaN propagation; thread-count independence.
//!
//! Tolerances (relative to the largest reference magnitude): f64 1e-12 (the same sums, GEMM
//! blocking vs Candle's GEMM order); f32 1e-5 (a few ulps of reordering over k <= 130 terms);
//! bf16 / f16 2e-2 / 4e-3 (the kernel rounds once after an f32 GEMM; the composite rounds
//! products in Candle's own way); finite differences (f64, h = 1e-6) 1e-7: the op is bilinear,
//! so central differences are exact up to rounding.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::linear::{linear, linear_composite};
use common::*;

/// (output, dx, dw, db) of `f` with a random upstream gradient (a linear functional).
type Run = (Tensor, Tensor, Tensor, Option<Tensor>);

fn run(
    f: impl Fn(&Tensor, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor>,
    x: &Tensor,
    w_t: bool,
    w: &Tensor,
    b: Option<&Tensor>,
    up: &Tensor,
) -> Result<Run> {
    let xv = Var::from_tensor(x)?;
    let wv = Var::from_tensor(w)?;
    let bv = b.map(Var::from_tensor).transpose()?;
    let wuse = if w_t { wv.t()? } else { wv.as_tensor().clone() };
    let y = f(xv.as_tensor(), &wuse, bv.as_ref().map(|b| b.as_tensor()))?;
    let g = (y.to_dtype(DType::F64)? * up)?.sum_all()?.backward()?;
    let get = |v: &Var| g.get(v).cloned().expect("gradient");
    Ok((y, get(&xv), get(&wv), bv.as_ref().map(get)))
}

fn compare(dt: DType, tol: f64, rng: &mut Lcg) -> Result<()> {
    for &(lead, n_in, n_out) in &[
        (&[1usize][..], 1usize, 1usize),
        (&[3, 5], 7, 33),
        (&[2, 65], 64, 130),
        (&[127], 33, 1),
    ] {
        for w_t in [false, true] {
            for bias in [false, true] {
                let mut xs = lead.to_vec();
                xs.push(n_in);
                let x = rand(&xs, dt, rng, 1.0, 0.0)?;
                let w = if w_t {
                    rand(&[n_out, n_in], dt, rng, 1.0, 0.0)?
                } else {
                    rand(&[n_in, n_out], dt, rng, 1.0, 0.0)?
                };
                let b = bias
                    .then(|| rand(&[n_out], dt, rng, 1.0, 0.0))
                    .transpose()?;
                let mut ys = lead.to_vec();
                ys.push(n_out);
                let up = rand(&ys, DType::F64, rng, 1.0, 0.0)?;
                let what = format!("{dt:?} {xs:?}x[{n_in},{n_out}] w_t={w_t} bias={bias}");
                let k = run(linear, &x, w_t, &w, b.as_ref(), &up)?;
                let c = if matches!(dt, DType::BF16 | DType::F16) {
                    // The reference in f32, rounded to the dtype at the end.
                    let up32 = up.clone();
                    let r = run(
                        linear_composite,
                        &x.to_dtype(DType::F32)?,
                        w_t,
                        &w.to_dtype(DType::F32)?,
                        b.as_ref()
                            .map(|b| b.to_dtype(DType::F32))
                            .transpose()?
                            .as_ref(),
                        &up32,
                    )?;
                    (r.0.to_dtype(dt)?, r.1, r.2, r.3)
                } else {
                    run(linear_composite, &x, w_t, &w, b.as_ref(), &up)?
                };
                assert_close(&k.0, &c.0, tol, &format!("{what}: y"))?;
                assert_close(&k.1, &c.1, tol, &format!("{what}: dx"))?;
                assert_close(&k.2, &c.2, tol, &format!("{what}: dw"))?;
                if let (Some(a), Some(b)) = (&k.3, &c.3) {
                    assert_close(a, b, tol, &format!("{what}: db"))?;
                }
                // The fallback path gives the same values and gradients.
                let fb = with_fallback(|| run(linear, &x, w_t, &w, b.as_ref(), &up))?;
                if !matches!(dt, DType::BF16 | DType::F16) {
                    assert_close(&fb.0, &k.0, tol, &format!("{what}: fallback y"))?;
                    assert_close(&fb.1, &k.1, tol, &format!("{what}: fallback dx"))?;
                    assert_close(&fb.2, &k.2, tol, &format!("{what}: fallback dw"))?;
                }
            }
        }
    }
    Ok(())
}

common::composite_precision_tests!(compare);

/// bf16 (the AVX512-BF16 GEMM where the CPU has it, the widening path elsewhere) against the
/// same op in f32 on the same values, with an upstream gradient that bf16 holds exactly: both
/// compute exact products and f32 sums in different orders (off by ~sqrt(k) f32 ulps of
/// Σ|a||b|), then bf16 rounds once, so every bf16 output is within one bf16 ulp (2^-8
/// relative) of the f32 one, plus the reordering. Shapes above the parallel threshold, odd
/// sizes, a transposed weight.
#[test]
fn bf16_matches_f32_of_the_same_values() -> Result<()> {
    let mut rng = Lcg(8);
    for &(lead, n_in, n_out) in &[(&[3usize, 100][..], 257usize, 129usize), (&[7], 9, 65)] {
        for w_t in [false, true] {
            let mut xs = lead.to_vec();
            xs.push(n_in);
            let mut ys = lead.to_vec();
            ys.push(n_out);
            let x = rand(&xs, DType::BF16, &mut rng, 1.0, 0.0)?;
            let ws = if w_t { [n_out, n_in] } else { [n_in, n_out] };
            let w = rand(&ws, DType::BF16, &mut rng, 1.0, 0.0)?;
            let b = rand(&[n_out], DType::BF16, &mut rng, 1.0, 0.0)?;
            let up = rand(&ys, DType::BF16, &mut rng, 1.0, 0.0)?.to_dtype(DType::F64)?;
            let h = run(linear, &x, w_t, &w, Some(&b), &up)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let r = run(linear, &f(&x)?, w_t, &f(&w)?, Some(&f(&b)?), &up)?;
            let what = format!("{xs:?}x{ws:?} w_t={w_t}");
            let pairs = [
                (&h.0, &r.0, "y"),
                (&h.1, &r.1, "dx"),
                (&h.2, &r.2, "dw"),
                (h.3.as_ref().expect("db"), r.3.as_ref().expect("db"), "db"),
            ];
            for (a, b, name) in pairs {
                let (a, b) = (values(a), values(b));
                let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    let tol = y.abs() / 256.0 + 1e-5 * scale;
                    assert!((x - y).abs() <= tol, "{what} {name}[{i}]: {x} vs f32 {y}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(3);
    let (x, w, b) = (
        rand(&[2, 3, 4], DType::F64, &mut rng, 1.0, 0.0)?,
        rand(&[4, 5], DType::F64, &mut rng, 1.0, 0.0)?,
        rand(&[5], DType::F64, &mut rng, 1.0, 0.0)?,
    );
    let up = rand(&[2, 3, 5], DType::F64, &mut rng, 1.0, 0.0)?;
    let (_, dx, dw, db) = run(linear, &x, false, &w, Some(&b), &up)?;
    let f = |x: &Tensor, w: &Tensor, b: &Tensor| -> Result<f64> {
        Ok((linear(x, w, Some(b))? * &up)?
            .sum_all()?
            .to_scalar::<f64>()?)
    };
    let h = 1e-6;
    for (which, t, g) in [(0, &x, &dx), (1, &w, &dw), (2, &b, &db.expect("db"))] {
        let base = values(t);
        let ga = values(g);
        for i in 0..base.len() {
            let at = |d: f64| -> Result<f64> {
                let mut v = base.clone();
                v[i] += d;
                let p = Tensor::from_vec(v, t.shape(), &Device::Cpu)?;
                match which {
                    0 => f(&p, &w, &b),
                    1 => f(&x, &p, &b),
                    _ => f(&x, &w, &p),
                }
            };
            let num = (at(h)? - at(-h)?) / (2.0 * h);
            assert!(
                (num - ga[i]).abs() <= 1e-7 * (1.0 + num.abs()),
                "input {which}[{i}]: {} vs {num}",
                ga[i]
            );
        }
    }
    Ok(())
}

#[test]
fn nan_propagates_from_a_random_index() -> Result<()> {
    let mut rng = Lcg(4);
    let (rows, n_in, n_out) = (9, 6, 5);
    let (x, idx, w, b) = linear_inputs_with_nan(&mut rng, rows, n_in, n_out)?;
    let up = rand(&[rows, n_out], DType::F64, &mut rng, 1.0, 0.0)?;
    let (y, dx, dw, db) = run(linear, &x, false, &w, Some(&b), &up)?;
    let (r, c) = (idx / n_in, idx % n_in);
    let yv = values(&y);
    for (i, v) in yv.iter().enumerate() {
        assert_eq!(v.is_nan(), i / n_out == r, "y[{i}] (NaN input at row {r})");
    }
    // dW row c sums x[:, c] * dy: NaN; dx and db do not read x.
    let dwv = values(&dw);
    for (i, v) in dwv.iter().enumerate() {
        assert_eq!(
            v.is_nan(),
            i / n_out == c,
            "dw[{i}] (NaN input at column {c})"
        );
    }
    assert!(values(&dx).iter().all(|v| v.is_finite()));
    assert!(values(&db.expect("db")).iter().all(|v| v.is_finite()));
    Ok(())
}

#[test]
fn identical_for_any_thread_count() -> Result<()> {
    let mut rng = Lcg(5);
    // (rows, in, out). 2000 rows: the bias gradient (2000 x 160 elements) crosses PAR_MIN_WORK
    // too. k = 768 and 1024 > 512: `gemm` blocks k differently for outputs of at most 64 x 64
    // (the 64-row bands of 128 rows) than for larger ones, and runs a dot-product kernel for
    // outputs of at most 256 elements (the 16-row bands of 48 rows x 16 on 3 threads).
    for (rows, n_in, n_out) in [(2000, 96, 160), (128, 768, 64), (48, 1024, 16)] {
        let x = rand(&[rows, n_in], DType::F32, &mut rng, 1.0, 0.0)?;
        let w = rand(&[n_out, n_in], DType::F32, &mut rng, 1.0, 0.0)?;
        let b = rand(&[n_out], DType::F32, &mut rng, 1.0, 0.0)?;
        let up = rand(&[rows, n_out], DType::F64, &mut rng, 1.0, 0.0)?;
        let mut outs = Vec::new();
        for n in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build()?;
            let r = pool.install(|| run(linear, &x, true, &w, Some(&b), &up))?;
            let vals: Vec<Vec<f64>> = [&r.0, &r.1, &r.2, r.3.as_ref().expect("db")]
                .iter()
                .map(|t| values(t))
                .collect();
            outs.push(vals);
        }
        for (t, o) in [(2, &outs[1]), (3, &outs[2])] {
            for (k, (a, b)) in outs[0].iter().zip(o.iter()).enumerate() {
                let diff = a
                    .iter()
                    .zip(b)
                    .position(|(x, y)| x.to_bits() != y.to_bits());
                assert!(
                    diff.is_none(),
                    "{rows} x {n_in} -> {n_out}: output {k} differs between 1 and {t} threads at {diff:?}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn rejects_bad_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
    assert!(linear(&x, &Tensor::zeros((4, 5), DType::F32, &dev)?, None).is_err());
    assert!(linear(&x, &Tensor::zeros(3, DType::F32, &dev)?, None).is_err());
    let w = Tensor::zeros((3, 5), DType::F32, &dev)?;
    assert!(linear(&x, &w, Some(&Tensor::zeros(4, DType::F32, &dev)?)).is_err());
    assert!(linear(&x, &w.to_dtype(DType::F64)?, None).is_err());
    Ok(())
}

/// `matmul` (the GEMM dispatch on its own, as the `gemm` bench times it) on each operand layout:
/// f64 against Candle's `matmul` (1e-12: f64 sums of 37 terms in another order), bf16 against
/// the f32 product of the same bf16 values rounded once to bf16 (within one bf16 ulp, 2^-8
/// relative: the f32 sums may round either side of a tie).
#[test]
fn matmul_reads_every_layout() -> Result<()> {
    let dev = Device::Cpu;
    let (m, k, n) = (19, 37, 23);
    for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
        let make = |r: usize, c: usize, t: bool| -> Result<Tensor> {
            Ok(match t {
                true => Tensor::randn(0f64, 1.0, (c, r), &dev)?.t()?,
                false => Tensor::randn(0f64, 1.0, (r, c), &dev)?,
            })
        };
        let (a, b) = (make(m, k, a_t)?, make(k, n, b_t)?);
        let y = candle_fused::linear::matmul(&a, &b)?;
        let err = (&y - a.matmul(&b)?)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(err < 1e-12, "f64 {a_t} {b_t}: {err}");
        let (a16, b16) = (a.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
        let y16 = candle_fused::linear::matmul(&a16, &b16)?.to_dtype(DType::F64)?;
        let want = a16
            .to_dtype(DType::F32)?
            .matmul(&b16.to_dtype(DType::F32)?)?
            .to_dtype(DType::F64)?;
        let rel = ((&y16 - &want)?.abs()? / (want.abs()? + 1e-3)?)?
            .max_all()?
            .to_scalar::<f64>()?;
        assert!(rel <= 1.0 / 256.0, "bf16 {a_t} {b_t}: {rel}");
    }
    let bad = candle_fused::linear::matmul(
        &Tensor::zeros((2, 3), DType::F32, &dev)?,
        &Tensor::zeros((4, 2), DType::F32, &dev)?,
    );
    assert!(bad.unwrap_err().to_string().contains("do not match"));
    Ok(())
}
