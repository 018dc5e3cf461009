//! The oneDNN GEMM path (`candle_fused::onednn`, feature `onednn`), forced on with
//! `CANDLE_FUSED_ONEDNN=1` so it runs on any x86-64 (oneDNN picks AMX, AVX512-BF16 or AVX-512
//! kernels by CPUID itself). Without the feature every test prints that it is skipped.
//!
//! Tolerances, against the f64 product of the same (f32 or bf16) values, per element `(i, j)`:
//! `k · 2⁻²³ · (|A|·|B|)ᵢⱼ` (f32 accumulation of `k` terms in any order; bf16 × bf16 products
//! are exact in f32) plus, for a bf16 output, one bf16 rounding (`2⁻⁸ |ref|`).

mod common;

use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_fused::linear::{linear, matmul};
use common::*;

/// Forces oneDNN (before any GEMM of this process); a generator seeded with `seed` when the
/// tests can run, `None` (and a printed notice) without the feature.
fn on(test: &str, seed: u64) -> Option<Lcg> {
    static FORCE: std::sync::Once = std::sync::Once::new();
    FORCE.call_once(|| std::env::set_var("CANDLE_FUSED_ONEDNN", "1"));
    if !cfg!(feature = "onednn") {
        println!("{test}: skipped (candle-fused built without the `onednn` feature)");
        return None;
    }
    assert!(
        candle_fused::onednn::active(DType::F32) && candle_fused::onednn::active(DType::BF16),
        "CANDLE_FUSED_ONEDNN=1 must force oneDNN"
    );
    Some(Lcg(seed))
}

/// `a [m, k]` or its transpose stored `[k, m]` and read through `.t()`; `pad` extra columns
/// make the row stride longer than a row (a column slice of a wider matrix).
fn operand(r: usize, c: usize, t: bool, pad: usize, dt: DType, rng: &mut Lcg) -> Result<Tensor> {
    let (rows, cols) = if t { (c, r) } else { (r, c) };
    let x = rand(&[rows, cols + pad], dt, rng, 1.0, 0.0)?.narrow(1, 0, cols)?;
    Ok(if t { x.t()? } else { x })
}

/// Asserts `y` is `a · b` within the module's bound.
fn check(y: &Tensor, a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    let out_bf16 = y.dtype() == DType::BF16;
    let f64s = |t: &Tensor| t.to_dtype(DType::F64);
    let (a, b, y) = (f64s(a)?, f64s(b)?, f64s(y)?);
    let k = a.dim(1)? as f64;
    let want = a.matmul(&b)?;
    let mut bound = (a.abs()?.matmul(&b.abs()?)? * (k * 2f64.powi(-23)))?;
    if out_bf16 {
        bound = (bound + (want.abs()? * 2f64.powi(-8))?)?;
    }
    let excess = ((&y - &want)?.abs()? - &bound)?
        .max_all()?
        .to_scalar::<f64>()?;
    assert!(excess <= 0.0, "{what}: error above the bound by {excess:e}");
    Ok(())
}

#[test]
fn matches_the_f64_product_on_every_layout() -> Result<()> {
    let Some(mut rng) = on("matches_the_f64_product_on_every_layout", 36) else {
        return Ok(());
    };
    // odd sizes; 300 rows and 385 columns: several 128-wide bands along either side
    for (m, k, n) in [
        (1, 1, 1),
        (3, 5, 7),
        (19, 37, 23),
        (300, 67, 129),
        (65, 130, 385),
    ] {
        for dt in [DType::F32, DType::BF16] {
            for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
                for pad in [0, 3] {
                    let a = operand(m, k, a_t, pad, dt, &mut rng)?;
                    let b = operand(k, n, b_t, pad, dt, &mut rng)?;
                    let what = format!("{dt:?} {m}x{k}x{n} a_t {a_t} b_t {b_t} pad {pad}");
                    check(&matmul(&a, &b)?, &a, &b, &what)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_one_two_and_three_threads() -> Result<()> {
    let Some(mut rng) = on("same_bits_on_one_two_and_three_threads", 37) else {
        return Ok(());
    };
    let f = |t: &[Tensor]| linear(&t[0], &t[1].t()?, Some(&t[2]));
    // `linear` with a bias (the GEMM accumulates into the bias rows) and its backward (dx, and
    // dW as a transposed product): bands along rows and along columns
    for (rows, n_in, n_out) in [(300, 96, 160), (40, 200, 385), (4096, 16, 24)] {
        for dt in [DType::F32, DType::BF16] {
            let x = rand(&[rows, n_in], dt, &mut rng, 1.0, 0.0)?;
            let w = rand(&[n_out, n_in], dt, &mut rng, 1.0, 0.0)?;
            let b = rand(&[n_out], dt, &mut rng, 1.0, 0.0)?;
            let probe = rand(&[rows, n_out], dt, &mut rng, 1.0, 0.0)?;
            let what = format!("{dt:?} {rows} x {n_in} -> {n_out}");
            assert_same_bits_on_thread_counts(&f, &[x, w, b], &probe, &what)?;
        }
    }
    Ok(())
}
