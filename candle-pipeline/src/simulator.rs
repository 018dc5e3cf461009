//! Predicting a schedule's timeline, bubble and activation memory from per-stage costs.

use crate::action::Action;
use crate::error::{PipelineError, Result};
use crate::report::{Span, Timeline};
use crate::schedule::Schedule;

/// Per-virtual-stage costs (any time unit) used by [`simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Costs {
    /// Forward cost of one microbatch on each virtual stage.
    pub forward: Vec<f64>,
    /// Backward cost of one microbatch on each virtual stage.
    pub backward: Vec<f64>,
    /// Latency added to every message between two different workers.
    pub comm: f64,
    /// Activation bytes one microbatch keeps alive on each virtual stage between its forward
    /// and backward (0 if unknown); used for [`Prediction::peak_activation_bytes`].
    pub activation_bytes: Vec<f64>,
}

impl Costs {
    /// The same forward and backward cost on every one of `stages` virtual stages, no latency.
    pub fn uniform(stages: usize, forward: f64, backward: f64) -> Self {
        Self {
            forward: vec![forward; stages],
            backward: vec![backward; stages],
            comm: 0.0,
            activation_bytes: vec![0.0; stages],
        }
    }
}

/// The outcome of [`simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Predicted timeline of every worker.
    pub timeline: Timeline,
    /// Peak number of `(microbatch, virtual stage)` activations held per worker (forward done,
    /// backward not yet done).
    pub peak_in_flight: Vec<usize>,
    /// Peak activation bytes held per worker, from [`Costs::activation_bytes`].
    pub peak_activation_bytes: Vec<f64>,
}

impl Prediction {
    /// Idle fraction of the workers over the makespan, see [`Timeline::bubble`].
    pub fn bubble(&self) -> f64 {
        self.timeline.bubble()
    }
}

/// Simulates `schedule`: each worker runs its list in order, an action starts when the worker is
/// free and its inputs are ready (forward: the previous stage's forward of the same microbatch;
/// backward: the next stage's backward of the same microbatch), plus `comm` across workers.
/// Returns an error naming the stuck actions if the schedule deadlocks.
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Prediction> {
    let (n, m, workers) = (schedule.stages, schedule.microbatches, schedule.workers);
    if costs.forward.len() != n || costs.backward.len() != n || costs.activation_bytes.len() != n {
        return Err(PipelineError::Config(format!(
            "costs are given for {} stages, the schedule has {n}",
            costs.forward.len()
        )));
    }
    let mut f_end = vec![f64::NAN; m * n];
    let mut b_end = vec![f64::NAN; m * n];
    let mut next = vec![0usize; workers];
    let mut free = vec![0.0f64; workers];
    let mut spans: Vec<Vec<Span>> = vec![vec![]; workers];
    let mut held = vec![(0usize, 0.0f64); workers];
    let mut peak = vec![0usize; workers];
    let mut peak_bytes = vec![0.0f64; workers];
    let total: usize = schedule.actions.iter().map(Vec::len).sum();
    let mut done = 0;
    while done < total {
        let mut progressed = false;
        for w in 0..workers {
            while let Some(&a) = schedule.actions[w].get(next[w]) {
                let (mb, st) = (a.mb(), a.stage());
                let dep = match a {
                    Action::Forward { .. } if st == 0 => Some(0.0),
                    Action::Forward { .. } => {
                        ready(&f_end, mb * n + st - 1, schedule, st - 1, w, costs)
                    }
                    Action::Backward { .. } if st + 1 == n => Some(f_end[mb * n + st]),
                    Action::Backward { .. } => {
                        ready(&b_end, mb * n + st + 1, schedule, st + 1, w, costs)
                    }
                };
                let Some(dep) = dep.filter(|d| !d.is_nan()) else {
                    break;
                };
                let start = free[w].max(dep);
                let cost = if a.is_forward() {
                    costs.forward[st]
                } else {
                    costs.backward[st]
                };
                let end = start + cost;
                let bytes = costs.activation_bytes[st];
                if a.is_forward() {
                    f_end[mb * n + st] = end;
                    held[w].0 += 1;
                    held[w].1 += bytes;
                    peak[w] = peak[w].max(held[w].0);
                    peak_bytes[w] = peak_bytes[w].max(held[w].1);
                } else {
                    b_end[mb * n + st] = end;
                    held[w].0 -= 1;
                    held[w].1 -= bytes;
                }
                spans[w].push(Span {
                    action: a,
                    start,
                    end,
                });
                free[w] = end;
                next[w] += 1;
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            let stuck: Vec<String> = (0..workers)
                .filter_map(|w| {
                    schedule.actions[w]
                        .get(next[w])
                        .map(|a| format!("worker {w}: {a}"))
                })
                .collect();
            return Err(PipelineError::InvalidSchedule(format!(
                "{} deadlocks; waiting: {}",
                schedule.name,
                stuck.join("; ")
            )));
        }
    }
    Ok(Prediction {
        timeline: Timeline::new(spans),
        peak_in_flight: peak,
        peak_activation_bytes: peak_bytes,
    })
}

fn ready(ends: &[f64], i: usize, s: &Schedule, from: usize, w: usize, c: &Costs) -> Option<f64> {
    let t = ends[i];
    if t.is_nan() {
        return None;
    }
    Some(if s.worker_of(from) == w {
        t
    } else {
        t + c.comm
    })
}

impl Schedule {
    /// Checks that every `(microbatch, stage)` has exactly one forward and one backward, on the
    /// worker of the stage, forward first, and that the lists cannot deadlock (a dependency
    /// simulation with unbounded message buffers completes).
    pub fn validate(&self) -> Result<()> {
        self.check_complete()?;
        simulate(self, &Costs::uniform(self.stages, 1.0, 2.0)).map(|_| ())
    }
}
