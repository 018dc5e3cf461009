//! Scaler state: safetensors round trip and bit-exact resume.

mod common;

use candle_amp::{Amp, MasterWeights, Plain, ScalerConfig, ScalerState, StepOutcome, WeightMode};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use std::collections::HashMap;
use test_support::compare::values;
use test_support::fs::TempDir;
use test_support::random::{rng, uniform};

/// The metadata of a safetensors file.
fn file_metadata(path: &std::path::Path) -> anyhow::Result<HashMap<String, String>> {
    let bytes = std::fs::read(path)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
    Ok(header.metadata().clone().unwrap_or_default())
}

#[test]
fn state_round_trips_through_tensors_and_files() -> anyhow::Result<()> {
    let st = ScalerState {
        scale: 0.1f64 * 3.0, // not a power of two: exercises exact float formatting
        growth_tracker: 17,
        hysteresis_left: 2,
        steps: 1 << 40,
        applied: 123,
        skipped: 45,
        overflows: 46,
        consecutive_skips: 3,
        backoffs: 7,
        growths: 8,
    };
    let dev = Device::Cpu;
    assert_eq!(
        ScalerState::from_tensors(&st.to_tensors("x.", &dev)?, "x.")?,
        st
    );
    let dir = TempDir::new("candle-amp-state");
    let path = dir.join("roundtrip.safetensors");
    st.save(&path)?;
    assert_eq!(ScalerState::load(&path)?, st);
    // The file format: both tensors and every field as exact metadata, under `amp.`.
    let meta = file_metadata(&path)?;
    assert_eq!(meta["amp.scale"], "0.30000000000000004");
    assert_eq!(meta["amp.steps"], (1u64 << 40).to_string());
    let tensors = candle_core::safetensors::load(&path, &dev)?;
    assert_eq!(tensors["amp.scale"].to_vec1::<f64>()?, [st.scale]);
    assert_eq!(tensors["amp.counters"].dims(), [9]);
    Ok(())
}

/// A tiny f16 regression whose inputs at steps 2, 3 and 8 are huge, so those steps overflow.
struct Run {
    w: Var,
    amp: Amp,
    opt: candle_nn::SGD,
}

fn fresh(w0: &Tensor) -> anyhow::Result<Run> {
    let w = Var::from_tensor(&w0.copy()?)?;
    let mw = MasterWeights::new([("w".to_string(), w.clone())], DType::F16, WeightMode::Cast)?;
    let cfg = ScalerConfig::dynamic()
        .init_scale(1024.0)
        .growth_interval(3)
        .hysteresis(2);
    let amp = Amp::new(mw, cfg)?;
    let opt = candle_nn::SGD::new(amp.weights().master_vars(), 1e-2)?;
    Ok(Run { w, amp, opt })
}

fn step(run: &mut Run, i: u64, dev: &Device) -> anyhow::Result<StepOutcome> {
    let big = if [2, 3, 8].contains(&i) { 1e4 } else { 1.0 };
    let x = (uniform(&mut rng(i), &[4, 6], -1.0, 1.0, dev) * big)?;
    let y = uniform(&mut rng(i + 1000), &[4, 2], -1.0, 1.0, dev);
    let pred = x
        .to_dtype(DType::F16)?
        .matmul(&run.w.as_tensor().to_dtype(DType::F16)?)?;
    let loss = (pred.to_dtype(DType::F32)? - y)?.sqr()?.mean_all()?;
    let grads = run.amp.backward(&loss)?;
    Ok(run.amp.step(&grads, &mut Plain(&mut run.opt))?)
}

#[test]
fn resumed_run_equals_uninterrupted_run() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w0 = uniform(&mut rng(7), &[6, 2], -0.5, 0.5, &dev);
    let n = 12;
    let mut full = fresh(&w0)?;
    let mut outcomes = Vec::new();
    for i in 0..n {
        outcomes.push(step(&mut full, i, &dev)?);
    }
    assert!(full.amp.state().skipped >= 2, "the run must exercise skips");
    assert!(
        full.amp.state().growths >= 1,
        "the run must exercise growth"
    );

    // Interrupted run: the scaler state goes through a file, the master weights through a
    // copy (the trainer's checkpoint); SGD is stateless (candle-nn's AdamW state cannot be
    // saved, which is the trainer's business, not the scaler's).
    let mut first = fresh(&w0)?;
    let mut resumed_outcomes = Vec::new();
    for i in 0..n / 2 {
        resumed_outcomes.push(step(&mut first, i, &dev)?);
    }
    let dir = TempDir::new("candle-amp-resume");
    let path = dir.join("resume.safetensors");
    first.amp.save_state(&path)?;
    let meta = file_metadata(&path)?;
    assert!(meta["amp.config"].contains("growth_interval: 3"));
    let w_saved = first.w.as_tensor().copy()?;
    drop(first);
    let mut second = fresh(&w_saved)?;
    second.amp.load_state(&path)?;
    for i in n / 2..n {
        resumed_outcomes.push(step(&mut second, i, &dev)?);
    }
    assert_eq!(resumed_outcomes, outcomes);
    assert_eq!(second.amp.state(), full.amp.state());
    assert_eq!(values(second.w.as_tensor()), values(full.w.as_tensor()));
    Ok(())
}
