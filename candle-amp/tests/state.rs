//! Scaler state: safetensors round trip and bit-exact resume.

mod common;

use std::collections::HashMap;

use candle_amp::{Amp, MasterWeights, ScalerConfig, ScalerState, StepOutcome, WeightMode};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use test_support::compare::values;
use test_support::fs::TempDir;
use test_support::random::{rng, uniform};

#[test]
fn state_round_trips_through_tensors_metadata_and_files() -> anyhow::Result<()> {
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
    assert_eq!(ScalerState::from_metadata(&st.to_metadata("y/"), "y/")?, st);
    let dir = TempDir::new("candle-amp-state");
    let path = dir.join("roundtrip.safetensors");
    st.save(&path)?;
    assert_eq!(ScalerState::load(&path)?, st);
    // A file holding only the metadata (e.g. embedded in someone's checkpoint header).
    let meta_only = dir.join("meta.safetensors");
    let none: HashMap<String, Tensor> = HashMap::new();
    safetensors::serialize_to_file(none, Some(st.to_metadata("amp.")), &meta_only)?;
    assert_eq!(ScalerState::load(&meta_only)?, st);
    // Missing fields are an error, not a panic.
    let mut m = st.to_metadata("amp.");
    m.remove("amp.skipped");
    assert!(ScalerState::from_metadata(&m, "amp.").is_err());
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
    let opt = candle_nn::SGD::new(amp.master_vars(), 1e-2)?;
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
    Ok(run.amp.step(&mut run.opt, &grads)?)
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
    let meta = ScalerState::read_file_metadata(&path)?;
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
