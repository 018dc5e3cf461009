//! Pipeline schedules as data: for every worker, the ordered list of actions it runs.
//!
//! Virtual stage `vs` (0-based, `num_stages = workers * v`) lives on worker `vs % workers`, so
//! with `v = 1` stage `s` is worker `s`, and with `v > 1` worker `w` holds the chunks
//! `w, w + S, w + 2S, ...` (Megatron's interleaved / lingvo's circular layout).
//! Communication is implicit: the output of `Forward { mb, stage }` goes to the worker of
//! `stage + 1`, the input gradient of `Backward { mb, stage }` to the worker of `stage - 1`.
//! A new schedule is a function returning a [`Schedule`]; [`Schedule::validate`] checks it.

use crate::action::Action;
use crate::error::{PipelineError, Result};

/// A complete pipeline schedule: per-worker action lists for one training step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Human-readable name ("gpipe", "1f1b", ...).
    pub name: String,
    /// Number of workers (threads / devices), `S`.
    pub workers: usize,
    /// Number of virtual stages (`S * v`).
    pub stages: usize,
    /// Number of microbatches, `m`.
    pub microbatches: usize,
    /// `actions[w]`: the actions of worker `w`, in execution order.
    pub actions: Vec<Vec<Action>>,
}

fn check_args(workers: usize, v: usize, m: usize) -> Result<()> {
    if workers == 0 || v == 0 || m == 0 {
        return Err(PipelineError::InvalidSchedule(format!(
            "workers ({workers}), virtual stages per worker ({v}) and microbatches ({m}) must be > 0"
        )));
    }
    Ok(())
}

impl Schedule {
    /// Worker hosting virtual stage `stage`.
    pub fn worker_of(&self, stage: usize) -> usize {
        stage % self.workers
    }

    /// Virtual stages per worker (`v`).
    pub fn virtual_per_worker(&self) -> usize {
        self.stages / self.workers.max(1)
    }

    /// GPipe: every worker runs all forwards, then all backwards (in reverse microbatch order).
    /// Each stage holds the activations of all `m` microbatches.
    pub fn gpipe(workers: usize, m: usize) -> Result<Self> {
        check_args(workers, 1, m)?;
        let actions = (0..workers)
            .map(|s| {
                let f = (0..m).map(|mb| Action::Forward { mb, stage: s });
                let b = (0..m).rev().map(|mb| Action::Backward { mb, stage: s });
                f.chain(b).collect()
            })
            .collect();
        Self::build("gpipe", workers, workers, m, actions)
    }

    /// 1F1B (PipeDream-flush): stage `s` runs `min(S - s - 1, m)` warm-up forwards, then
    /// alternates one forward and one backward, then drains the remaining backwards. Stage `s`
    /// holds at most `min(S - s, m)` microbatches of activations. Works for any `m >= 1`.
    pub fn one_f_one_b(workers: usize, m: usize) -> Result<Self> {
        check_args(workers, 1, m)?;
        let orders: Orders = (0..workers)
            .map(|s| (0..m).map(|mb| (mb, s)).collect())
            .collect();
        let warmups = (0..workers).map(|s| (workers - s - 1).min(m)).collect();
        Self::interleave("1f1b", workers, workers, m, &orders, &orders, warmups)
    }

    /// Interleaved 1F1B (Megatron-LM): `v` virtual stages per worker (model chunks `w, w+S, ...`).
    /// Microbatches are taken in groups of `S`, forwards go through the chunks in increasing order
    /// and backwards in decreasing order; worker `w` warms up with `2 (S - w - 1) + (v - 1) S`
    /// forwards. Works for any `m >= 1` (the warm-up grows where a partial last group needs it).
    /// The bubble is about `v` times smaller than 1F1B's.
    pub fn interleaved(workers: usize, v: usize, m: usize) -> Result<Self> {
        check_args(workers, v, m)?;
        if v == 1 {
            return Self::one_f_one_b(workers, m).map(|mut s| {
                s.name = "interleaved".into();
                s
            });
        }
        let (fwd, bwd) = chunk_orders(workers, v, m);
        let total = m * v;
        let mut warmups: Vec<usize> = (0..workers)
            .map(|w| (2 * (workers - w - 1) + (v - 1) * workers).min(total))
            .collect();
        // A partial last group can need a longer warm-up: grow it until the schedule is valid
        // (warm-up = total is the circular schedule, which is always valid).
        loop {
            let s = Self::interleave(
                "interleaved",
                workers,
                workers * v,
                m,
                &fwd,
                &bwd,
                warmups.clone(),
            )?;
            match s.validate() {
                Ok(()) => return Ok(s),
                Err(e) => {
                    if warmups.iter().all(|&w| w == total) {
                        return Err(e);
                    }
                    for w in warmups.iter_mut() {
                        *w = (*w + 1).min(total);
                    }
                }
            }
        }
    }

    /// Circular (lingvo's `circular_repeat`, GPipe with `v` chunks per worker): all forwards in
    /// the interleaved chunk order, then all backwards. Bubble about `v` times smaller than
    /// GPipe's, at GPipe's activation memory.
    pub fn circular(workers: usize, v: usize, m: usize) -> Result<Self> {
        check_args(workers, v, m)?;
        let (fwd, bwd) = chunk_orders(workers, v, m);
        Self::interleave(
            "circular",
            workers,
            workers * v,
            m,
            &fwd,
            &bwd,
            vec![m * v; workers],
        )
    }

    /// Builds a schedule from explicit per-worker lists and validates it.
    pub fn build(
        name: &str,
        workers: usize,
        stages: usize,
        microbatches: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Self> {
        let s = Self {
            name: name.into(),
            workers,
            stages,
            microbatches,
            actions,
        };
        s.validate()?;
        Ok(s)
    }

    /// Per worker: `warmup[w]` forwards, then one forward / one backward, then the backwards.
    fn interleave(
        name: &str,
        workers: usize,
        stages: usize,
        m: usize,
        fwd: &Orders,
        bwd: &Orders,
        warmups: Vec<usize>,
    ) -> Result<Self> {
        let mut actions = Vec::with_capacity(workers);
        for w in 0..workers {
            let mut f = fwd[w]
                .iter()
                .map(|&(mb, stage)| Action::Forward { mb, stage });
            let mut b = bwd[w]
                .iter()
                .map(|&(mb, stage)| Action::Backward { mb, stage });
            let mut list: Vec<Action> = f.by_ref().take(warmups[w]).collect();
            for a in f {
                list.push(a);
                list.extend(b.next());
            }
            list.extend(b);
            actions.push(list);
        }
        let s = Self {
            name: name.into(),
            workers,
            stages,
            microbatches: m,
            actions,
        };
        s.check_complete()?;
        Ok(s)
    }

    /// Checks that every `(microbatch, stage)` has exactly one forward and one backward, on the
    /// worker of the stage, forward first (the deadlock check is [`Schedule::validate`], in the
    /// simulator).
    pub(crate) fn check_complete(&self) -> Result<()> {
        let bad = |m: String| Err(PipelineError::InvalidSchedule(m));
        if self.workers == 0 || self.stages == 0 || self.microbatches == 0 {
            return bad("empty schedule".into());
        }
        if self.stages % self.workers != 0 || self.actions.len() != self.workers {
            return bad(format!(
                "{} stages, {} workers and {} action lists do not match",
                self.stages,
                self.workers,
                self.actions.len()
            ));
        }
        let (m, n) = (self.microbatches, self.stages);
        let mut seen_f = vec![false; m * n];
        let mut seen_b = vec![false; m * n];
        for (w, list) in self.actions.iter().enumerate() {
            for a in list {
                let (mb, st) = (a.mb(), a.stage());
                if mb >= m || st >= n {
                    return bad(format!("worker {w}: {a} is out of range"));
                }
                if self.worker_of(st) != w {
                    return bad(format!(
                        "worker {w}: {a} belongs to worker {}",
                        self.worker_of(st)
                    ));
                }
                let i = mb * n + st;
                if a.is_forward() {
                    if std::mem::replace(&mut seen_f[i], true) {
                        return bad(format!("worker {w}: {a} appears twice"));
                    }
                } else {
                    if !seen_f[i] {
                        return bad(format!("worker {w}: {a} comes before its forward"));
                    }
                    if std::mem::replace(&mut seen_b[i], true) {
                        return bad(format!("worker {w}: {a} appears twice"));
                    }
                }
            }
        }
        if let Some(i) = seen_b.iter().position(|b| !b) {
            return bad(format!(
                "microbatch {} on stage {} is missing",
                i / n,
                i % n
            ));
        }
        Ok(())
    }
}

/// Per worker, a sequence of `(microbatch, virtual stage)`.
type Orders = Vec<Vec<(usize, usize)>>;

/// Megatron's interleaved orders of `(mb, virtual stage)` per worker: forward and backward.
fn chunk_orders(workers: usize, v: usize, m: usize) -> (Orders, Orders) {
    let groups: Vec<Vec<usize>> = (0..m)
        .step_by(workers)
        .map(|g| (g..(g + workers).min(m)).collect())
        .collect();
    let mut fwd = vec![vec![]; workers];
    let mut bwd = vec![vec![]; workers];
    for w in 0..workers {
        for g in &groups {
            for c in 0..v {
                fwd[w].extend(g.iter().map(|&mb| (mb, c * workers + w)));
            }
            for c in (0..v).rev() {
                bwd[w].extend(g.iter().map(|&mb| (mb, c * workers + w)));
            }
        }
    }
    (fwd, bwd)
}
