//! Pipeline × data parallel on a thread world: `stages × replicas` ranks (2×2, and the
//! degenerate 2×1 and 1×2), each building the whole model and keeping its stage, train 3 steps
//! (SGD and AdamW, GPipe / 1F1B / interleaved 1F1B) through `Grid2D` on replica shares of a
//! global batch of 12 rows.
//!
//! Checked every step, on every rank: the loss (last stage) and the gradients of its parameters,
//! and the weights after the last step,
//! - bit-identical to one process doing the same sums in the same order (`train_emulated`: each
//!   replica's `Pipeline::step`, gradients summed in replica order);
//! - within `TOL` = 2e-6 relative (max |a - b| / max |b|) of the plain model on the global
//!   batch at the same weights: only the order of f32 sums differs (the pipeline sums
//!   per-microbatch partial gradients, the grid per-replica partial sums), a few ulps of the
//!   largest element (observed 7.9e-7; the errors are printed with `--nocapture`);
//! - the weights after 3 steps against the plain model's own run: within `TOL` for SGD, within
//!   `TRAJECTORY_TOL_ADAMW` = 1e-3 for AdamW (see its documentation).
//!
//! A failing stage on one replica stops all four ranks quickly, each naming its place.

mod common;

use std::time::{Duration, Instant};

use candle_comm::{run_threads, Communicator, Local, ThreadComm};
use candle_pipeline::PipelineError;
use candle_pipeline_comm::{Grid2D, GridError, Topology};
use common::grid::{
    for_worker, train_emulated, train_grid, train_plain, Kind, Opt, Trace, STEPS, TOL,
    TRAJECTORY_TOL_ADAMW,
};
use common::rel_err;

/// Runs the grid on threads; returns every rank's trace.
fn run_grid(
    topology: Topology,
    kind: Kind,
    opt: Opt,
    fail: Option<(usize, usize, usize)>,
) -> Vec<Result<Trace, GridError>> {
    let n = topology.world_size();
    run_threads(n, Duration::from_secs(30), |comm: ThreadComm| {
        train_grid(&comm, topology, kind, opt, fail)
    })
    .into_iter()
    .map(|r| r.expect("rank thread panicked"))
    .collect()
}

/// The first element where `a` and `b` differ (bits): `(tensor, index, a, b)`.
fn first_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> Option<(usize, usize, f32, f32)> {
    if a.len() != b.len() {
        return Some((a.len().min(b.len()), 0, f32::NAN, f32::NAN));
    }
    a.iter().zip(b).enumerate().find_map(|(t, (x, y))| {
        if x.len() != y.len() {
            return Some((t, x.len().min(y.len()), f32::NAN, f32::NAN));
        }
        x.iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != q.to_bits())
            .map(|i| (t, i, x[i], y[i]))
    })
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

#[test]
fn grid_matches_one_process_and_the_plain_model() -> anyhow::Result<()> {
    let (mut worst, mut drift_sgd, mut drift_adamw): (f64, f64, f64) = (0.0, 0.0, 0.0);
    for (stages, replicas) in [(2, 2), (2, 1), (1, 2)] {
        let topology = Topology::new(stages, replicas)?;
        for kind in Kind::ALL {
            for opt in [Opt::Sgd, Opt::AdamW] {
                let what = format!("{stages}x{replicas} {kind:?} {opt:?}");
                let (emulated, plain_here) = train_emulated(topology, kind, opt)?;
                let plain_run = train_plain(stages * kind.v(), opt)?;
                for (rank, trace) in run_grid(topology, kind, opt, None).into_iter().enumerate() {
                    let trace = trace?;
                    let (stage, replica) = topology.coords(rank);
                    let want = for_worker(&emulated, stages, kind.v(), stage)?;
                    let near = for_worker(&plain_here, stages, kind.v(), stage)?;
                    let last = stage + 1 == stages;
                    assert_eq!(trace.grads.len(), STEPS);
                    for step in 0..STEPS {
                        let at = format!(
                            "{what}, rank {rank} (stage {stage}, replica {replica}), step {step}"
                        );
                        let diff = first_diff(&trace.grads[step], &want.grads[step]);
                        assert!(
                            diff.is_none(),
                            "{at}: gradients differ from one process: {diff:?}"
                        );
                        let gerr = rel_err(&trace.grads[step], &near.grads[step]);
                        assert!(
                            gerr <= TOL,
                            "{at}: gradient error {gerr:e} vs the plain model"
                        );
                        worst = worst.max(gerr);
                        let (l, e, p) = (trace.losses[step], want.losses[step], near.losses[step]);
                        if last {
                            assert_eq!(l.to_bits(), e.to_bits(), "{at}: loss {l} vs {e}");
                            assert!(rel(l, p) <= TOL, "{at}: loss {l} vs plain {p}");
                            worst = worst.max(rel(l, p));
                        } else {
                            assert_eq!(l, 0.0, "{at}: loss off the last stage");
                        }
                    }
                    let diff = first_diff(&trace.weights, &want.weights);
                    assert!(
                        diff.is_none(),
                        "{what}, rank {rank}: weights differ: {diff:?}"
                    );
                    // The plain model's own trajectory: rounding differences compound over the
                    // steps (AdamW's normalised first steps amplify them where gradients are
                    // near zero), so its bound is looser.
                    let end = for_worker(&plain_run, stages, kind.v(), stage)?;
                    let werr = rel_err(&trace.weights, &end.weights);
                    let (bound, drift) = match opt {
                        Opt::Sgd => (TOL, &mut drift_sgd),
                        Opt::AdamW => (TRAJECTORY_TOL_ADAMW, &mut drift_adamw),
                    };
                    assert!(
                        werr <= bound,
                        "{what}, rank {rank}: weights {werr:e} from the plain run"
                    );
                    *drift = drift.max(werr);
                }
            }
        }
    }
    eprintln!(
        "largest relative error against the plain model at the same weights: {worst:e} \
         (tolerance {TOL:e}); weights after {STEPS} steps vs the plain model's own run: SGD \
         {drift_sgd:e} (tolerance {TOL:e}), AdamW {drift_adamw:e} (tolerance \
         {TRAJECTORY_TOL_ADAMW:e})"
    );
    Ok(())
}

#[test]
fn a_failing_stage_on_one_replica_stops_every_rank_naming_its_place() -> anyhow::Result<()> {
    // 2 stages x 2 replicas, 1F1B; on replica 1, layer 1 (stage 1: world rank 3) fails on its
    // second forward of step 0.
    let topology = Topology::new(2, 2)?;
    let start = Instant::now();
    let out = run_grid(topology, Kind::OneFOneB, Opt::Sgd, Some((1, 1, 1)));
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    let errs: Vec<String> = out
        .iter()
        .map(|r| match r {
            Err(e) => e.to_string(),
            Ok(_) => "finished".to_string(),
        })
        .collect();
    // The failing rank: its stage error.
    match &out[3] {
        Err(GridError::Pipeline {
            stage: 1,
            replica: 1,
            source,
        }) if matches!(**source, PipelineError::Stage { worker: 1, .. }) => {}
        _ => panic!("world rank 3: {}", errs[3]),
    }
    assert!(errs[3].contains("layer 1 failed on purpose"), "{}", errs[3]);
    // Its pipeline neighbour: aborted by pipeline worker 1.
    match &out[2] {
        Err(GridError::Pipeline {
            stage: 0,
            replica: 1,
            source,
        }) if matches!(
            **source,
            PipelineError::Aborted {
                worker: 0,
                cause: 1
            }
        ) => {}
        _ => panic!("world rank 2: {}", errs[2]),
    }
    // Replica 0 finished its pipeline and stops in the data-parallel all-reduce, naming itself
    // and the failed peer in the world and in its dp group.
    assert!(
        errs[1].starts_with(
            "stage 1, replica 0: world rank 1 of 4 (rank 0 of 2 in dp 1): rank 0, all_reduce: \
             rank 1 failed: stage 1, replica 1: worker 1, forward of microbatch 1"
        ) && errs[1].ends_with("[group rank 1 is world rank 3]"),
        "world rank 1: {}",
        errs[1]
    );
    assert!(
        errs[0].starts_with(
            "stage 0, replica 0: world rank 0 of 4 (rank 0 of 2 in dp 0): rank 0, all_reduce: \
             rank 1 failed: stage 0, replica 1: worker 0 aborted because worker 1 failed"
        ) && errs[0].ends_with("[group rank 1 is world rank 2]"),
        "world rank 0: {}",
        errs[0]
    );
    Ok(())
}

#[test]
fn a_world_that_is_not_stages_times_replicas_is_an_error() -> anyhow::Result<()> {
    let e = Grid2D::new(&Local::new(), Topology::new(2, 2)?).map(|_| ());
    assert_eq!(
        e.map_err(|e| e.to_string()),
        Err("2D grid: a world of 1 ranks is not 2 stages x 2 replicas (= 4 ranks)".to_string())
    );
    // Every rank of a 3-rank world refuses a 2x2 grid, before any communication.
    for r in run_threads(3, Duration::from_secs(10), |c| {
        Grid2D::new(&c, Topology::new(2, 2).expect("topology")).map(|_| c.rank())
    }) {
        assert!(matches!(r, Ok(Err(GridError::Topology(_)))));
    }
    assert!(Topology::new(0, 2).is_err());
    let t = Topology::new(3, 2)?;
    assert_eq!(
        (t.rank_of(1, 1), t.coords(4), t.world_size()),
        (4, (1, 1), 6)
    );
    // Replica shares: 12 rows over 2 replicas, 4 microbatches of 2, 2, 1, 1 rows weighted by
    // rows / 12; the weights of both replicas sum to 1.
    let (x, y) = common::grid::step_batch(0)?;
    let t = Topology::new(1, 2)?;
    let mut total = 0.0;
    for r in 0..2 {
        let b = t.replica_batch(r, &x, &y, 4, candle_pipeline::LossReduction::Mean)?;
        let w: Vec<f64> = (0..b.len()).map(|k| b.weight(k)).collect();
        assert_eq!(w, [2.0 / 12.0, 2.0 / 12.0, 1.0 / 12.0, 1.0 / 12.0]);
        total += w.iter().sum::<f64>();
    }
    assert!((total - 1.0).abs() < 1e-15);
    Ok(())
}
