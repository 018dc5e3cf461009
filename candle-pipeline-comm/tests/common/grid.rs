//! Training through a 2D grid (pipeline × data parallel) and the two single-process references
//! it is checked against, shared by `tests/grid_2d.rs` and the `mpi_pipeline_2d` example.
//!
//! - `train_grid`: one rank of the grid (`Grid2D` over any world communicator).
//! - `train_emulated`: one process doing what the grid does in the same order: every replica's
//!   `Pipeline::step` on its share, gradients and losses summed in replica order (as the thread
//!   backend and a 2-rank MPI all-reduce sum them), the same optimizer: bit-identical.
//! - `train_plain`: the plain model (no pipeline, no microbatches) on the global batch: only the
//!   order of f32 sums differs (per microbatch and per replica partial sums), within `TOL`.

use anyhow::{Context, Result};
use candle_comm::Communicator;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, SGD};
use candle_pipeline::{Layer, LossReduction, Schedule};
use candle_pipeline_comm::{Grid2D, GridError, Topology};

use candle_nn::loss::mse;

use super::{
    mlp, pipeline, pipeline_of, plain_for_worker, values, worker_grads, DIM, MICROBATCHES, ROWS,
};

/// Optimizer steps per run.
pub const STEPS: usize = 3;
/// Gradient bucket size: the 512x512 weights (1 MiB) get buckets of their own, biases share.
pub const BUCKET_BYTES: usize = 1 << 20;
/// Relative tolerance against the plain model at the same weights (max |a - b| / max |b| per
/// step, over the rank's tensors): only the order of f32 sums differs (per microbatch and per
/// replica partial sums instead of one sum over the batch). f32's epsilon is 1.2e-7; the worst
/// case observed here is 7.9e-7 (6.6 ulps of the largest gradient, the same as the pipeline
/// alone); 2e-6 (~17 ulps) leaves room for other GEMM kernels, and stays far below any real bug
/// (a missing or mis-weighted replica changes gradients by tens of percent).
pub const TOL: f64 = 2e-6;
/// Relative tolerance of the weights after `STEPS` AdamW steps against the plain model's own
/// AdamW run: rounding differences compound, and AdamW's first updates are about `lr * sign(g)`
/// (lr = 1e-3, max |w| = 0.5), so elements whose gradient is near rounding noise can move
/// differently by up to one update (2e-3 relative); observed 4.4e-5.
pub const TRAJECTORY_TOL_ADAMW: f64 = 1e-3;

/// The optimizers checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opt {
    /// SGD, learning rate 0.05.
    Sgd,
    /// AdamW, learning rate 1e-3, weight decay 0.01.
    AdamW,
}

enum Optim {
    Sgd(SGD),
    AdamW(AdamW),
}

impl Optim {
    fn new(opt: Opt, vars: Vec<Var>) -> Result<Self> {
        Ok(match opt {
            Opt::Sgd => Optim::Sgd(SGD::new(vars, 0.05)?),
            Opt::AdamW => Optim::AdamW(AdamW::new(
                vars,
                ParamsAdamW {
                    lr: 1e-3,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?),
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        match self {
            Optim::Sgd(o) => o.step(grads)?,
            Optim::AdamW(o) => o.step(grads)?,
        }
        Ok(())
    }
}

/// The schedules checked, with their virtual stages per worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// GPipe, one stage per worker.
    GPipe,
    /// 1F1B, one stage per worker.
    OneFOneB,
    /// Interleaved 1F1B, two stages per worker.
    Interleaved,
}

impl Kind {
    /// All of them.
    pub const ALL: [Kind; 3] = [Kind::GPipe, Kind::OneFOneB, Kind::Interleaved];

    /// Virtual stages per worker.
    pub fn v(self) -> usize {
        if self == Kind::Interleaved {
            2
        } else {
            1
        }
    }

    /// The schedule for `workers` workers.
    pub fn schedule(self, workers: usize) -> Result<Schedule> {
        Ok(match self {
            Kind::GPipe => Schedule::gpipe(workers, MICROBATCHES)?,
            Kind::OneFOneB => Schedule::one_f_one_b(workers, MICROBATCHES)?,
            Kind::Interleaved => Schedule::interleaved(workers, 2, MICROBATCHES)?,
        })
    }
}

/// Losses, gradients and final weights of a run. For a grid rank: its worker's parameters (in
/// `Grid2D::vars` order) and the global loss on the last stage (0 elsewhere); for the references:
/// every layer's `[w, b]` in layer order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// Loss of each step.
    pub losses: Vec<f64>,
    /// Gradients of each step.
    pub grads: Vec<Vec<Vec<f32>>>,
    /// Parameters after the last step.
    pub weights: Vec<Vec<f32>>,
}

/// The global batch of step `step` (the same in every process).
pub fn step_batch(step: usize) -> Result<(Tensor, Tensor)> {
    let s = 1000 + 10 * step as u64;
    let x = Tensor::from_vec(values(s, ROWS * DIM, 1.0), (ROWS, DIM), &Device::Cpu)?;
    let t = Tensor::from_vec(values(s + 1, ROWS * DIM, 1.0), (ROWS, DIM), &Device::Cpu)?;
    Ok((x, t))
}

fn flat(vars: &[Var]) -> Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|v| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        .collect()
}

/// One rank of a `topology` grid over `world`, training `STEPS` steps. `fail = Some((replica,
/// layer, call))`: on that replica, layer `layer` fails on its `call`-th forward.
pub fn train_grid<C: Communicator + ?Sized>(
    world: &C,
    topology: Topology,
    kind: Kind,
    opt: Opt,
    fail: Option<(usize, usize, usize)>,
) -> std::result::Result<Trace, GridError> {
    let grid = Grid2D::new(world, topology)?;
    let run = || -> Result<Trace> {
        let fail_at = fail
            .filter(|&(r, _, _)| r == grid.replica())
            .map(|(_, layer, call)| (layer, call));
        let worker = pipeline(topology.stages, kind.v(), fail_at)?.into_worker(grid.stage())?;
        let buckets = Grid2D::buckets(&worker, BUCKET_BYTES);
        buckets.check_layout(grid.dp())?;
        let mut optim = Optim::new(opt, Grid2D::vars(&worker))?;
        let schedule = kind.schedule(topology.stages)?;
        let mut trace = Trace::default();
        for step in 0..STEPS {
            let (x, t) = step_batch(step)?;
            let batch = grid.replica_batch(&x, &t, MICROBATCHES, LossReduction::Mean)?;
            let out = grid.step(&worker, &schedule, &batch, &buckets)?;
            trace.losses.push(out.loss);
            trace.grads.push(worker_grads(&worker, &out.grads)?);
            optim.step(&out.grads)?;
        }
        trace.weights = flat(&Grid2D::vars(&worker))?;
        Ok(trace)
    };
    // Keep the grid's errors typed (the failure tests look at them).
    match run() {
        Ok(trace) => Ok(trace),
        Err(e) => match e.downcast::<GridError>() {
            Ok(g) => Err(g),
            Err(e) => Err(GridError::Topology(format!("{e:#}"))),
        },
    }
}

/// What the grid computes, in one process: per step, every replica's `Pipeline::step` on its
/// share, gradients summed in replica order in f32, losses in f64, then one optimizer step.
/// Returns that trace and, at the same weights every step, the plain model's loss and gradients
/// on the global batch (so that each step compares summation orders only, without the drift of
/// two trajectories).
pub fn train_emulated(topology: Topology, kind: Kind, opt: Opt) -> Result<(Trace, Trace)> {
    let (layers, vars) = mlp(topology.stages * kind.v(), None)?;
    let pipe = pipeline_of(layers.clone(), topology.stages)?;
    let mut optim = Optim::new(opt, vars.clone())?;
    let schedule = kind.schedule(topology.stages)?;
    let (mut trace, mut plain) = (Trace::default(), Trace::default());
    for step in 0..STEPS {
        let (x, t) = step_batch(step)?;
        let (l, g) = plain_step(&layers, &x, &t)?;
        plain.losses.push(l);
        plain.grads.push(flat_grads(&vars, &g)?);
        let (mut loss, mut sums) = (0f64, vec![None::<Tensor>; vars.len()]);
        for r in 0..topology.replicas {
            let batch = topology.replica_batch(r, &x, &t, MICROBATCHES, LossReduction::Mean)?;
            let out = pipe.step(&schedule, &batch)?;
            loss += out.loss;
            for (sum, v) in sums.iter_mut().zip(&vars) {
                let g = out.grads.get(v.as_tensor()).context("gradient")?.clone();
                *sum = Some(match sum.take() {
                    None => g,
                    Some(acc) => (acc + g)?,
                });
            }
        }
        let mut grads = GradStore::default();
        for (sum, v) in sums.into_iter().zip(&vars) {
            grads.insert(v.as_tensor(), sum.context("gradient")?);
        }
        trace.losses.push(loss);
        trace.grads.push(flat_grads(&vars, &grads)?);
        optim.step(&grads)?;
    }
    trace.weights = flat(&vars)?;
    plain.weights = trace.weights.clone();
    Ok((trace, plain))
}

/// The plain model of `layers` layers trained on the global batch with the same optimizer (its
/// own trajectory).
pub fn train_plain(layers: usize, opt: Opt) -> Result<Trace> {
    let (layers, vars) = mlp(layers, None)?;
    let mut optim = Optim::new(opt, vars.clone())?;
    let mut trace = Trace::default();
    for step in 0..STEPS {
        let (x, t) = step_batch(step)?;
        let (l, grads) = plain_step(&layers, &x, &t)?;
        trace.losses.push(l);
        trace.grads.push(flat_grads(&vars, &grads)?);
        optim.step(&grads)?;
    }
    trace.weights = flat(&vars)?;
    Ok(trace)
}

/// Loss and gradients of the plain model (`layers` in a chain, MSE) on `x`, `t`.
fn plain_step(layers: &[Layer], x: &Tensor, t: &Tensor) -> Result<(f64, GradStore)> {
    let mut h = x.clone();
    for l in layers {
        h = l.forward(&h)?;
    }
    let l = mse(&h, t)?;
    let grads = l.backward()?;
    Ok((l.to_dtype(DType::F64)?.to_scalar::<f64>()?, grads))
}

fn flat_grads(vars: &[Var], grads: &GradStore) -> Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|v| {
            let g = grads.get(v.as_tensor()).context("gradient")?;
            Ok(g.flatten_all()?.to_vec1::<f32>()?)
        })
        .collect()
}

/// The part of a reference trace (every layer) that belongs to pipeline worker `stage` of a
/// `stages`-worker pipeline with `v` layers per worker (`Grid2D::vars` order).
pub fn for_worker(full: &Trace, stages: usize, v: usize, stage: usize) -> Result<Trace> {
    let worker = pipeline(stages, v, None)?.into_worker(stage)?;
    Ok(Trace {
        losses: full.losses.clone(),
        grads: full
            .grads
            .iter()
            .map(|g| plain_for_worker(g, &worker))
            .collect(),
        weights: plain_for_worker(&full.weights, &worker),
    })
}
