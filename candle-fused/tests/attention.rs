//! Tests of the fused attention op against the composite reference (values and gradients),
//! the fallback path, 16-bit inputs, finite differences, NaN propagation and determinism.
//!
//! Tolerances (max abs error relative to the largest reference magnitude): f64 1e-10, where
//! the kernel and the reference differ only in summation order and the online-softmax
//! rescaling (error ~1e-15 per op, amplified by at most T and the softmax Jacobian; observed
//! <2e-15); f32 1e-5 for values and 2e-5 for gradients, the same rounding differences at ~6e-8
//! per op over up to 129 keys and the longer backward chains (observed <8e-7).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::attention::{
    attention, attention_composite, attention_merged, attention_qkv, attention_qkv_composite,
    AttentionConfig,
};
use candle_fused::RngKey;
use common::*;

fn tols(dt: DType) -> (f64, f64) {
    match dt {
        DType::F64 => (1e-10, 1e-10),
        _ => (1e-5, 2e-5),
    }
}

/// `[q, k, v]` of `[B, H, Tq, D]`, `[B, H, Tk, D]`, `[B, H, Tk, Dv]`, seeded `seed` to `seed + 2`
/// (amplitudes 1.5, 1.5, 1).
fn qkv_inputs(seed: u64, [b, h, tq, tk, d, dv]: [usize; 6], dt: DType) -> Result<[Tensor; 3]> {
    Ok([
        rand_seeded(seed, &[b, h, tq, d], 1.5, dt)?,
        rand_seeded(seed + 1, &[b, h, tk, d], 1.5, dt)?,
        rand_seeded(seed + 2, &[b, h, tk, dv], 1.0, dt)?,
    ])
}

/// The option combinations: causal or not, x {none, mask, dropout 0.1, dropout 0.5 + mask}.
fn configs(tq: usize, tk: usize, dt: DType, seed: u64) -> Result<Vec<(String, AttentionConfig)>> {
    let mut out = Vec::new();
    for causal in [true, false] {
        let base = AttentionConfig::causal().with_causal(causal);
        let m = mask(seed, tq, tk, dt)?;
        let key = RngKey::new(seed, 3);
        out.push((format!("causal={causal}"), base.clone()));
        out.push((
            format!("causal={causal} mask"),
            base.clone().with_mask(m.clone()),
        ));
        out.push((
            format!("causal={causal} p=0.1"),
            base.clone().with_dropout(0.1, key),
        ));
        let c = base.with_dropout(0.5, key).with_mask(m).with_scale(0.3);
        out.push((format!("causal={causal} p=0.5 mask scale"), c));
    }
    Ok(out)
}

#[test]
fn qkv_matches_composite() -> Result<()> {
    // (B, T, H, D): T not a multiple of the kernel's 32-row / 256-key tiles, and 300 keys for
    // the online softmax across key tiles; head dims 1, 8, 32, 64.
    let shapes = [
        (1, 1, 2, 8),
        (2, 5, 3, 1),
        (1, 33, 2, 8),
        (2, 70, 2, 32),
        (1, 129, 1, 64),
        (1, 300, 1, 8),
    ];
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        for (n, &(b, t, h, d)) in shapes.iter().enumerate() {
            let qkv = rand_seeded(10 + n as u64, &[b, t, 3 * h * d], 1.5, dt)?;
            for (name, cfg) in configs(t, t, dt, 7 + n as u64)? {
                let what = format!("{dt:?} {:?} {name}", (b, t, h, d));
                let (y, g) = grads(
                    &|x| attention_qkv(&x[0], h, &cfg),
                    std::slice::from_ref(&qkv),
                    99,
                )?;
                let (yr, gr) = grads(
                    &|x| attention_qkv_composite(&x[0], h, &cfg),
                    std::slice::from_ref(&qkv),
                    99,
                )?;
                compare::assert_close(&y, &yr, tv, &format!("{what} value"));
                compare::assert_close(&g[0], &gr[0], tg, &format!("{what} dqkv"));
            }
        }
    }
    Ok(())
}

#[test]
fn general_matches_composite() -> Result<()> {
    // (B, H, Tq, Tk, D, Dv), Tq != Tk and Dv != D; causal only where Tq <= Tk (every row
    // sees a key; rows that see none are tested below).
    let shapes = [
        (1, 2, 5, 33, 8, 3),
        (2, 1, 33, 5, 1, 4),
        (1, 2, 70, 129, 32, 64),
        (1, 1, 40, 300, 8, 8),
        (1, 1, 1, 7, 64, 8),
        (2, 2, 65, 65, 8, 8),
    ];
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        for (n, &(b, h, tq, tk, d, dv)) in shapes.iter().enumerate() {
            let s = 20 + 3 * n as u64;
            let ins = qkv_inputs(s, [b, h, tq, tk, d, dv], dt)?;
            for (name, cfg) in configs(tq, tk, dt, s)? {
                if cfg.causal && tq > tk {
                    continue;
                }
                let what = format!("{dt:?} {:?} {name}", (b, h, tq, tk, d, dv));
                let (y, g) = grads(&|x| attention(&x[0], &x[1], &x[2], &cfg), &ins, 5)?;
                let (yr, gr) = grads(&|x| attention_composite(&x[0], &x[1], &x[2], &cfg), &ins, 5)?;
                compare::assert_close(&y, &yr, tv, &format!("{what} value"));
                for (i, n) in ["dq", "dk", "dv"].iter().enumerate() {
                    compare::assert_close(&g[i], &gr[i], tg, &format!("{what} {n}"));
                }
            }
        }
    }
    Ok(())
}

/// `[B, T, 3C]` -> contiguous `[B, H, T, D]` q, k, v.
fn split(qkv: &Tensor, h: usize) -> candle_core::Result<Vec<Tensor>> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    (0..3)
        .map(|i| {
            qkv.narrow(2, i * c, c)?
                .reshape((b, t, h, c / h))?
                .transpose(1, 2)?
                .contiguous()
        })
        .collect()
}

#[test]
fn qkv_equals_attention_on_split_heads() -> Result<()> {
    // The same kernel over other strides: bit-identical values and gradients.
    let (b, t, h, d) = (2, 37, 3, 8);
    for dt in [DType::F32, DType::BF16] {
        let qkv = rand_seeded(1, &[b, t, 3 * h * d], 1.5, dt)?;
        let m = mask(2, t, t, DType::F32)?;
        let cfg = AttentionConfig::causal()
            .with_dropout(0.2, RngKey::new(4, 1))
            .with_mask(m);
        let (y, g) = grads(
            &|x| attention_qkv(&x[0], h, &cfg),
            std::slice::from_ref(&qkv),
            3,
        )?;
        let via_split = |x: &[Tensor]| {
            let s = split(&x[0], h)?;
            let y = attention(&s[0], &s[1], &s[2], &cfg)?;
            y.transpose(1, 2)?.reshape((b, t, h * d))
        };
        let (ys, gs) = grads(&via_split, std::slice::from_ref(&qkv), 3)?;
        same_bits(&y, &ys, &format!("{dt:?} value"))?;
        same_bits(&g[0], &gs[0], &format!("{dt:?} dqkv"))?;
    }
    Ok(())
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        let (b, t, h, d) = (2, 33, 2, 8);
        let qkv = rand_seeded(3, &[b, t, 3 * h * d], 1.5, dt)?;
        for (name, cfg) in configs(t, t, dt, 4)? {
            let f = |x: &[Tensor]| attention_qkv(&x[0], h, &cfg);
            let (y, g) = grads(&f, std::slice::from_ref(&qkv), 8)?;
            let (yf, gf) = with_fallback(|| grads(&f, std::slice::from_ref(&qkv), 8))?;
            compare::assert_close(&yf, &y, tv, &format!("qkv fallback {dt:?} {name} value"));
            compare::assert_close(
                &gf[0],
                &g[0],
                tg,
                &format!("qkv fallback {dt:?} {name} dqkv"),
            );
            // Untracked input: the fallback returns the composite output directly.
            let yu = with_fallback(|| attention_qkv(&qkv, h, &cfg))?;
            compare::assert_close(
                &yu,
                &y,
                tv,
                &format!("qkv fallback {dt:?} {name} untracked"),
            );
        }
        let (tq, tk, dv) = (9, 40, 5);
        let ins = qkv_inputs(5, [b, h, tq, tk, d, dv], dt)?;
        for (name, cfg) in configs(tq, tk, dt, 9)? {
            let f = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], &cfg);
            let (y, g) = grads(&f, &ins, 8)?;
            let (yf, gf) = with_fallback(|| grads(&f, &ins, 8))?;
            compare::assert_close(&yf, &y, tv, &format!("fallback {dt:?} {name} value"));
            for i in 0..3 {
                compare::assert_close(
                    &gf[i],
                    &g[i],
                    tg,
                    &format!("fallback {dt:?} {name} grad {i}"),
                );
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_close_to_f32_composite() -> Result<()> {
    // The kernel reads 16-bit inputs and accumulates in f32; the reference is the f32
    // composite on the same (rounded) inputs, rounded to the 16-bit type. Tolerances: a few
    // units of the type's epsilon (bf16 2^-8, f16 2^-11); gradients also see the rounded
    // output in D_i = <dO_i, O_i>.
    let (b, t, h, d) = (2, 33, 2, 16);
    for (dt, tv, tg) in [(DType::BF16, 1e-2, 1.5e-2), (DType::F16, 2e-3, 2e-3)] {
        let qkv = rand_seeded(11, &[b, t, 3 * h * d], 1.5, dt)?;
        let qkv32 = qkv.to_dtype(DType::F32)?;
        let m = mask(12, t, t, DType::F32)?;
        let cfgs = [
            AttentionConfig::causal(),
            AttentionConfig::full()
                .with_mask(m)
                .with_dropout(0.1, RngKey::new(5, 5)),
        ];
        for cfg in &cfgs {
            let g16 = rand_seeded(13, &[b, t, h * d], 1.0, dt)?;
            let g32 = g16.to_dtype(DType::F32)?;
            let (y, g) = value_and_grads(
                &|x| attention_qkv(&x[0], h, cfg),
                std::slice::from_ref(&qkv),
                &g16,
            )?;
            let (yr, gr) = value_and_grads(
                &|x| attention_qkv_composite(&x[0], h, cfg),
                std::slice::from_ref(&qkv32),
                &g32,
            )?;
            assert_eq!(y.dtype(), dt);
            assert_eq!(g[0].dtype(), dt);
            compare::assert_close(&y, &yr.to_dtype(dt)?, tv, &format!("{dt:?} value"));
            compare::assert_close(&g[0], &gr[0], tg, &format!("{dt:?} dqkv"));
        }
    }
    Ok(())
}

#[test]
fn rows_without_keys_give_zero() -> Result<()> {
    // Causal with Tq > Tk: rows 0 .. Tq - Tk see no key. The fused op gives 0 there (the
    // composite gives NaN); the other rows and all gradients equal the composite restricted
    // to the rows that see keys.
    let (b, h, tq, tk, d) = (1, 2, 9, 4, 3);
    let dt = DType::F64;
    let ins = qkv_inputs(1, [b, h, tq, tk, d, d], dt)?;
    let g = rand_seeded(4, &[b, h, tq, d], 1.0, dt)?;
    let cfg = AttentionConfig::causal();
    let f = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], &cfg);
    let (y, gk) = value_and_grads(&f, &ins, &g)?;
    let (yf, gf) = with_fallback(|| value_and_grads(&f, &ins, &g))?;
    let skip = tq - tk;
    let f_rows = |x: &[Tensor]| attention_composite(&x[0].narrow(2, skip, tk)?, &x[1], &x[2], &cfg);
    let (yr, gr) = value_and_grads(&f_rows, &ins, &g.narrow(2, skip, tk)?)?;
    assert!(values(&y.narrow(2, 0, skip)?).iter().all(|&x| x == 0.0));
    compare::assert_close(&y.narrow(2, skip, tk)?, &yr, 1e-12, "causal Tq > Tk rows");
    kernel_fallback_reference(&y, &yf, [&gk, &gf, &gr], "causal Tq > Tk");
    // The composite itself gives NaN on those rows.
    let yc = attention_composite(&ins[0], &ins[1], &ins[2], &cfg)?;
    assert!(nans(&yc.narrow(2, 0, skip)?).iter().all(|&n| n));

    // A mask row of only -inf (non-causal): same, comparing with the composite without it.
    let (tq, r) = (7, 3);
    let q = rand_seeded(5, &[b, h, tq, d], 1.5, dt)?;
    let ins = [q, ins[1].clone(), ins[2].clone()];
    let m = mask(6, tq, tk, dt)?;
    let minf = Tensor::full(f64::NEG_INFINITY, (1, tk), &candle_core::Device::Cpu)?;
    let m = Tensor::cat(
        &[m.narrow(0, 0, r)?, minf, m.narrow(0, r + 1, tq - r - 1)?],
        0,
    )?;
    let cfg = AttentionConfig::full().with_mask(m.clone());
    let drop_row = |x: &Tensor, dim: usize| -> candle_core::Result<Tensor> {
        let n = x.dim(dim)?;
        Tensor::cat(
            &[x.narrow(dim, 0, r)?, x.narrow(dim, r + 1, n - r - 1)?],
            dim,
        )
    };
    let cfg_r = AttentionConfig::full().with_mask(drop_row(&m, 0)?);
    let g = rand_seeded(7, &[b, h, tq, d], 1.0, dt)?;
    let f = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], &cfg);
    let (y, gk) = value_and_grads(&f, &ins, &g)?;
    let (yf, gf) = with_fallback(|| value_and_grads(&f, &ins, &g))?;
    let f_rows = |x: &[Tensor]| attention_composite(&drop_row(&x[0], 2)?, &x[1], &x[2], &cfg_r);
    let (yr, gr) = value_and_grads(&f_rows, &ins, &drop_row(&g, 2)?)?;
    assert!(values(&y.narrow(2, r, 1)?).iter().all(|&x| x == 0.0));
    compare::assert_close(&drop_row(&y, 2)?, &yr, 1e-12, "masked row");
    kernel_fallback_reference(&y, &yf, [&gk, &gf, &gr], "masked row");
    Ok(())
}

/// The fallback's value `yf` and gradients against the kernel's (`y`), and the kernel's
/// gradients against the reference's (`[kernel, fallback, reference]`), all within 1e-12.
fn kernel_fallback_reference(y: &Tensor, yf: &Tensor, [gk, gf, gr]: [&[Tensor]; 3], what: &str) {
    compare::assert_close(yf, y, 1e-12, &format!("{what} fallback"));
    for i in 0..3 {
        compare::assert_close(&gk[i], &gr[i], 1e-12, &format!("{what} grad {i}"));
        compare::assert_close(&gf[i], &gk[i], 1e-12, &format!("{what} fallback grad {i}"));
    }
}

/// Central differences of `sum(f(x) * g)` against the op's gradient, for every element of
/// every input (f64; step 1e-5: truncation ~1e-10, rounding ~1e-11; tolerance 1e-7 relative to
/// the largest gradient).
fn finite_differences(
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    ins: &[Tensor],
) -> Result<()> {
    let g = rand_seeded(77, f(ins)?.dims(), 1.0, DType::F64)?;
    Ok(grad::check_fd(f, ins, &g, 1e-5, 1e-7)?)
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let dt = DType::F64;
    let (b, h, tq, tk, d, dv) = (1, 2, 3, 5, 3, 2);
    let ins = qkv_inputs(31, [b, h, tq, tk, d, dv], dt)?;
    for (name, cfg) in configs(tq, tk, dt, 34)? {
        let f = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], &cfg);
        finite_differences(&f, &ins).map_err(|e| e.context(name.clone()))?;
        let f = |x: &[Tensor]| with_fallback(|| attention(&x[0], &x[1], &x[2], &cfg));
        finite_differences(&f, &ins).map_err(|e| e.context(format!("fallback {name}")))?;
    }
    let (t, h, d) = (4, 2, 2);
    let qkv = rand_seeded(35, &[1, t, 3 * h * d], 1.5, dt)?;
    for (name, cfg) in configs(t, t, dt, 36)? {
        let f = |x: &[Tensor]| attention_qkv(&x[0], h, &cfg);
        finite_differences(&f, std::slice::from_ref(&qkv))
            .map_err(|e| e.context(format!("qkv {name}")))?;
    }
    Ok(())
}

#[test]
fn nan_propagates() -> Result<()> {
    let (b, h, t, d) = (2, 2, 19, 4);
    let mut rng = Lcg(123);
    for causal in [false, true] {
        let cfg = AttentionConfig::causal().with_causal(causal);
        let mut qv = values(&rand_seeded(41, &[b, h, t, d], 1.5, DType::F32)?);
        let at = 1 + rng.below(qv.len() - 1);
        qv[at] = f64::NAN;
        let q =
            Tensor::from_vec(qv, (b, h, t, d), &candle_core::Device::Cpu)?.to_dtype(DType::F32)?;
        let ins = [
            q,
            rand_seeded(42, &[b, h, t, d], 1.5, DType::F32)?,
            rand_seeded(43, &[b, h, t, d], 1.0, DType::F32)?,
        ];
        let (y, g) = grads(&|x| attention(&x[0], &x[1], &x[2], &cfg), &ins, 44)?;
        let (yr, gr) = grads(
            &|x| attention_composite(&x[0], &x[1], &x[2], &cfg),
            &ins,
            44,
        )?;
        let row = at / d;
        let ny = nans(&y);
        // Exactly the output row of the NaN query is NaN, as in the composite.
        assert_eq!(ny, nans(&yr), "causal={causal}: output NaNs");
        assert_eq!(ny.iter().filter(|&&n| n).count(), d);
        assert!(ny[row * d..(row + 1) * d].iter().all(|&n| n));
        assert_eq!(nans(&g[0]), nans(&gr[0]), "causal={causal}: dq NaNs");
        for i in 1..3 {
            let (nk, nr) = (nans(&g[i]), nans(&gr[i]));
            assert!(nk.iter().any(|&n| n), "causal={causal}: no NaN in grad {i}");
            if causal {
                // The composite also spreads NaN through the masked scores (NaN + -inf);
                // the kernel never reads keys above the diagonal.
                assert!(
                    nk.iter().zip(&nr).all(|(&k, &r)| !k || r),
                    "grad {i} NaN outside"
                );
            } else {
                assert_eq!(nk, nr, "grad {i} NaNs");
            }
        }
        // The fused projection: NaN in a random q column of a random row.
        let mut xv = values(&rand_seeded(45, &[b, t, 3 * h * d], 1.5, DType::F32)?);
        let (row, col) = (1 + rng.below(t - 1), rng.below(h * d));
        xv[row * 3 * h * d + col] = f64::NAN;
        let qkv = Tensor::from_vec(xv, (b, t, 3 * h * d), &candle_core::Device::Cpu)?;
        let qkv = qkv.to_dtype(DType::F32)?;
        let (y, g) = grads(
            &|x| attention_qkv(&x[0], h, &cfg),
            std::slice::from_ref(&qkv),
            46,
        )?;
        let (yr, gr) = grads(&|x| attention_qkv_composite(&x[0], h, &cfg), &[qkv], 46)?;
        let ny = nans(&y);
        assert_eq!(ny, nans(&yr), "qkv causal={causal}: output NaNs");
        assert_eq!(ny.iter().filter(|&&n| n).count(), d);
        let (nk, nr) = (nans(&g[0]), nans(&gr[0]));
        assert!(nk.iter().filter(|&&n| n).count() > d);
        assert!(
            nk.iter().zip(&nr).all(|(&k, &r)| !k || r),
            "qkv: NaN outside"
        );
        if !causal {
            assert_eq!(nk, nr, "qkv: dqkv NaNs");
        }
    }
    Ok(())
}

#[test]
fn identical_for_any_thread_count() -> Result<()> {
    let (b, t, h, d) = (2, 70, 2, 32);
    let qkv = rand_seeded(51, &[b, t, 3 * h * d], 1.5, DType::F32)?;
    let cfg = AttentionConfig::causal()
        .with_mask(mask(52, t, t, DType::F32)?)
        .with_dropout(0.1, RngKey::new(53, 2));
    let (tq, tk, dv) = (40, 70, 24);
    let ins = qkv_inputs(54, [1, 2, tq, tk, 16, dv], DType::F32)?;
    let cfg2 = AttentionConfig::full().with_dropout(0.5, RngKey::new(57, 0));
    let run = |n: usize| -> Result<Vec<Tensor>> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()?
            .install(|| {
                let (y, g) = grads(
                    &|x| attention_qkv(&x[0], h, &cfg),
                    std::slice::from_ref(&qkv),
                    58,
                )?;
                let (y2, g2) = grads(&|x| attention(&x[0], &x[1], &x[2], &cfg2), &ins, 59)?;
                Ok([vec![y, y2], g, g2].concat())
            })
    };
    let one = run(1)?;
    for n in [2, 3] {
        for (i, (a, b)) in one.iter().zip(&run(n)?).enumerate() {
            same_bits(a, b, &format!("{n} threads, tensor {i}"))?;
        }
    }
    Ok(())
}

#[test]
fn rejects_bad_arguments() -> Result<()> {
    let x = rand_seeded(1, &[1, 4, 12], 1.0, DType::F32)?;
    assert!(attention_qkv(&x, 5, &AttentionConfig::causal()).is_err());
    assert!(attention_qkv(&x, 0, &AttentionConfig::causal()).is_err());
    let bad_mask = AttentionConfig::causal().with_mask(rand_seeded(2, &[4, 5], 1.0, DType::F32)?);
    assert!(attention_qkv(&x, 2, &bad_mask).is_err());
    let bad_p = AttentionConfig::causal().with_dropout(1.0, RngKey::new(0, 0));
    assert!(attention_qkv(&x, 2, &bad_p).is_err());
    let q = rand_seeded(3, &[1, 2, 3, 4], 1.0, DType::F32)?;
    let k = rand_seeded(4, &[1, 2, 5, 3], 1.0, DType::F32)?;
    assert!(attention(&q, &k, &k, &AttentionConfig::full()).is_err());
    let k64 = rand_seeded(4, &[1, 2, 5, 4], 1.0, DType::F64)?;
    assert!(attention(&q, &k64, &k64, &AttentionConfig::full()).is_err());
    Ok(())
}

#[test]
fn rejects_bad_gqa_window_and_doc_arguments() -> Result<()> {
    let (dt, c) = (DType::F32, AttentionConfig::causal());
    let ids = |n: usize, dt: DType| Tensor::zeros((2, n), dt, &Device::Cpu);
    let q = rand_seeded(1, &[2, 6, 5, 8], 1.0, dt)?;
    let (k, v) = (
        rand_seeded(2, &[2, 4, 7, 8], 1.0, dt)?,
        rand_seeded(3, &[2, 4, 7, 8], 1.0, dt)?,
    );
    let (q3, k3, v3) = (q.clone(), k.narrow(1, 0, 3)?, v.narrow(1, 0, 3)?);
    let qkv = rand_seeded(2, &[2, 7, 3 * 16], 1.0, dt)?;
    let with = |cfg: &AttentionConfig| attention(&q3, &k3, &v3, cfg);
    // (what, the op named in the message, the call)
    let cases = [
        ("H % KV", "attention", attention(&q, &k, &v, &c)),
        (
            "H % KV",
            "attention_merged",
            attention_merged(&q, &k, &v, &c),
        ),
        (
            "H % KV",
            "attention_composite",
            attention_composite(&q, &k, &v, &c),
        ),
        (
            "KV = 0",
            "attention",
            attention(&q3, &k3.narrow(1, 0, 0)?, &v3.narrow(1, 0, 0)?, &c),
        ),
        (
            "v heads",
            "attention",
            attention(&q3, &k3, &v3.narrow(1, 0, 1)?, &c),
        ),
        ("w = 0", "attention", with(&c.clone().with_window(0))),
        (
            "w, not causal",
            "attention",
            with(&AttentionConfig::full().with_window(3)),
        ),
        (
            "ids shape",
            "attention",
            with(&c.clone().with_doc_ids(ids(5, DType::U32)?)),
        ),
        (
            "ids dtype",
            "attention",
            with(&c.clone().with_doc_ids(ids(7, DType::F32)?)),
        ),
        (
            "Tq > Tk with ids",
            "attention",
            attention(
                &k3.repeat((1, 2, 1, 1))?,
                &q3.narrow(1, 0, 3)?,
                &q3.narrow(1, 0, 3)?,
                &AttentionConfig::full().with_doc_ids(ids(5, DType::U32)?),
            ),
        ),
        (
            "qkv w = 0",
            "attention_qkv",
            attention_qkv(&qkv, 2, &c.clone().with_window(0)),
        ),
    ];
    for (what, name, r) in cases {
        let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.starts_with(&format!("{name}:")), "{what}: got {msg:?}");
    }
    assert!(with(&AttentionConfig::full().with_doc_ids(ids(7, DType::U32)?)).is_ok());
    // The qkv path takes the options too.
    let docs = Tensor::new(
        &[[0u32, 0, 1, 2, 2, 2, 2], [5, 5, 5, 5, 4, 3, 3]],
        &Device::Cpu,
    )?;
    let cfg = c.with_window(3).with_doc_ids(docs);
    let (y, yr) = (
        attention_qkv(&qkv, 2, &cfg)?,
        attention_qkv_composite(&qkv, 2, &cfg)?,
    );
    compare::assert_close(&y, &yr, 1e-5, "qkv with window and documents");
    Ok(())
}

#[test]
fn offset_key_gives_the_rows_of_the_whole_batch() -> Result<()> {
    // Attention over a slice of batch rows, keyed with the offset of its first probability
    // (`row * H * T * T`), equals those rows of the whole batch's attention: values and
    // gradients bit for bit (pipeline microbatches with dropout).
    let (b, t, h, d) = (5, 19, 2, 4);
    let qkv = rand_seeded(8, &[b, t, 3 * h * d], 1.0, DType::F32)?;
    let key = RngKey::new(21, 3);
    let cfg = AttentionConfig::causal().with_dropout(0.3, key);
    let probe = rand_seeded(9, &[b, t, h * d], 1.0, DType::F32)?;
    let (y, g) = value_and_grads(
        &|x| attention_qkv(&x[0], h, &cfg),
        std::slice::from_ref(&qkv),
        &probe,
    )?;
    let mut ys = Vec::new();
    let mut gs = Vec::new();
    for (start, rows) in [(0usize, 2usize), (2, 2), (4, 1)] {
        let part = qkv.narrow(0, start, rows)?;
        let cfg = AttentionConfig::causal()
            .with_dropout(0.3, key.with_offset((start * h * t * t) as u64));
        // The same upstream gradient rows as the whole-batch call.
        let (yp, gp) = value_and_grads(
            &|x| attention_qkv(&x[0], h, &cfg),
            std::slice::from_ref(&part),
            &probe.narrow(0, start, rows)?,
        )?;
        ys.push(yp);
        gs.push(gp[0].clone());
    }
    same_bits(&Tensor::cat(&ys, 0)?, &y, "value")?;
    same_bits(&Tensor::cat(&gs, 0)?, &g[0], "dqkv")?;
    Ok(())
}
