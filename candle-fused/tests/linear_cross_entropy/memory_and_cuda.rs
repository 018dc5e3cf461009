//! The peak memory of forward + backward against the logits' size, and the op on a CUDA
//! device against the CPU kernel (skipped without one). Helpers and tolerances: the parent.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::linear_cross_entropy::{
    default_chunk_rows, linear_cross_entropy, linear_cross_entropy_chunked,
    linear_cross_entropy_composite,
};
use test_support::alloc;

use super::common::*;
use super::{serial, Case, Views};

/// Peak heap bytes above the start while `f` runs (this binary's allocator counts them).
fn peak_during(f: impl FnOnce() -> Result<()>) -> Result<usize> {
    let base = alloc::reset_peak();
    f()?;
    Ok(alloc::peak_bytes() - base)
}

#[test]
fn peak_memory_stays_far_below_the_logits() -> Result<()> {
    let _s = serial();
    let (n, c, v) = (512usize, 64usize, 8192usize);
    let logits = n * v * 4; // 16 MiB
    let mut rng = Lcg(12);
    let case = Case::new((&[n], c, v), (Some(64), Some(0)), &[], &mut rng)?;
    let [x, w] = case.inputs(DType::F32, &mut rng)?;
    let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
    let fwd_bwd = |f: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>| {
        let once = || {
            peak_during(|| {
                let g = f(xv.as_tensor(), wv.as_tensor())?.backward()?;
                assert!(g.get(&xv).is_some() && g.get(&wv).is_some());
                Ok(())
            })
        };
        // The first call also allocates what lives on afterwards (the GEMM's per-thread
        // packing buffers): measure the second.
        once()?;
        once()
    };
    let t = &case.targets;
    let chunked = fwd_bwd(&|x, w| linear_cross_entropy_chunked(x, w, t, Some(0), 64))?;
    let default = fwd_bwd(&|x, w| linear_cross_entropy(x, w, t, Some(0)))?;
    let composite = fwd_bwd(&|x, w| linear_cross_entropy_composite(x, w, t, Some(0)))?;
    // What the op needs: in the forward dW and dx, one chunk of logits and the GEMM's packed
    // copy of one vocabulary block of it (4096 of the 8192 classes); in the backward three dW
    // and dx (Candle adds each gradient into a fresh zero tensor: the composite pays that
    // too); and change (the gradient store, a chunk of x, packing buffers): 1 MiB.
    let (dw, dx) = (v * c * 4, n * c * 4);
    let need = |rows: usize| {
        let fwd = dw + dx + rows * v * 4 + rows * 4096 * 4;
        fwd.max(3 * (dw + dx)) + (1 << 20)
    };
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    assert!(
        chunked <= need(64) && chunked < logits / 2,
        "chunk 64: peak {:.2} MiB (logits {:.0} MiB)",
        mib(chunked),
        mib(logits)
    );
    // The default chunk here is its 8 MiB floor (dW is only 2 MiB).
    let rows = default_chunk_rows(v, c);
    assert_eq!(rows, 256);
    assert!(
        default <= need(rows) && default < logits,
        "default chunk: peak {:.2} MiB (logits {:.0} MiB)",
        mib(default),
        mib(logits)
    );
    // The composite holds the logits and more: the measurement sees them.
    assert!(
        composite > 2 * logits,
        "composite: peak {:.2} MiB",
        mib(composite)
    );
    Ok(())
}

/// On a CUDA device (the op's fallback: the chunk loop from Candle ops) against the CPU kernel:
/// loss and gradients, tracked and detached, and a second backward; skipped without one. Same
/// tolerances as against the composite (cuBLAS sums in yet another order).
#[test]
fn on_cuda_matches_the_cpu() -> Result<()> {
    let _s = serial();
    let dev = match Device::new_cuda(0) {
        Ok(dev) => dev,
        Err(e) => {
            // the line `scripts/gpu/run.sh` looks for: a pass here is a skip
            let e = e.to_string();
            eprintln!(
                "on_cuda_matches_the_cpu: no CUDA device ({}), skipped",
                e.lines().next().unwrap_or("")
            );
            return Ok(());
        }
    };
    let mut rng = Lcg(14);
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 1.5e-2)] {
        let case = Case::new(
            (&[15], 24, 311),
            (Some(4), Some(7)),
            &[4, 5, 6, 7, 8],
            &mut rng,
        )?
        .viewed(Views::TransposedX);
        let ins = case.inputs(dt, &mut rng)?;
        let probe = Tensor::new(1.5f32, &Device::Cpu)?;
        let (y, g) = value_and_grads(&case.fused(), &ins, &probe)?;
        let t = case.targets.to_device(&dev)?;
        let on = |i: &[Tensor]| {
            let (x, w) = case.views.apply(i, case.c, case.v)?;
            linear_cross_entropy_chunked(&x, &w, &t, case.ignore, 4)
        };
        let gpu: Vec<Tensor> = ins
            .iter()
            .map(|i| i.to_device(&dev))
            .collect::<candle_core::Result<_>>()?;
        let (yg, gg) = value_and_grads(&on, &gpu, &probe.to_device(&dev)?)?;
        let plain = on(&gpu)?;
        let what = format!("CUDA {dt:?}");
        assert_close(
            &yg.to_device(&Device::Cpu)?,
            &y,
            tol,
            &format!("{what} loss"),
        )?;
        assert_close(
            &plain.to_device(&Device::Cpu)?,
            &y,
            tol,
            &format!("{what} untracked"),
        )?;
        for k in 0..2 {
            assert_close(
                &gg[k].to_device(&Device::Cpu)?,
                &g[k],
                tol,
                &format!("{what} {k}"),
            )?;
        }
        let vars: Vec<Var> = gpu
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let loss = (on(&ts)? * 2.0)?;
        let (first, second) = (loss.backward()?, loss.backward()?);
        for v in &vars {
            let (a, b) = (first.get(v).expect("grad"), second.get(v).expect("grad"));
            assert_close(
                &b.to_device(&Device::Cpu)?,
                &a.to_device(&Device::Cpu)?,
                1e-6,
                &what,
            )?;
        }
    }
    Ok(())
}
