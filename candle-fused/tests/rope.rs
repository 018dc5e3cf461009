//! RoPE: the fused op against the composite reference (values and gradients, every dtype, odd
//! and strided shapes, all three table shapes), the fallback path, an explicit per-element
//! loop of the split-halves formula, position 0, the relative-position property, the tables
//! against a per-element f32 loop, finite differences, NaN propagation, thread-count
//! independence and rejected arguments.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3)):
//! * fused vs composite, same dtype: **bit-identical** (checked), and also within the tolerances
//!   below (which report the size of a difference, should the bits ever differ): every output
//!   element is one product, a second product and one add or subtract in f32 (f64 for f64)
//!   on both sides, in the same order, rounded once to the storage type; every gradient
//!   element likewise (Candle's autograd adds the two paths' contributions, the rest of each
//!   path's gradient being exact zeros).
//!   f64 1e-12, f32 1e-6; bf16 8e-3 and f16 1e-3 (one unit of the format's rounding: both sides
//!   round an f32 value once, a straddled rounding boundary would cost one unit).
//! * the explicit loop (f64 from f32 tables): 1e-12 (same formula, f64).
//! * the relative-position property (f64 tables): 1e-12 relative to |q| |k|.
//! * finite differences (f64, h = 1e-5): 1e-6 (truncation ~h^2, roundoff ~1e-16/h).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::rope::{rope, rope_composite, rope_tables};
use common::*;

const DTYPES: [(DType, f64); 4] = [
    (DType::F64, 1e-12),
    (DType::F32, 1e-6),
    (DType::BF16, 8e-3),
    (DType::F16, 1e-3),
];

/// Llama's `inv_freq[i] = 1 / theta^(2i / D)` in f32, `[D/2]`.
fn inv_freq(d: usize, theta: f64) -> Result<Tensor> {
    let v: Vec<f32> = (0..d / 2)
        .map(|i| (1.0 / theta.powf(2.0 * i as f64 / d as f64)) as f32)
        .collect();
    Ok(Tensor::new(v, &Device::Cpu)?)
}

/// How the tables are shaped.
#[derive(Clone, Copy, Debug)]
enum Tables {
    /// `[B, T, D/2]`, random positions per row.
    PerRow,
    /// `[T, D/2]`, positions `0..T`.
    Shared,
    /// `[1, T, D/2]`, positions `0..T`.
    SharedBatch1,
}

/// `(cos, sin)` for `x [B, T, H, D]`; per-row positions are random in 0..4096.
fn tables(b: usize, t: usize, d: usize, kind: Tables, rng: &mut Lcg) -> Result<(Tensor, Tensor)> {
    let inv = inv_freq(d, 10_000.0)?;
    let pos = match kind {
        Tables::PerRow => {
            let v: Vec<u32> = (0..b * t).map(|_| rng.below(4096) as u32).collect();
            Tensor::from_vec(v, (b, t), &Device::Cpu)?
        }
        Tables::Shared => Tensor::arange(0u32, t as u32, &Device::Cpu)?,
        Tables::SharedBatch1 => Tensor::arange(0u32, t as u32, &Device::Cpu)?.reshape((1, t))?,
    };
    Ok(rope_tables(&pos, &inv)?)
}

/// The op with the tables captured (they are constants, not inputs).
fn fused(cos: &Tensor, sin: &Tensor) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> {
    let (c, s) = (cos.clone(), sin.clone());
    move |t: &[Tensor]| rope(&t[0], &c, &s)
}

fn reference(cos: &Tensor, sin: &Tensor) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> {
    let (c, s) = (cos.clone(), sin.clone());
    move |t: &[Tensor]| rope_composite(&t[0], &c, &s)
}

/// `[B, T, H, D]`: sizes of 1, D = 2, D/2 not a multiple of 8 (the vector width), D = 64.
const SHAPES: [[usize; 4]; 7] = [
    [1, 1, 1, 2],
    [1, 3, 1, 2],
    [2, 3, 1, 6],
    [1, 5, 3, 10],
    [3, 7, 2, 34],
    [2, 4, 3, 64],
    [1, 9, 4, 130],
];

#[test]
fn matches_composite_bit_for_bit() -> Result<()> {
    let mut rng = Lcg(1);
    for (dt, tol) in DTYPES {
        for shape @ [b, t, h, d] in SHAPES {
            for kind in [Tables::PerRow, Tables::Shared, Tables::SharedBatch1] {
                let (cos, sin) = tables(b, t, d, kind, &mut rng)?;
                let x = rand(&shape, dt, &mut rng, 2.0, 0.0)?;
                let probe = rand(&[b, h, t, d], dt, &mut rng, 1.0, 0.0)?;
                let ins = [x];
                let (y, g) = value_and_grads(&fused(&cos, &sin), &ins, &probe)?;
                let (yr, gr) = value_and_grads(&reference(&cos, &sin), &ins, &probe)?;
                let what = format!("{dt:?} {shape:?} {kind:?}");
                assert_eq!((y.dtype(), y.dims()), (dt, &[b, h, t, d][..]), "{what}");
                assert!(y.is_contiguous(), "{what}");
                assert_eq!((g[0].dtype(), g[0].dims()), (dt, &shape[..]), "{what}");
                assert_close(&y, &yr, tol, &format!("{what} y"))?;
                assert_close(&g[0], &gr[0], tol, &format!("{what} dx"))?;
                same_bits(&y, &yr, &format!("{what} y"))?;
                same_bits(&g[0], &gr[0], &format!("{what} dx"))?;
            }
        }
    }
    Ok(())
}

/// The brief's formula, element by element in f64 from f32 tables: `y [B, H, T, D]`.
fn explicit(x: &[f64], [b, t, h, dd]: [usize; 4], cos: &[f64], sin: &[f64]) -> Vec<f64> {
    let d = dd / 2;
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for ti in 0..t {
            for hi in 0..h {
                let xo = ((bi * t + ti) * h + hi) * dd;
                let yo = ((bi * h + hi) * t + ti) * dd;
                let to = (bi * t + ti) * d;
                for i in 0..d {
                    let (c, s) = (cos[to + i], sin[to + i]);
                    y[yo + i] = x[xo + i] * c - x[xo + i + d] * s;
                    y[yo + i + d] = x[xo + i + d] * c + x[xo + i] * s;
                }
            }
        }
    }
    y
}

#[test]
fn equals_the_split_halves_formula() -> Result<()> {
    let mut rng = Lcg(2);
    for shape @ [b, t, _, d] in [[2, 3, 2, 8], [1, 4, 3, 2], [2, 5, 1, 34]] {
        let (cos, sin) = tables(b, t, d, Tables::PerRow, &mut rng)?;
        let x = rand(&shape, DType::F64, &mut rng, 1.0, 0.0)?;
        let want = explicit(&values(&x), shape, &values(&cos), &values(&sin));
        let got = values(&rope(&x, &cos, &sin)?);
        let d = compare::diff(&got, &want).map_err(anyhow::Error::msg)?;
        assert!(d.rel() <= 1e-12, "{shape:?}: {d}");
    }
    // A quarter turn of pair i = 1 of D = 4 (cos 0, sin 1) and none of pair 0: y = [x0, -x3,
    // x2, x1]. The interleaved convention would mix x0 with x1 instead.
    let x = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?.reshape((1, 1, 1, 4))?;
    let cos = Tensor::new(&[[1f32, 0.]], &Device::Cpu)?;
    let sin = Tensor::new(&[[0f32, 1.]], &Device::Cpu)?;
    let y = rope(&x, &cos, &sin)?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(y, [1., -4., 3., 2.]);
    Ok(())
}

#[test]
fn position_zero_is_the_transpose() -> Result<()> {
    let mut rng = Lcg(3);
    let (b, t, h, d) = (2, 4, 3, 10);
    // Row 0 starts at position 0, row 1 at 7.
    let pos = Tensor::new(&[[0u32, 1, 2, 3], [7, 8, 9, 10]], &Device::Cpu)?;
    let (cos, sin) = rope_tables(&pos, &inv_freq(d, 10_000.0)?)?;
    for dt in [DType::F32, DType::BF16, DType::F64] {
        let x = rand(&[b, t, h, d], dt, &mut rng, 1.0, 0.0)?;
        let y = rope(&x, &cos, &sin)?;
        let xt = x.transpose(1, 2)?;
        same_bits(
            &y.narrow(0, 0, 1)?.narrow(2, 0, 1)?,
            &xt.narrow(0, 0, 1)?.narrow(2, 0, 1)?,
            "pos 0",
        )?;
        // Other positions do rotate.
        let moved = values(&(y.narrow(0, 1, 1)? - xt.narrow(0, 1, 1)?)?);
        assert!(
            moved.iter().any(|v| v.abs() > 1e-2),
            "{dt:?}: position 7 left x unchanged"
        );
    }
    Ok(())
}

#[test]
fn scores_depend_only_on_the_relative_position() -> Result<()> {
    // q and k at positions 0..P (the same vectors at every position), rotated with f64 tables of
    // the exact angles: <q(m), k(n)> depends on m - n only.
    let (p, d) = (12usize, 16usize);
    let mut rng = Lcg(4);
    let inv: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / 10_000f64.powf(2.0 * i as f64 / d as f64))
        .collect();
    let ang: Vec<f64> = (0..p)
        .flat_map(|m| inv.iter().map(move |f| m as f64 * f))
        .collect();
    let cos = Tensor::from_vec(
        ang.iter().map(|a| a.cos()).collect(),
        (p, d / 2),
        &Device::Cpu,
    )?;
    let sin = Tensor::from_vec(
        ang.iter().map(|a| a.sin()).collect(),
        (p, d / 2),
        &Device::Cpu,
    )?;
    let at_every_position = |v: &Tensor| -> Result<Tensor> {
        Ok(v.reshape((1, 1, 1, d))?
            .broadcast_as((1, p, 1, d))?
            .contiguous()?)
    };
    let q = rand(&[d], DType::F64, &mut rng, 1.0, 0.0)?;
    let k = rand(&[d], DType::F64, &mut rng, 1.0, 0.0)?;
    let scale = (values(&q.sqr()?.sum_all()?)[0] * values(&k.sqr()?.sum_all()?)[0]).sqrt();
    let rq = rope(&at_every_position(&q)?, &cos, &sin)?.reshape((p, d))?;
    let rk = rope(&at_every_position(&k)?, &cos, &sin)?.reshape((p, d))?;
    let s = rq.matmul(&rk.t()?)?.to_vec2::<f64>()?;
    for delta in -(p as i64 - 1)..p as i64 {
        let pairs: Vec<(usize, usize)> = (0..p)
            .filter_map(|m| {
                let n = m as i64 - delta;
                (0..p as i64).contains(&n).then_some((m, n as usize))
            })
            .collect();
        let (m0, n0) = pairs[0];
        for &(m, n) in &pairs[1..] {
            let e = (s[m][n] - s[m0][n0]).abs() / scale;
            assert!(
                e < 1e-12,
                "m - n = {delta}: s[{m}][{n}] vs s[{m0}][{n0}]: {e:e}"
            );
        }
    }
    // ...and it does depend on m - n (the check above can fail).
    assert!((s[1][0] - s[2][0]).abs() / scale > 1e-3);
    Ok(())
}

#[test]
fn tables_are_transformers_f32() -> Result<()> {
    let d = 64;
    let inv = inv_freq(d, 500_000.0)?;
    let iv = inv.to_vec1::<f32>()?;
    let pos: Vec<u32> = vec![0, 1, 2, 31, 1000, 8191, 70_000, 16_777_217];
    let (b, t) = (2, 4);
    let p_u32 = Tensor::from_vec(pos.clone(), (b, t), &Device::Cpu)?;
    let p_i64 = p_u32.to_dtype(DType::I64)?;
    let p_flat = p_u32.flatten_all()?;
    for (p, shape) in [
        (&p_u32, vec![b, t, d / 2]),
        (&p_i64, vec![b, t, d / 2]),
        (&p_flat, vec![b * t, d / 2]),
    ] {
        let (cos, sin) = rope_tables(p, &inv)?;
        assert_eq!((cos.dims(), cos.dtype()), (&shape[..], DType::F32));
        assert_eq!(sin.dims(), &shape[..]);
        let (cv, sv) = (f32s(&cos)?, f32s(&sin)?);
        for (k, &pk) in pos.iter().enumerate() {
            for (i, &f) in iv.iter().enumerate() {
                let a = pk as f32 * f;
                let j = k * d / 2 + i;
                assert_eq!(cv[j].to_bits(), a.cos().to_bits(), "cos pos {pk} i {i}");
                assert_eq!(sv[j].to_bits(), a.sin().to_bits(), "sin pos {pk} i {i}");
            }
        }
    }
    let e = rope_tables(&p_u32.to_dtype(DType::F32)?, &inv)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_tables: positions must be u32"), "{e}");
    let e = rope_tables(&p_u32, &inv.to_dtype(DType::F64)?)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rope_tables: inv_freq must be a [D/2] f32"),
        "{e}"
    );
    let e = rope_tables(&p_u32.reshape((1, b, t))?, &inv)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[B, T] or [T]"), "{e}");
    Ok(())
}

/// A view of the packed projection that [`strided_inputs`] takes `x` as.
type View<'a> = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a>;

#[test]
fn strided_inputs() -> Result<()> {
    let mut rng = Lcg(5);
    let (b, t, h, d) = (2, 5, 3, 12);
    let (cos, sin) = tables(b, t, d, Tables::PerRow, &mut rng)?;
    for dt in [DType::F32, DType::F64, DType::BF16] {
        let tol = if dt == DType::BF16 { 8e-3 } else { 1e-6 };
        let qkv = rand(&[b, t, 3 * h * d], dt, &mut rng, 1.0, 0.0)?;
        let probe = rand(&[b, h, t, d], dt, &mut rng, 1.0, 0.0)?;
        // k as a view of the packed projection (no copy), as a reshaped narrow (a copy), and
        // with the features strided (the last stride is H, not 1).
        let views: [(&str, View<'_>); 3] = [
            (
                "view",
                Box::new(|p| p.reshape((b, t, 3 * h, d))?.narrow(2, h, h)),
            ),
            (
                "reshaped narrow",
                Box::new(|p| p.narrow(2, h * d, h * d)?.reshape((b, t, h, d))),
            ),
            (
                "features strided",
                Box::new(|p| {
                    p.narrow(2, 0, h * d)?
                        .reshape((b, t, d, h))?
                        .transpose(2, 3)
                }),
            ),
        ];
        for (name, view) in &views {
            let x = view(&qkv)?;
            let f = |ins: &[Tensor]| rope(&view(&ins[0])?, &cos, &sin);
            let r = |ins: &[Tensor]| rope_composite(&view(&ins[0])?, &cos, &sin);
            let (y, g) = value_and_grads(&f, std::slice::from_ref(&qkv), &probe)?;
            let (yr, gr) = value_and_grads(&r, std::slice::from_ref(&qkv), &probe)?;
            let what = format!("{dt:?} {name}");
            if *name == "view" {
                assert!(!x.is_contiguous() && x.stride()[3] == 1, "{what}");
            }
            assert_close(&y, &yr, tol, &format!("{what} y"))?;
            same_bits(&y, &yr, &format!("{what} y"))?;
            // The gradient reaches the packed tensor, zero outside k.
            assert_eq!(g[0].dims(), qkv.dims());
            assert_close(&g[0], &gr[0], tol, &format!("{what} dqkv"))?;
        }
    }
    Ok(())
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let mut rng = Lcg(6);
    for (dt, tol) in DTYPES {
        for shape @ [b, t, h, d] in [[1, 1, 1, 2], [2, 3, 2, 10], [3, 7, 2, 34]] {
            for kind in [Tables::PerRow, Tables::Shared] {
                let (cos, sin) = tables(b, t, d, kind, &mut rng)?;
                let ins = [rand(&shape, dt, &mut rng, 1.0, 0.0)?];
                let probe = rand(&[b, h, t, d], dt, &mut rng, 1.0, 0.0)?;
                let what = format!("fallback {dt:?} {shape:?} {kind:?}");
                assert_fallback_matches(&fused(&cos, &sin), &ins, &probe, tol, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let mut rng = Lcg(7);
    for shape @ [b, t, _, d] in [[2, 3, 2, 6], [1, 1, 1, 2], [1, 4, 3, 4]] {
        let (cos, sin) = tables(b, t, d, Tables::PerRow, &mut rng)?;
        let (cos, sin) = (cos.to_dtype(DType::F64)?, sin.to_dtype(DType::F64)?);
        let ins = [rand(&shape, DType::F64, &mut rng, 1.0, 0.0)?];
        check_fd(&reference(&cos, &sin), &ins, 70 + d as u64)?;
        check_fd(&fused(&cos, &sin), &ins, 71 + d as u64)?;
    }
    Ok(())
}

#[test]
fn nan_propagates_to_its_pair_only() -> Result<()> {
    let mut rng = Lcg(8);
    let shape @ [b, t, h, dd] = [2, 3, 4, 10];
    let d = dd / 2;
    let n = b * t * h * dd;
    for dt in [DType::F32, DType::F64, DType::BF16] {
        let (cos, sin) = tables(b, t, dd, Tables::PerRow, &mut rng)?;
        // A NaN in x at (b, t, h, i) reaches y at (b, h, t, i mod d) and (b, h, t, i mod d + d);
        // dx does not depend on x.
        let idx = 1 + rng.below(n - 1);
        let mut xv = values(&rand(&shape, dt, &mut rng, 1.0, 0.0)?);
        xv[idx] = f64::NAN;
        let x = Tensor::from_vec(xv, &shape, &Device::Cpu)?.to_dtype(dt)?;
        let probe = rand(&[b, h, t, dd], dt, &mut rng, 1.0, 0.0)?;
        let (y, g) = value_and_grads(&fused(&cos, &sin), &[x], &probe)?;
        let (bi, ti, hi, i) = (
            idx / (t * h * dd),
            idx / (h * dd) % t,
            idx / dd % h,
            idx % dd,
        );
        let row = ((bi * h + hi) * t + ti) * dd;
        let want = [row + i % d, row + i % d + d];
        for (k, v) in values(&y).iter().enumerate() {
            assert_eq!(v.is_nan(), want.contains(&k), "{dt:?} NaN x[{idx}]: y[{k}]");
        }
        assert_eq!(nan_count(&g[0]), 0, "{dt:?}: dx");
        // A NaN in cos at (b, t, i) reaches every head of (b, t) at i and i + d, in y and dx.
        let x = rand(&shape, dt, &mut rng, 1.0, 0.0)?;
        let ti = 1 + rng.below(b * t * d - 1);
        let mut cv = values(&cos);
        cv[ti] = f64::NAN;
        let cos = Tensor::from_vec(cv, (b, t, d), &Device::Cpu)?.to_dtype(DType::F32)?;
        let (y, g) = value_and_grads(&fused(&cos, &sin), &[x], &probe)?;
        let (bt, i) = (ti / d, ti % d);
        let (bi, tt) = (bt / t, bt % t);
        for (k, v) in values(&y).iter().enumerate() {
            let (kb, kh, kt, ki) = (k / (h * t * dd), k / (t * dd) % h, k / dd % t, k % dd);
            let hit = kb == bi && kt == tt && ki % d == i;
            assert_eq!(v.is_nan(), hit, "{dt:?} NaN cos[{ti}]: y[{k}] (head {kh})");
        }
        for (k, v) in values(&g[0]).iter().enumerate() {
            let (kb, kt, ki) = (k / (t * h * dd), k / (h * dd) % t, k % dd);
            let hit = kb == bi && kt == tt && ki % d == i;
            assert_eq!(v.is_nan(), hit, "{dt:?} NaN cos[{ti}]: dx[{k}]");
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let mut rng = Lcg(9);
    // 4 x 130 x 9 x 64 = 299,520 elements, over PAR_MIN_WORK; the x view is strided.
    let (b, t, h, d) = (4, 130, 9, 64);
    assert!(b * t * h * d > PAR_MIN_WORK);
    let (cos, sin) = tables(b, t, d, Tables::PerRow, &mut rng)?;
    for dt in [DType::F32, DType::BF16, DType::F64] {
        let qkv = rand(&[b, t, 3 * h, d], dt, &mut rng, 1.0, 0.0)?;
        let probe = rand(&[b, h, t, d], dt, &mut rng, 1.0, 0.0)?;
        let f = |ins: &[Tensor]| rope(&ins[0].narrow(2, h, h)?, &cos, &sin);
        assert_same_bits_on_thread_counts(&f, &[qkv], &probe, &format!("{dt:?}"))?;
    }
    Ok(())
}

#[test]
fn rejects_bad_arguments() -> Result<()> {
    let mut rng = Lcg(10);
    let (b, t, h, d) = (2, 3, 2, 8);
    let (cos, sin) = tables(b, t, d, Tables::PerRow, &mut rng)?;
    let x = rand(&[b, t, h, d], DType::F32, &mut rng, 1.0, 0.0)?;
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let e = err(rope(&x.reshape((b, t, h * d))?, &cos, &sin));
    assert!(
        e.contains("rope: x must be [B, T, H, D], got shape [2, 3, 16]"),
        "{e}"
    );
    let x7 = rand(&[b, t, h, 7], DType::F32, &mut rng, 1.0, 0.0)?;
    let e = err(rope(&x7, &cos.narrow(2, 0, 3)?, &sin.narrow(2, 0, 3)?));
    assert!(e.contains("rope: the head dim D must be even"), "{e}");
    let e = err(rope_composite(
        &x,
        &cos.narrow(1, 0, 2)?,
        &sin.narrow(1, 0, 2)?,
    ));
    assert!(
        e.contains("rope_composite: cos / sin must be [B, T, D/2] = [2, 3, 4]"),
        "{e}"
    );
    assert!(e.contains("got [2, 2, 4]"), "{e}");
    let e = err(rope(&x, &cos, &sin.narrow(0, 0, 1)?));
    assert!(e.contains("rope: cos and sin shapes differ"), "{e}");
    let e = err(rope(
        &x,
        &cos.to_dtype(DType::U32)?,
        &sin.to_dtype(DType::U32)?,
    ));
    assert!(e.contains("cos must be a float tensor"), "{e}");
    let e = err(rope(&x.to_dtype(DType::U32)?, &cos, &sin));
    assert!(e.contains("rope: x must be a float tensor"), "{e}");
    // A table that tracks a gradient would lose it: refused.
    let cv = Var::from_tensor(&cos)?;
    let e = err(rope(&x, cv.as_tensor(), &sin));
    assert!(e.contains("rope: cos tracks a gradient"), "{e}");
    // Empty batches are fine.
    let (c0, s0) = (cos.narrow(0, 0, 0)?, sin.narrow(0, 0, 0)?);
    let y = rope(&x.narrow(0, 0, 0)?, &c0, &s0)?;
    assert_eq!(y.dims(), [0, h, t, d]);
    Ok(())
}
