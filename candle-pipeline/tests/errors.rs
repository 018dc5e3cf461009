//! A failing stage stops the pipeline cleanly and is reported with its worker and microbatch.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use candle_nn::loss::mse;
use candle_pipeline::{
    Action, LossReduction, Microbatches, Pipeline, PipelineError, Schedule, Stage,
};
use common::*;

/// Doubles its input; fails (or panics) on the microbatch whose first element is 2.
struct Faulty {
    panic: bool,
}

impl Stage for Faulty {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let first = x.flatten_all()?.get(0)?.to_scalar::<f32>()?;
        if first == 2.0 {
            if self.panic {
                panic!("boom on microbatch 2");
            }
            candle_core::bail!("bad input on microbatch 2");
        }
        x.affine(2.0, 0.0)
    }
    fn vars(&self) -> Vec<Var> {
        vec![]
    }
}

/// Rows of the input (and target) hold their row index, one row per microbatch. `failing_loss`
/// makes the loss (on the last worker) fail on microbatch 3 instead.
fn run_with_timeout(panic: bool, failing_loss: bool, sched: Schedule) -> PipelineError {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let dev = Device::Cpu;
        let (layers, _) = mlp(2, 5, &dev);
        let first: Box<dyn Stage> = if failing_loss {
            Box::new(candle_pipeline::Sequential::new(vec![]))
        } else {
            Box::new(Faulty { panic })
        };
        let stages: Vec<Box<dyn Stage>> = vec![
            first,
            Box::new(candle_pipeline::Sequential::new(layers[..1].to_vec())),
            Box::new(candle_pipeline::Sequential::new(layers[1..].to_vec())),
        ];
        let rows: Vec<f32> = (0..5)
            .flat_map(|r| std::iter::repeat_n(r as f32, DIM))
            .collect();
        let x = Tensor::from_vec(rows, (5, DIM), &dev).unwrap();
        let t = x.clone();
        let loss = move |y: &Tensor, t: &Tensor| {
            if failing_loss && t.flatten_all()?.get(0)?.to_scalar::<f32>()? == 3.0 {
                candle_core::bail!("loss failed on microbatch 3");
            }
            mse(y, t)
        };
        let pipe = Pipeline::new(stages, vec![dev.clone(); 3], loss).unwrap();
        let batch = Microbatches::split(&x, &t, 5, LossReduction::Mean).unwrap();
        let _ = tx.send(pipe.step(&sched, &batch).map(|o| o.loss));
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(l)) => panic!("expected an error, got loss {l}"),
        Ok(Err(e)) => e,
        Err(_) => panic!("pipeline hung"),
    }
}

#[test]
fn erroring_stage_surfaces_with_worker_and_microbatch() {
    for sched in [
        Schedule::gpipe(3, 5).unwrap(),
        Schedule::one_f_one_b(3, 5).unwrap(),
    ] {
        let e = run_with_timeout(false, false, sched);
        match &e {
            PipelineError::Stage {
                worker,
                action,
                source,
            } => {
                assert_eq!(*worker, 0);
                assert_eq!(*action, Action::Forward { mb: 2, stage: 0 });
                assert!(source.to_string().contains("bad input"), "{source}");
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(e.to_string().contains("microbatch 2"), "{e}");
    }
}

#[test]
fn panicking_stage_surfaces_without_hanging() {
    let e = run_with_timeout(true, false, Schedule::one_f_one_b(3, 5).unwrap());
    match e {
        PipelineError::Panic {
            worker,
            action,
            message,
        } => {
            assert_eq!((worker, action), (0, Action::Forward { mb: 2, stage: 0 }));
            assert!(message.contains("boom"));
        }
        other => panic!("unexpected error {other}"),
    }
}

#[test]
fn failing_loss_on_last_worker_surfaces() {
    for sched in [
        Schedule::gpipe(3, 5).unwrap(),
        Schedule::interleaved(3, 1, 5).unwrap(),
    ] {
        match run_with_timeout(false, true, sched) {
            PipelineError::Stage { worker, action, .. } => {
                assert_eq!((worker, action), (2, Action::Forward { mb: 3, stage: 2 }));
            }
            other => panic!("unexpected error {other}"),
        }
    }
}

/// A two-layer MLP on two workers, and a batch of 4 rows from `seed` in 2 microbatches.
fn two_workers(seed: u64) -> (Pipeline, Microbatches) {
    let dev = Device::Cpu;
    let (layers, _) = mlp(2, 6, &dev);
    let (x, _) = batch(seed, 4, &dev);
    let stages = candle_pipeline::split_by_params(layers, 2).unwrap();
    let pipe = Pipeline::new(stages, vec![dev.clone(); 2], mse).unwrap();
    (
        pipe,
        Microbatches::split(&x, &x, 2, LossReduction::Mean).unwrap(),
    )
}

#[test]
fn mismatched_schedule_is_rejected() {
    let (pipe, batch) = two_workers(1);
    let e = pipe
        .step(&Schedule::gpipe(2, 3).unwrap(), &batch)
        .unwrap_err();
    assert!(matches!(e, PipelineError::Config(_)), "{e}");
}

#[test]
fn hand_made_deadlocking_schedule_is_an_error_not_a_hang() {
    let (pipe, batch) = two_workers(2);
    // Fields are public: swap worker 1's microbatch order so it waits for microbatch 1 while
    // worker 0 waits for the gradient of microbatch 0.
    let mut sched = Schedule::one_f_one_b(2, 2).unwrap();
    sched.actions[1] = vec![
        Action::Forward { mb: 1, stage: 1 },
        Action::Backward { mb: 1, stage: 1 },
        Action::Forward { mb: 0, stage: 1 },
        Action::Backward { mb: 0, stage: 1 },
    ];
    sched.actions[0] = vec![
        Action::Forward { mb: 0, stage: 0 },
        Action::Backward { mb: 0, stage: 0 },
        Action::Forward { mb: 1, stage: 0 },
        Action::Backward { mb: 1, stage: 0 },
    ];
    let e = pipe.step(&sched, &batch).unwrap_err();
    assert!(matches!(e, PipelineError::InvalidSchedule(_)), "{e}");
}
