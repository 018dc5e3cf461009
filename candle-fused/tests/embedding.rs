//! The embedding op against Candle's `embedding` (`index_select`, backward `index_add`):
//! the same bits for f32 / f64 tables (values and `dW`, which adds the same f32 values in the
//! same order from 0), for 16-bit tables `dW` within one rounding of the f64 sum (where
//! `index_add`, rounding after every add, is further off), the fallback path (Candle's
//! `index_add` in f32, rounded once: the CPU kernel's bits), the host ids (no read of the ids
//! tensor), thread-count independence, a tied table (the head's gradient plus this op's) and
//! the errors.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::embedding::{embedding, embedding_composite, id_reads};
use common::*;

/// `n` ids below `used` (< the table's rows: the rows from `used` on are absent), with
/// repeats; the first ones repeat id 1.
fn ids(n: usize, used: usize, seed: u64) -> Vec<u32> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|p| if p < 5 { 1 } else { rng.below(used) as u32 })
        .collect()
}

/// `(y, dW)` of `sum(f(w) * probe)`.
fn run(
    w: &Tensor,
    probe_seed: u64,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<(Tensor, Tensor)> {
    let v = Var::from_tensor(w)?;
    let y = f(v.as_tensor())?;
    let probe = rand_seeded(probe_seed, y.dims(), 1.0, y.dtype())?;
    let g = (&y * &probe)?.sum_all()?.backward()?;
    let dw = g.get(v.as_tensor()).expect("dW").clone();
    Ok((y, dw))
}

#[test]
fn same_bits_as_index_add_f32_f64() -> Result<()> {
    for (k, dt) in [DType::F32, DType::F64].into_iter().enumerate() {
        for (v, c, shape) in [(37, 19, [3, 41]), (5, 1, [1, 7]), (300, 64, [4, 97])] {
            let host = ids(shape.iter().product(), v - 3, 10 + k as u64);
            let t = Tensor::from_vec(host.clone(), &shape[..], &Device::Cpu)?;
            let w = rand_seeded(20 + v as u64, &[v, c], 1.0, dt)?;
            let (y, dw) = run(&w, 30, |w| embedding(w, &t, Some(&host)))?;
            let (yr, dwr) = run(&w, 30, |w| embedding_composite(w, &t))?;
            same_bits(&y, &yr, &format!("{dt:?} {v}x{c} y"))?;
            same_bits(&dw, &dwr, &format!("{dt:?} {v}x{c} dW"))?;
            assert_eq!(y.dims(), [shape[0], shape[1], c]);
        }
    }
    Ok(())
}

/// bf16 / f16: every element of `dW` is the f64 sum rounded once: within half a unit of the
/// format (2^-8 / 2^-11 relative), plus 5 % for the f32 sum's own error (~1e-6 of the terms
/// for these ~260 terms) across a rounding boundary;
/// `index_add` on the same ids (id 1 at 200 positions) is off by more.
#[test]
fn half_tables_sum_in_f32() -> Result<()> {
    for (dt, unit) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        let (v, c, n) = (11, 33, 400);
        let host: Vec<u32> = (0..n as u32)
            .map(|p| if p % 2 == 0 { 1 } else { p % 7 })
            .collect();
        let t = Tensor::new(host.as_slice(), &Device::Cpu)?;
        let w = rand_seeded(5, &[v, c], 1.0, dt)?;
        let (_, dw) = run(&w, 6, |w| embedding(w, &t, Some(&host)))?;
        let (_, dw_index_add) = run(&w, 6, |w| embedding_composite(w, &t))?;
        // the reference: the same probe, summed in f64
        let probe = rand_seeded(6, &[n, c], 1.0, dt)?.to_dtype(DType::F64)?;
        let zeros = Tensor::zeros((v, c), DType::F64, &Device::Cpu)?;
        let exact = zeros.index_add(&t, &probe, 0)?;
        let err = |d: &Tensor| -> Result<f64> {
            let d = d.to_dtype(DType::F64)?;
            let rel = ((d - &exact)?.abs()? / exact.abs()?.maximum(1e-3)?)?;
            Ok(rel.flatten_all()?.max(0)?.to_scalar::<f64>()?)
        };
        let (ours, theirs) = (err(&dw)?, err(&dw_index_add)?);
        assert!(ours <= unit * 1.05, "{dt:?}: dW off by {ours:e} > {unit:e}");
        assert!(
            ours < theirs,
            "{dt:?}: {ours:e} not below index_add's {theirs:e}"
        );
    }
    Ok(())
}

/// The fallback (CUDA with the kernels off, Metal) takes Candle's `index_add` into an f32
/// zero table: the CPU kernel's bits for every dtype (the same f32 adds in the same order).
#[test]
fn fallback_same_bits() -> Result<()> {
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let host = ids(203, 40, 3);
        let t = Tensor::from_vec(host.clone(), (7, 29), &Device::Cpu)?;
        let w = rand_seeded(8, &[45, 21], 1.0, dt)?;
        let kernel = run(&w, 9, |w| embedding(w, &t, Some(&host)))?;
        let fallback = candle_fused::with_composite_fallback(|| {
            run(&w, 9, |w| embedding(w, &t, Some(&host)))
        })?;
        same_bits(&fallback.0, &kernel.0, &format!("{dt:?} y"))?;
        same_bits(&fallback.1, &kernel.1, &format!("{dt:?} dW"))?;
    }
    Ok(())
}

#[test]
fn same_bits_on_thread_counts() -> Result<()> {
    // large enough for the row loop to run in parallel
    let (v, c) = (4099, 67);
    let host = ids(5000, v - 100, 4);
    let t = Tensor::new(host.as_slice(), &Device::Cpu)?;
    let w = rand_seeded(11, &[v, c], 1.0, DType::BF16)?;
    assert_same_on_thread_counts("embedding", || {
        let (y, dw) = run(&w, 12, |w| embedding(w, &t, Some(&host)))?;
        Ok((bits(&y), bits(&dw)))
    })
}

/// A table read by the embedding and by a head (`x wᵀ`): its gradient is the sum of both.
#[test]
fn tied_table_adds_both_gradients() -> Result<()> {
    let host = ids(30, 9, 5);
    let t = Tensor::new(host.as_slice(), &Device::Cpu)?;
    let w = rand_seeded(13, &[10, 6], 1.0, DType::F64)?;
    let head = |x: &Tensor, w: &Tensor| x.matmul(&w.t()?);
    let (_, both) = run(&w, 14, |w| head(&embedding(w, &t, Some(&host))?, w))?;
    let (_, reference) = run(&w, 14, |w| head(&embedding_composite(w, &t)?, w))?;
    assert_close(&both, &reference, 1e-12, "tied dW")?;
    Ok(())
}

/// Without host ids the backward reads the ids tensor once (counted); with them, never. The
/// gradients are the same. (The only test here that calls the op without host ids, so the
/// process-wide count is not raced.)
#[test]
fn host_ids_spare_the_read() -> Result<()> {
    let host = ids(50, 12, 6);
    let t = Tensor::new(host.as_slice(), &Device::Cpu)?;
    let w = rand_seeded(15, &[12, 5], 1.0, DType::F32)?;
    let before = id_reads();
    let (_, given) = run(&w, 16, |w| embedding(w, &t, Some(&host)))?;
    assert_eq!(id_reads(), before);
    let (_, read) = run(&w, 16, |w| embedding(w, &t, None))?;
    assert_eq!(id_reads(), before + 1);
    same_bits(&given, &read, "dW")?;
    // no gradient asked for: nothing read
    embedding(&w, &t, None)?;
    assert_eq!(id_reads(), before + 1);
    Ok(())
}

#[test]
fn errors_name_the_problem() -> Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::zeros((4, 3), DType::F32, &dev)?;
    let t = Tensor::new(&[0u32, 4, 1], &dev)?;
    let msg = |r: candle_core::Result<Tensor>| r.expect_err("an error").to_string();
    let e = msg(embedding(&w, &t, Some(&[0, 4, 1][..])));
    assert!(
        e.contains("id 4 at position 1") && e.contains("4 rows"),
        "{e}"
    );
    let e = msg(embedding(&w, &t, None));
    assert!(e.contains("id 4 at position 1"), "{e}");
    let e = msg(embedding(&w, &t, Some(&[0, 1][..])));
    assert!(e.contains("host_ids hold 2 ids, ids has 3"), "{e}");
    let e = msg(embedding(&w, &t.to_dtype(DType::I64)?, None));
    assert!(e.contains("ids must be u32"), "{e}");
    let e = msg(embedding(&w.flatten_all()?, &t, None));
    assert!(e.contains("must be [V, C]"), "{e}");
    Ok(())
}
