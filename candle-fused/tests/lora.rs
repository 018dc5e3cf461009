//! `lora_linear`: values and gradients of `x`, `a` and `b` against `lora_linear_composite`
//! (with and without bias, the weight as `w.t()` of `[out, in]` and as a contiguous
//! `[in, out]`, a strided `a`, leading dims, ranks 1 and odd, dropout); the dropout mask bit for
//! bit; the frozen weight (no gradient, even as a `Var`); an untracked `x`; the fallback path;
//! 16-bit dtypes; f64 finite differences; NaN propagation; thread-count independence; errors.
//!
//! Tolerances (relative to the largest reference magnitude): f64 1e-12 (the same sums in
//! another order: GEMM blocking, `scale` folded into `h` / `dy b` before the second product
//! instead of applied after it); f32 1e-5 (a few ulps of reordering over sums of at most 130
//! terms, 127 rows for `da` / `db`); bf16 2e-2 and f16 4e-3 against the composite run in f32 on
//! the same values (the kernel sums in f32 and rounds each output once: a 16-bit ulp, plus
//! reordering; the bounds are `linear`'s; the upstream gradient is one the dtype holds exactly,
//! and p = 0.5 so the dropped-out input is too). Exact (same bits): the dropout mask, outputs whose every sum is exact in
//! f64 (small integers, p = 0.5), and 1 vs 2 vs 3 threads.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::dropout::dropout_composite;
use candle_fused::lora::{lora_linear, lora_linear_composite};
use candle_fused::RngKey;
use common::*;

type Drop = Option<(f32, RngKey)>;
type LoraFn = fn(
    &Tensor,
    &Tensor,
    Option<&Tensor>,
    &Tensor,
    &Tensor,
    f64,
    Drop,
) -> candle_core::Result<Tensor>;

/// The frozen part and the settings of one call.
struct Setup<'a> {
    w: &'a Tensor,
    bias: Option<&'a Tensor>,
    scale: f64,
    drop: Drop,
}

/// `(y, [dx, da, db])` of `f` over the inputs `[x, a, b]` (each a fresh `Var`) for the upstream
/// gradient `up`.
fn run(f: LoraFn, s: &Setup<'_>, ins: &[Tensor], up: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
    let g = |t: &[Tensor]| f(&t[0], s.w, s.bias, &t[1], &t[2], s.scale, s.drop);
    Ok(value_and_grads(&g, ins, up)?)
}

/// One shape: leading dims, in, out, rank.
type Shape<'a> = (&'a [usize], usize, usize, usize);

const SHAPES: [Shape<'static>; 5] = [
    (&[1], 1, 1, 1),
    (&[3, 5], 7, 33, 3),
    (&[2, 65], 64, 130, 5),
    (&[127], 33, 1, 1),
    (&[2, 3, 4], 9, 11, 7),
];

fn with_last(lead: &[usize], n: usize) -> Vec<usize> {
    let mut v = lead.to_vec();
    v.push(n);
    v
}

fn compare(dt: DType, tol: f64, rng: &mut Lcg) -> Result<()> {
    let half = matches!(dt, DType::BF16 | DType::F16);
    for (si, &(lead, n_in, n_out, r)) in SHAPES.iter().enumerate() {
        for w_t in [false, true] {
            for bias in [false, true] {
                // 16-bit: p = 0.5, whose keep scale 2 and dropped-out `u = 2x` the dtype
                // holds exactly (p = 0.3 rounds both, the f32 reference does not: that mask is
                // checked bit for bit by `dropout_mask_is_the_dropout_ops`).
                let p = if half { 0.5 } else { 0.3 };
                for drop in [None, Some((p, RngKey::new(11, si as u64)))] {
                    let x = rand(&with_last(lead, n_in), dt, rng, 1.0, 0.0)?;
                    // The base weight as stored: `[out, in]` (used as `w.t()`) or `[in, out]`.
                    let w = if w_t {
                        rand(&[n_out, n_in], dt, rng, 1.0, 0.0)?
                    } else {
                        rand(&[n_in, n_out], dt, rng, 1.0, 0.0)?
                    };
                    let b0 = rand(&[n_out], dt, rng, 1.0, 0.0)?;
                    // `a` strided (the transpose of an `[in, r]` tensor) when `w_t`.
                    let a = if w_t {
                        rand(&[n_in, r], dt, rng, 1.0, 0.0)?.t()?
                    } else {
                        rand(&[r, n_in], dt, rng, 1.0, 0.0)?
                    };
                    let b = rand(&[n_out, r], dt, rng, 1.0, 0.0)?;
                    let up = rand(&with_last(lead, n_out), DType::F64, rng, 1.0, 0.0)?;
                    // 16-bit: an upstream gradient the dtype holds exactly, so the f32
                    // reference differentiates the same function of the same numbers.
                    let up = if half {
                        up.to_dtype(dt)?.to_dtype(DType::F64)?
                    } else {
                        up
                    };
                    let scale = 1.75;
                    let wuse = if w_t { w.t()? } else { w.clone() };
                    let s = Setup {
                        w: &wuse,
                        bias: bias.then_some(&b0),
                        scale,
                        drop,
                    };
                    let what = format!(
                        "{dt:?} x {:?} w [{n_in},{n_out}] w_t={w_t} r={r} bias={bias} drop={}",
                        x.dims(),
                        drop.is_some()
                    );
                    let ins = [x.clone(), a.clone(), b.clone()];
                    let (y, g) = run(lora_linear, &s, &ins, &up)?;
                    let (yc, gc) = if half {
                        let f = |t: &Tensor| t.to_dtype(DType::F32);
                        let (w32, b32) = (f(&wuse)?, f(&b0)?);
                        let s32 = Setup {
                            w: &w32,
                            bias: bias.then_some(&b32),
                            ..s
                        };
                        let ins32 = [f(&x)?, f(&a)?, f(&b)?];
                        let (yc, gc) = run(lora_linear_composite, &s32, &ins32, &up)?;
                        (yc.to_dtype(dt)?, gc)
                    } else {
                        run(lora_linear_composite, &s, &ins, &up)?
                    };
                    assert_close(&y, &yc, tol, &format!("{what}: y"))?;
                    for (name, (k, c)) in ["dx", "da", "db"].iter().zip(g.iter().zip(&gc)) {
                        assert_close(k, c, tol, &format!("{what}: {name}"))?;
                    }
                    // The fallback path: the same values and gradients.
                    if !half {
                        let (yf, gf) = with_fallback(|| run(lora_linear, &s, &ins, &up))?;
                        assert_close(&yf, &y, tol, &format!("{what}: fallback y"))?;
                        for (name, (k, c)) in ["dx", "da", "db"].iter().zip(gf.iter().zip(&g)) {
                            assert_close(k, c, tol, &format!("{what}: fallback {name}"))?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

common::composite_precision_tests!(compare);

/// Small integers, `scale` 0.5 and p = 0.5 (keep scale 2): every product and sum is exact in
/// f64, so the fused op and the composite agree bit for bit in every output, which they can
/// only do with the same mask.
#[test]
fn exact_where_the_composite_is_exact() -> Result<()> {
    let mut rng = Lcg(3);
    let int = |shape: &[usize], rng: &mut Lcg| -> Result<Tensor> {
        Ok(rand(shape, DType::F64, rng, 4.0, 0.0)?.round()?)
    };
    let (x, w, bias) = (
        int(&[3, 7, 10], &mut rng)?,
        int(&[6, 10], &mut rng)?,
        int(&[6], &mut rng)?,
    );
    let (a, b) = (int(&[3, 10], &mut rng)?, int(&[6, 3], &mut rng)?);
    let up = int(&[3, 7, 6], &mut rng)?;
    let wt = w.t()?;
    let s = Setup {
        w: &wt,
        bias: Some(&bias),
        scale: 0.5,
        drop: Some((0.5, RngKey::new(5, 9))),
    };
    let ins = [x, a, b];
    let (y, g) = run(lora_linear, &s, &ins, &up)?;
    let (yc, gc) = run(lora_linear_composite, &s, &ins, &up)?;
    same_bits(&y, &yc, "y")?;
    for (name, (k, c)) in ["dx", "da", "db"].iter().zip(g.iter().zip(&gc)) {
        same_bits(k, c, name)?;
    }
    Ok(())
}

/// With `w = 0`, `a = b = I` and `scale = 1`, `y = dropout(x)` and `dx = dy · mask` exactly:
/// the mask is `dropout(x, p, key)`'s bit for bit (p = 0.3, flat index over `[B, T, in]`),
/// forward and backward, in every dtype, on the kernel and the fallback path.
#[test]
fn dropout_mask_is_the_dropout_ops() -> Result<()> {
    let mut rng = Lcg(4);
    let (p, key) = (0.3f32, RngKey::new(77, 2));
    for dt in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        let n = 40;
        let x = rand(&[3, 50, n], dt, &mut rng, 1.0, 0.0)?;
        let w = Tensor::zeros((n, n), dt, &Device::Cpu)?;
        let eye = Tensor::eye(n, dt, &Device::Cpu)?;
        let up = rand(&[3, 50, n], DType::F64, &mut rng, 1.0, 0.0)?;
        let s = Setup {
            w: &w,
            bias: None,
            scale: 1.0,
            drop: Some((p, key)),
        };
        let ins = [x.clone(), eye.clone(), eye];
        let want = dropout_composite(&x, p, key)?;
        let dmask = dropout_composite(&up.to_dtype(dt)?, p, key)?;
        for fb in [false, true] {
            let (y, g) = fallback_if(fb, || run(lora_linear, &s, &ins, &up))?;
            same_values(&y, &want, &format!("{dt:?} fallback={fb}: y vs dropout(x)"))?;
            same_values(
                &g[0],
                &dmask,
                &format!("{dt:?} fallback={fb}: dx vs dy mask"),
            )?;
        }
        let yc = lora_linear_composite(&x, &w, None, &ins[1], &ins[2], 1.0, Some((p, key)))?;
        same_values(&yc, &want, &format!("{dt:?}: composite y vs dropout(x)"))?;
    }
    Ok(())
}

/// Equal elements (`-0 == 0`: a dropped `-x` is `-0` from the dropout op, `0 + -0 = 0` here).
fn same_values(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    assert_eq!(a.dims(), b.dims(), "{what}");
    for (i, (x, y)) in values(a).iter().zip(values(b)).enumerate() {
        anyhow::ensure!(*x == y, "{what}: differs at {i}: {x} vs {y}");
    }
    Ok(())
}

/// The frozen base weight: `w` and `bias` passed as `Var`s (`w` through `.t()` and as is) get
/// no gradient; `x`, `a` and `b` do.
#[test]
fn frozen_weight_gets_no_gradient() -> Result<()> {
    let dev = Device::Cpu;
    for w_t in [false, true] {
        for fb in [false, true] {
            let x = Var::randn(0f32, 1.0, (2, 5, 8), &dev)?;
            let w = if w_t {
                Var::randn(0f32, 1.0, (6, 8), &dev)?
            } else {
                Var::randn(0f32, 1.0, (8, 6), &dev)?
            };
            let bias = Var::randn(0f32, 1.0, 6, &dev)?;
            let a = Var::randn(0f32, 1.0, (4, 8), &dev)?;
            let b = Var::randn(0f32, 1.0, (6, 4), &dev)?;
            let wuse = if w_t { w.t()? } else { w.as_tensor().clone() };
            let grads = fallback_if(fb, || -> candle_core::Result<_> {
                lora_linear(&x, &wuse, Some(&bias), &a, &b, 2.0, None)?
                    .sum_all()?
                    .backward()
            })?;
            assert!(
                grads.get(&w).is_none(),
                "w_t={w_t} fallback={fb}: w got a gradient"
            );
            assert!(
                grads.get(&bias).is_none(),
                "fallback={fb}: bias got a gradient"
            );
            for (name, v) in [("x", &x), ("a", &a), ("b", &b)] {
                assert!(
                    grads.get(v).is_some(),
                    "fallback={fb}: no gradient for {name}"
                );
            }
        }
    }
    Ok(())
}

/// `x` untracked (a frozen model's first layer): only `a` and `b` get gradients, equal to the
/// composite's; `a` untracked too: only `b`; nothing tracked: the composite's value.
#[test]
fn untracked_inputs() -> Result<()> {
    let mut rng = Lcg(5);
    for fb in [false, true] {
        let x = rand(&[4, 9, 12], DType::F64, &mut rng, 1.0, 0.0)?;
        let w = rand(&[12, 10], DType::F64, &mut rng, 1.0, 0.0)?;
        let a0 = rand(&[3, 12], DType::F64, &mut rng, 1.0, 0.0)?;
        let b0 = rand(&[10, 3], DType::F64, &mut rng, 1.0, 0.0)?;
        let drop = Some((0.25, RngKey::new(1, 1)));
        let (a, b) = (Var::from_tensor(&a0)?, Var::from_tensor(&b0)?);
        let loss = |f: LoraFn, a: &Tensor| -> candle_core::Result<_> {
            f(&x, &w, None, a, &b, 0.5, drop)?.sum_all()?.backward()
        };
        let g = fallback_if(fb, || loss(lora_linear, &a))?;
        let gc = loss(lora_linear_composite, &a)?;
        assert!(g.get(&x).is_none());
        for (name, v) in [("a", &a), ("b", &b)] {
            let (k, c) = (g.get(v).expect(name), gc.get(v).expect(name));
            assert_close(k, c, 1e-12, &format!("fallback={fb}: d{name}"))?;
        }
        // Only b tracked.
        let g = fallback_if(fb, || loss(lora_linear, &a0))?;
        let gc = loss(lora_linear_composite, &a0)?;
        assert_close(
            g.get(&b).expect("db"),
            gc.get(&b).expect("db"),
            1e-12,
            "db only",
        )?;
        // Nothing tracked.
        let y = fallback_if(fb, || lora_linear(&x, &w, None, &a0, &b0, 0.5, drop))?;
        let yc = lora_linear_composite(&x, &w, None, &a0, &b0, 0.5, drop)?;
        assert_close(&y, &yc, 1e-12, &format!("fallback={fb}: untracked y"))?;
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(6);
    let w = rand(&[5, 4], DType::F64, &mut rng, 1.0, 0.0)?;
    let bias = rand(&[5], DType::F64, &mut rng, 1.0, 0.0)?;
    let wt = w.t()?;
    let f = |t: &[Tensor]| {
        lora_linear(
            &t[0],
            &wt,
            Some(&bias),
            &t[1],
            &t[2],
            1.5,
            Some((0.3, RngKey::new(2, 2))),
        )
    };
    let ins = [
        rand(&[2, 3, 4], DType::F64, &mut rng, 1.0, 0.0)?,
        rand(&[3, 4], DType::F64, &mut rng, 1.0, 0.0)?,
        rand(&[5, 3], DType::F64, &mut rng, 1.0, 0.0)?,
    ];
    check_fd(&f, &ins, 7)
}

/// A NaN in `x` away from index 0 gives NaNs where the composite has them: its row of `y`,
/// all of `db` (every element sums over the rows through `h`), its column of `da`; `dx` stays
/// finite. With and without dropout (a dropped NaN stays NaN: the mask is multiplied).
#[test]
fn nan_propagates_like_the_composite() -> Result<()> {
    let mut rng = Lcg(7);
    let (rows, n_in, n_out, r) = (9, 6, 5, 2);
    for drop in [None, Some((0.5f32, RngKey::new(3, 3)))] {
        for fb in [false, true] {
            let (x, idx, w, bias) = linear_inputs_with_nan(&mut rng, rows, n_in, n_out)?;
            let a = rand(&[r, n_in], DType::F32, &mut rng, 1.0, 0.0)?;
            let b = rand(&[n_out, r], DType::F32, &mut rng, 1.0, 0.0)?;
            let up = rand(&[rows, n_out], DType::F64, &mut rng, 1.0, 0.0)?;
            let s = Setup {
                w: &w,
                bias: Some(&bias),
                scale: 2.0,
                drop,
            };
            let ins = [x, a, b];
            let (y, g) = fallback_if(fb, || run(lora_linear, &s, &ins, &up))?;
            let (yc, gc) = run(lora_linear_composite, &s, &ins, &up)?;
            let what = format!("NaN at {idx} drop={} fallback={fb}", drop.is_some());
            assert_eq!(nans(&y), nans(&yc), "{what}: y");
            assert!(nans(&y)[(idx / n_in) * n_out], "{what}: y row");
            for (name, (k, c)) in ["dx", "da", "db"].iter().zip(g.iter().zip(&gc)) {
                assert_eq!(nans(k), nans(c), "{what}: {name}");
            }
            assert_eq!(nan_count(&g[0]), 0, "{what}: dx");
            assert_eq!(nan_count(&g[2]), n_out * r, "{what}: db");
        }
    }
    Ok(())
}

/// Same bits on 1, 2 and 3 threads, at sizes above the parallel threshold (every GEMM split,
/// `da` / `db` summing 1024 > 512 rows, the dropout mask drawn in parallel chunks).
#[test]
fn identical_for_any_thread_count() -> Result<()> {
    let mut rng = Lcg(8);
    let (rows, n_in, n_out, r) = (1024, 96, 160, 16);
    assert!(rows * n_in * 16 >= PAR_MIN_WORK);
    for dt in [DType::F32, DType::BF16] {
        let w = rand(&[n_out, n_in], dt, &mut rng, 1.0, 0.0)?.t()?;
        let bias = rand(&[n_out], dt, &mut rng, 1.0, 0.0)?;
        let ins = [
            rand(&[4, rows / 4, n_in], dt, &mut rng, 1.0, 0.0)?,
            rand(&[r, n_in], dt, &mut rng, 1.0, 0.0)?,
            rand(&[n_out, r], dt, &mut rng, 1.0, 0.0)?,
        ];
        let up = rand(&[4, rows / 4, n_out], dt, &mut rng, 1.0, 0.0)?;
        let f = |t: &[Tensor]| {
            lora_linear(
                &t[0],
                &w,
                Some(&bias),
                &t[1],
                &t[2],
                2.0,
                Some((0.1, RngKey::new(9, 9))),
            )
        };
        assert_same_bits_on_thread_counts(&f, &ins, &up, &format!("{dt:?}"))?;
    }
    Ok(())
}

#[test]
fn rejects_bad_inputs() -> Result<()> {
    let dev = Device::Cpu;
    let z = |s: &[usize], dt: DType| Tensor::zeros(s, dt, &dev);
    let f32_ = DType::F32;
    let (x, w) = (z(&[2, 8], f32_)?, z(&[8, 6], f32_)?);
    let (a, b) = (z(&[4, 8], f32_)?, z(&[6, 4], f32_)?);
    let err = |r: candle_core::Result<Tensor>| match r {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    let dropout = |p: f32| {
        err(lora_linear(
            &x,
            &w,
            None,
            &a,
            &b,
            1.0,
            Some((p, RngKey::new(0, 0))),
        ))
    };
    let cases: Vec<(String, &str)> = vec![
        (
            err(lora_linear(&x, &w, None, &z(&[4, 7], f32_)?, &b, 1.0, None)),
            "lora_A",
        ),
        (
            err(lora_linear(&x, &w, None, &z(&[8, 4], f32_)?, &b, 1.0, None)),
            "lora_A",
        ),
        (
            err(lora_linear(
                &x,
                &w,
                None,
                &z(&[0, 8], f32_)?,
                &z(&[6, 0], f32_)?,
                1.0,
                None,
            )),
            "r >= 1",
        ),
        (
            err(lora_linear(&x, &w, None, &a, &z(&[4, 6], f32_)?, 1.0, None)),
            "lora_B",
        ),
        (
            err(lora_linear(&x, &w, None, &a, &z(&[6, 3], f32_)?, 1.0, None)),
            "lora_B",
        ),
        (
            err(lora_linear(
                &x,
                &w,
                None,
                &a.to_dtype(DType::F64)?,
                &b,
                1.0,
                None,
            )),
            "a (lora_A) dtype",
        ),
        (
            err(lora_linear(
                &x,
                &w,
                None,
                &a,
                &b.to_dtype(DType::BF16)?,
                1.0,
                None,
            )),
            "b (lora_B) dtype",
        ),
        (
            err(lora_linear(&x, &z(&[7, 6], f32_)?, None, &a, &b, 1.0, None)),
            "in-features",
        ),
        (
            err(lora_linear(
                &x,
                &w.to_dtype(DType::F64)?,
                None,
                &a,
                &b,
                1.0,
                None,
            )),
            "weight dtype",
        ),
        (
            err(lora_linear(
                &x,
                &w,
                Some(&z(&[5], f32_)?),
                &a,
                &b,
                1.0,
                None,
            )),
            "bias",
        ),
        (dropout(1.0), "p must be"),
        (dropout(f32::NAN), "p must be"),
        (
            err(lora_linear_composite(
                &x,
                &w,
                None,
                &a,
                &z(&[6, 3], f32_)?,
                1.0,
                None,
            )),
            "lora_B",
        ),
    ];
    for (msg, want) in cases {
        assert!(
            msg.contains(want),
            "error {msg:?} does not mention {want:?}"
        );
    }
    Ok(())
}
