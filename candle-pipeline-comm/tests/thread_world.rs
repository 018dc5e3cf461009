//! A 2-worker pipeline whose workers are ranks of candle-comm's thread world (one thread per
//! rank, each building the whole model and keeping its own worker, like one process per rank)
//! gives the same loss and gradients as the single-process `Pipeline::step` (bit-identical: the
//! same math in the same order, tensors cross the transport exactly) and as the plain model on
//! the full batch (1e-5 relative: the pipeline sums per-microbatch partial losses and gradients,
//! which changes f32 rounding by a few ulps).

mod common;

use std::time::{Duration, Instant};

use candle_comm::{run_threads, Communicator, ThreadComm};
use candle_pipeline::{PipelineError, Schedule, Transport};
use candle_pipeline_comm::CommTransport;
use common::*;

const WORKERS: usize = 2;
const TOL: f64 = 1e-5;

/// What one rank returns: loss, per-microbatch losses and its parameters' gradients.
type RankOut = (f64, Vec<(usize, f64)>, Vec<Vec<f32>>);

fn run_ranks(
    sched: &Schedule,
    v: usize,
    fail_at: Option<(usize, usize)>,
) -> Vec<Result<RankOut, PipelineError>> {
    run_threads(WORKERS, Duration::from_secs(30), |comm: ThreadComm| {
        let rank = comm.rank();
        let (_, _, batch) = batch().expect("batch");
        let worker = pipeline(WORKERS, v, fail_at)
            .expect("pipeline")
            .into_worker(rank)
            .expect("worker");
        let transport = CommTransport::for_worker(comm, &worker);
        let out = worker.step(sched, &batch, &transport)?;
        let grads = worker_grads(&worker, &out.grads).expect("gradients");
        Ok((out.loss, out.microbatch_losses, grads))
    })
    .into_iter()
    .map(|r| r.expect("rank thread panicked"))
    .collect()
}

#[test]
fn ranks_match_single_process_and_plain_model() -> anyhow::Result<()> {
    for (sched, v) in schedules(WORKERS)? {
        let (single, reference) = single_process(WORKERS, v, &sched)?;
        let (plain_loss, plain_grads) = plain(WORKERS * v)?;
        let ranks = run_ranks(&sched, v, None);
        for (rank, r) in ranks.into_iter().enumerate() {
            let (loss, mb_losses, grads) = r?;
            let worker = single.worker(rank).expect("worker");
            if worker.hosts_loss() {
                assert_eq!(
                    loss.to_bits(),
                    reference.loss.to_bits(),
                    "{}: loss",
                    sched.name
                );
                assert_eq!(mb_losses.len(), MICROBATCHES);
                let sum: f64 = mb_losses.iter().map(|(_, l)| l).sum();
                assert!((sum - loss).abs() <= 1e-12 * loss.abs());
                let lerr = (loss - plain_loss).abs() / plain_loss.abs();
                assert!(
                    lerr <= TOL,
                    "{}: loss {loss} vs plain {plain_loss}",
                    sched.name
                );
            } else {
                assert_eq!(loss, 0.0);
                assert!(mb_losses.is_empty());
            }
            let want = worker_grads(worker, &reference.grads)?;
            assert_eq!(
                grads, want,
                "{} rank {rank}: gradients differ from Pipeline::step",
                sched.name
            );
            let gerr = rel_err(&grads, &plain_for_worker(&plain_grads, worker));
            assert!(
                gerr <= TOL,
                "{} rank {rank}: gradient error {gerr:e}",
                sched.name
            );
        }
    }
    Ok(())
}

#[test]
fn step_with_over_a_thread_world_matches_in_process() -> anyhow::Result<()> {
    for (sched, v) in schedules(WORKERS)? {
        let (pipe, reference) = single_process(WORKERS, v, &sched)?;
        let (_, _, batch) = batch()?;
        let transports: Vec<_> = ThreadComm::world(WORKERS)
            .into_iter()
            .map(|c| CommTransport::new(c, pipe.stages(), candle_core::Device::Cpu))
            .collect();
        let out = pipe.step_with(&sched, &batch, transports)?;
        assert_eq!(out.loss.to_bits(), reference.loss.to_bits());
        for w in 0..WORKERS {
            let part = pipe.worker(w).expect("worker");
            assert_eq!(
                worker_grads(part, &out.grads)?,
                worker_grads(part, &reference.grads)?
            );
        }
    }
    Ok(())
}

#[test]
fn a_failing_stage_stops_the_other_rank_with_an_error_naming_it() -> anyhow::Result<()> {
    // Layer 1 (worker 1, last stage) fails on its third forward; layer 0 (worker 0) on its
    // second. Either way the other rank must stop quickly and name the failed worker.
    for (layer, bad) in [(1usize, 1usize), (0, 0)] {
        for (sched, _) in schedules(WORKERS)?.into_iter().filter(|(_, v)| *v == 1) {
            let start = Instant::now();
            let ranks = run_ranks(&sched, 1, Some((layer, 2 - layer)));
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "took {:?}",
                start.elapsed()
            );
            let good = 1 - bad;
            match &ranks[bad] {
                Err(PipelineError::Stage {
                    worker,
                    action,
                    source,
                }) => {
                    assert_eq!(*worker, bad);
                    assert!(source.to_string().contains("failed on purpose"), "{source}");
                    assert_eq!(action.stage(), layer);
                }
                other => panic!("{}: failing rank {bad}: {other:?}", sched.name),
            }
            match &ranks[good] {
                Err(e @ PipelineError::Aborted { worker, cause }) => {
                    assert_eq!((*worker, *cause), (good, bad));
                    assert!(
                        e.to_string().contains(&format!("worker {bad} failed")),
                        "{e}"
                    );
                }
                other => panic!("{}: other rank {good}: {other:?}", sched.name),
            }
        }
    }
    Ok(())
}

#[test]
fn tags_that_do_not_fit_and_wrong_ranks_are_errors() -> anyhow::Result<()> {
    let pipe = pipeline(WORKERS, 1, None)?;
    let (_, _, batch) = batch()?;
    let t = CommTransport::new(candle_comm::Local::new(), 2, candle_core::Device::Cpu);
    assert_eq!(t.tag(candle_pipeline::Payload::Gradient, 3, 1)?, 15);
    assert!(t
        .tag(candle_pipeline::Payload::Activation, 20_000, 0)
        .is_err());
    assert!(t.tag(candle_pipeline::Payload::Activation, 0, 2).is_err());
    assert!(t.recv().is_err());
    // A world of one rank is not this 2-worker pipeline's transport.
    let sched = Schedule::gpipe(WORKERS, MICROBATCHES)?;
    let worker = pipe.into_worker(0)?;
    match worker.step(&sched, &batch, &t) {
        Err(PipelineError::Config(m)) => assert!(m.contains("transport endpoint"), "{m}"),
        other => panic!("{other:?}"),
    }
    Ok(())
}
