//! A cost model of one training step on `stages × replicas` nodes: the pipeline's timeline from
//! `candle-pipeline`'s schedule simulator, then a ring all-reduce of each stage's gradients over
//! its replicas. **A model, not a measurement**: it predicts from stated inputs and ignores
//! everything it does not name (memory limits, contention, stragglers, kernel efficiency that
//! changes with the microbatch size, overlap of communication with compute).
//!
//! - **Pipeline**: [`candle_pipeline::simulate`] of the schedule with the per-stage forward and
//!   backward times of one microbatch; every activation or gradient crossing a stage boundary
//!   costs [`p2p_time`] of `activation_bytes`.
//! - **Data parallel**: after its last backward, each pipeline worker all-reduces its stages'
//!   gradients over the replicas with a ring: [`ring_all_reduce_time`] =
//!   `2(R-1)/R · bytes / bandwidth + 2(R-1) · latency`. Not overlapped with the backward pass
//!   (candle-comm's `GradBuckets` reduces after the step's backward, as this toolkit does).
//! - **Step** = `max over workers w (end of w's last action + its all-reduce)`.

use candle_pipeline::{simulate, Costs, PipelineError, Result, Schedule};

/// A node's network link: every node sends and receives at `bandwidth` at the same time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second, per direction.
    pub bandwidth: f64,
    /// Seconds per message (or per ring step).
    pub latency: f64,
}

impl Link {
    /// A link of `gbit` gigabits per second (10^9 bit/s) and `latency` seconds.
    pub fn gbit(gbit: f64, latency: f64) -> Self {
        Self {
            bandwidth: gbit * 1e9 / 8.0,
            latency,
        }
    }
}

/// Time of a ring all-reduce of `bytes` over `n` ranks: `2(n-1)/n · bytes / bandwidth +
/// 2(n-1) · latency` (reduce-scatter then all-gather, `n - 1` steps each); 0 for `n <= 1`.
pub fn ring_all_reduce_time(bytes: f64, n: usize, link: &Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n1 = (n - 1) as f64;
    2.0 * n1 / n as f64 * bytes / link.bandwidth + 2.0 * n1 * link.latency
}

/// Time of one point-to-point message of `bytes`: `latency + bytes / bandwidth`.
pub fn p2p_time(bytes: f64, link: &Link) -> f64 {
    link.latency + bytes / link.bandwidth
}

/// The pipeline schedule of a [`StepModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// [`Schedule::gpipe`].
    GPipe,
    /// [`Schedule::one_f_one_b`].
    OneFOneB,
    /// [`Schedule::interleaved`] with `chunks` virtual stages per worker.
    Interleaved {
        /// Virtual stages (model chunks) per worker.
        chunks: usize,
    },
}

/// The inputs of the model: one replica's pipeline, the number of replicas and the network.
///
/// `forward`, `backward` and `grad_bytes` have one entry per (virtual) stage; with
/// [`ScheduleKind::Interleaved`] there are `chunks` virtual stages per worker, otherwise one, and
/// the pipeline has `forward.len() / chunks` workers. Every worker and every replica is one node:
/// `nodes = workers × replicas`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepModel {
    /// Forward time of one microbatch on each stage (seconds).
    pub forward: Vec<f64>,
    /// Backward time of one microbatch on each stage (seconds).
    pub backward: Vec<f64>,
    /// Gradient bytes of each stage's parameters (parameters × bytes per gradient element).
    pub grad_bytes: Vec<f64>,
    /// Bytes of one microbatch's activation crossing a stage boundary (its gradient is as big).
    pub activation_bytes: f64,
    /// Tokens of one microbatch.
    pub tokens_per_microbatch: f64,
    /// Microbatches per replica per step.
    pub microbatches: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Data-parallel replicas.
    pub replicas: usize,
    /// The network between nodes.
    pub link: Link,
}

/// What [`StepModel::predict`] predicts for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPrediction {
    /// Nodes: pipeline workers × replicas.
    pub nodes: usize,
    /// Pipeline workers per replica.
    pub workers: usize,
    /// Predicted step time (seconds).
    pub step_time: f64,
    /// The pipeline's makespan (seconds), activation transfers included.
    pub pipeline_time: f64,
    /// Compute time of the busiest worker (sum of its forwards and backwards, seconds).
    pub compute_time: f64,
    /// The simulator's bubble: the idle fraction of the workers over the pipeline's makespan.
    pub bubble: f64,
    /// The ring all-reduce of the worker with the most gradient bytes (seconds).
    pub all_reduce_time: f64,
    /// Fraction of the step spent only in the data-parallel all-reduce: `(step_time -
    /// pipeline_time) / step_time`.
    pub comm_fraction: f64,
    /// Fraction of node time spent computing: `sum of all compute / (nodes × step_time)`.
    pub efficiency: f64,
    /// Tokens of one step over all replicas.
    pub tokens_per_step: f64,
    /// `tokens_per_step / step_time`.
    pub tokens_per_second: f64,
}

impl StepModel {
    /// A model whose whole-model forward and backward times per microbatch (on one node) and
    /// gradient bytes split evenly over `stages` stages (`stages × chunks` virtual stages for
    /// [`ScheduleKind::Interleaved`]); everything else as given.
    #[allow(clippy::too_many_arguments)]
    pub fn even(
        forward: f64,
        backward: f64,
        grad_bytes: f64,
        stages: usize,
        schedule: ScheduleKind,
        microbatches: usize,
        replicas: usize,
        link: Link,
    ) -> Self {
        let virt = stages.max(1) * chunks(schedule);
        let k = virt as f64;
        Self {
            forward: vec![forward / k; virt],
            backward: vec![backward / k; virt],
            grad_bytes: vec![grad_bytes / k; virt],
            activation_bytes: 0.0,
            tokens_per_microbatch: 0.0,
            microbatches,
            schedule,
            replicas,
            link,
        }
    }

    /// Sets [`StepModel::activation_bytes`] and [`StepModel::tokens_per_microbatch`].
    pub fn with_microbatch(mut self, activation_bytes: f64, tokens: f64) -> Self {
        self.activation_bytes = activation_bytes;
        self.tokens_per_microbatch = tokens;
        self
    }

    /// The schedule this model runs.
    pub fn build_schedule(&self) -> Result<Schedule> {
        let v = chunks(self.schedule);
        let n = self.forward.len();
        if n == 0 || n % v != 0 || self.backward.len() != n || self.grad_bytes.len() != n {
            return Err(PipelineError::Config(format!(
                "cost model: {} forward, {} backward and {} gradient-byte entries for {v} chunks \
                 per worker (need the same non-zero multiple of {v})",
                n,
                self.backward.len(),
                self.grad_bytes.len()
            )));
        }
        let (workers, m) = (n / v, self.microbatches);
        match self.schedule {
            ScheduleKind::GPipe => Schedule::gpipe(workers, m),
            ScheduleKind::OneFOneB => Schedule::one_f_one_b(workers, m),
            ScheduleKind::Interleaved { chunks } => Schedule::interleaved(workers, chunks, m),
        }
    }

    /// Predicts one step (see the [module documentation](self)).
    pub fn predict(&self) -> Result<StepPrediction> {
        let link_ok = self.link.bandwidth > 0.0 && self.link.latency >= 0.0;
        if self.replicas == 0 || !link_ok {
            return Err(PipelineError::Config(format!(
                "cost model: {} replicas, bandwidth {} B/s, latency {} s (need >= 1, > 0, >= 0)",
                self.replicas, self.link.bandwidth, self.link.latency
            )));
        }
        let schedule = self.build_schedule()?;
        let workers = schedule.workers;
        let comm = if workers > 1 {
            p2p_time(self.activation_bytes, &self.link)
        } else {
            0.0
        };
        let costs = Costs {
            forward: self.forward.clone(),
            backward: self.backward.clone(),
            comm,
            activation_bytes: vec![0.0; self.forward.len()],
        };
        let prediction = simulate(&schedule, &costs)?;
        let timeline = &prediction.timeline;
        let busy = timeline.busy();
        let mut step_time: f64 = 0.0;
        let mut all_reduce_time: f64 = 0.0;
        for (w, spans) in timeline.spans.iter().enumerate() {
            let end = spans.iter().map(|s| s.end).fold(0.0, f64::max);
            let bytes: f64 = (0..self.forward.len())
                .filter(|&vs| schedule.worker_of(vs) == w)
                .map(|vs| self.grad_bytes[vs])
                .sum();
            let ar = ring_all_reduce_time(bytes, self.replicas, &self.link);
            all_reduce_time = all_reduce_time.max(ar);
            step_time = step_time.max(end + ar);
        }
        let pipeline_time = timeline.makespan();
        let nodes = workers * self.replicas;
        let tokens_per_step =
            self.tokens_per_microbatch * self.microbatches as f64 * self.replicas as f64;
        let per_second = |x: f64| if step_time > 0.0 { x / step_time } else { 0.0 };
        Ok(StepPrediction {
            nodes,
            workers,
            step_time,
            pipeline_time,
            compute_time: busy.iter().copied().fold(0.0, f64::max),
            bubble: prediction.bubble(),
            all_reduce_time,
            comm_fraction: per_second(step_time - pipeline_time),
            efficiency: per_second(busy.iter().sum::<f64>() / workers as f64),
            tokens_per_step,
            tokens_per_second: per_second(tokens_per_step),
        })
    }
}

fn chunks(schedule: ScheduleKind) -> usize {
    match schedule {
        ScheduleKind::Interleaved { chunks } => chunks.max(1),
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    const FAST: Link = Link {
        bandwidth: 1e9,
        latency: 1e-3,
    };

    /// No latency: activation transfers of 0 bytes are free.
    const FREE: Link = Link {
        bandwidth: 1e9,
        latency: 0.0,
    };

    #[test]
    fn ring_all_reduce_matches_its_closed_form() {
        assert_eq!(ring_all_reduce_time(1e9, 1, &FAST), 0.0);
        // n = 2: one reduce-scatter and one all-gather step, half the bytes each.
        assert!(close(ring_all_reduce_time(1e9, 2, &FAST), 1.0 + 2e-3));
        // n = 8: 2 * 7/8 of the bytes, 14 latencies.
        assert!(close(ring_all_reduce_time(1e9, 8, &FAST), 1.75 + 14e-3));
        assert!(close(Link::gbit(100.0, 0.0).bandwidth, 12.5e9));
        assert!(close(p2p_time(5e8, &FAST), 0.5 + 1e-3));
    }

    #[test]
    fn gpipe_and_1f1b_bubble_is_s_minus_1_over_m_plus_s_minus_1() -> Result<()> {
        let (f, b) = (1.0, 2.0);
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for (s, m) in [(2, 1), (4, 8), (4, 32), (8, 8)] {
                let model = StepModel::even(s as f64 * f, s as f64 * b, 0.0, s, kind, m, 1, FREE);
                let p = model.predict()?;
                let closed = (s - 1) as f64 / (m + s - 1) as f64;
                assert!(
                    close(p.bubble, closed),
                    "{kind:?} S={s} M={m}: {}",
                    p.bubble
                );
                assert!(close(p.pipeline_time, (m + s - 1) as f64 * (f + b)));
                assert!(close(p.step_time, p.pipeline_time));
                assert!(close(p.compute_time, m as f64 * (f + b)));
                assert!(close(p.efficiency, 1.0 - closed));
            }
        }
        Ok(())
    }

    #[test]
    fn activation_transfers_add_two_latencies_per_boundary_to_gpipe() -> Result<()> {
        // Uniform stages: the forward wave crosses S - 1 boundaries, the backward wave too.
        let (s, m, f, b) = (4usize, 6usize, 1.0, 2.0);
        let model = StepModel::even(4.0 * f, 4.0 * b, 0.0, s, ScheduleKind::GPipe, m, 1, FAST)
            .with_microbatch(1e8, 1.0);
        let c = p2p_time(1e8, &FAST);
        let p = model.predict()?;
        let closed = (m + s - 1) as f64 * (f + b) + 2.0 * (s - 1) as f64 * c;
        assert!(
            close(p.pipeline_time, closed),
            "{} vs {closed}",
            p.pipeline_time
        );
        Ok(())
    }

    #[test]
    fn pure_data_parallel_is_compute_plus_one_ring_all_reduce() -> Result<()> {
        let (m, f, b, bytes) = (4usize, 0.5, 1.0, 4e8);
        for r in [1usize, 2, 8, 64] {
            let model = StepModel::even(f, b, bytes, 1, ScheduleKind::OneFOneB, m, r, FAST)
                .with_microbatch(1e6, 1024.0);
            let p = model.predict()?;
            let ar = ring_all_reduce_time(bytes, r, &FAST);
            assert!(close(p.step_time, m as f64 * (f + b) + ar));
            assert!(close(p.all_reduce_time, ar));
            assert_eq!((p.nodes, p.workers), (r, 1));
            assert!(close(p.bubble, 0.0));
            assert!(close(p.comm_fraction, ar / p.step_time));
            assert!(close(p.tokens_per_step, 1024.0 * m as f64 * r as f64));
            assert!(close(p.tokens_per_second, p.tokens_per_step / p.step_time));
        }
        Ok(())
    }

    #[test]
    fn each_stage_reduces_its_own_share_after_its_last_backward() -> Result<()> {
        // 1F1B: worker 0 ends last ((M + S - 1)(f + b)); worker S-1 ends (S - 1) b earlier.
        // With stage bytes 1/S of the model, the step is the makespan plus one stage's ring.
        let (s, m, r, bytes) = (4usize, 8usize, 16usize, 8e8);
        let model = StepModel::even(4.0, 8.0, bytes, s, ScheduleKind::OneFOneB, m, r, FREE);
        let p = model.predict()?;
        let ar = ring_all_reduce_time(bytes / s as f64, r, &FREE);
        assert!(close(p.step_time, (m + s - 1) as f64 * 3.0 + ar), "{p:?}");
        assert_eq!(p.nodes, 64);
        Ok(())
    }

    #[test]
    fn interleaving_shrinks_the_bubble_and_bad_inputs_are_errors() -> Result<()> {
        let one = StepModel::even(8.0, 16.0, 0.0, 4, ScheduleKind::OneFOneB, 8, 1, FAST);
        let inter = ScheduleKind::Interleaved { chunks: 2 };
        let two = StepModel::even(8.0, 16.0, 0.0, 4, inter, 8, 1, FAST);
        assert_eq!(two.forward.len(), 8);
        let (p1, p2) = (one.predict()?, two.predict()?);
        assert_eq!(p2.workers, 4);
        assert!(p2.bubble < p1.bubble, "{} vs {}", p2.bubble, p1.bubble);
        let mut bad = one.clone();
        bad.replicas = 0;
        assert!(bad.predict().is_err());
        let mut bad = one;
        bad.grad_bytes.pop();
        assert!(bad.predict().is_err());
        Ok(())
    }
}
