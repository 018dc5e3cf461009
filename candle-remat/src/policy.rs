//! Checkpointing policies for a sequential chain of blocks, and the budget planner.
//!
//! # Plan space and cost model
//!
//! A [`Plan`] partitions the chain into consecutive segments; each segment is either *stored*
//! (run as plain Candle code, its activations live until its backward) or *checkpointed* (run
//! through [`Tape::checkpoint`]: only its input is kept, plus a copy of its output; it is re-run
//! once in backward). With per-block activation bytes `a_i`, output bytes `o_i` and forward time
//! `t_i` ([`BlockCost`]) and chain-input bytes `x`, the model is:
//!
//! * memory held by segment `s` after its forward: `A_s = Σ a_i` if stored, `o_last` if
//!   checkpointed;
//! * while segment `s` runs its forward or (re)computes for its backward, everything held by
//!   the segments before it is alive plus its own activations: `x + Σ_{r<s} mem_r + A_s`
//!   (`+ o_last` for a checkpointed one: its leaf copy); stored segments *after the last
//!   checkpointed one* belong to the loss's graph, which the caller holds during
//!   [`Tape::backward`], so their bytes are added to every earlier segment's term;
//! * predicted peak = the maximum of that over segments, plus a plan-independent
//!   [`ChainCosts::overhead_bytes`]; recompute time = `Σ t_i` over checkpointed blocks (each is
//!   re-run exactly once).
//!
//! [`Policy::Budget`] solves `min recompute s.t. peak <= budget` exactly over that space with a
//! dynamic program over segment boundaries whose states are the Pareto front of
//! (bytes held so far, recompute so far), in the spirit of Revolve / rotor restricted to one
//! level of recomputation (which is what the tape executes). Because [`Policy::EveryK`],
//! [`Policy::SqrtN`] and [`Policy::None`] are points of the same space, the budget plan is never
//! worse than them at the same budget (tested on random chains). Times are integers
//! (nanoseconds) so that comparisons are exact.

use crate::error::{RematError, Result};
use crate::tape::Tape;
use candle_core::Tensor;
use std::fmt;
use std::rc::Rc;

/// Measured or estimated cost of one block of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCost {
    /// Bytes the block's autodiff graph keeps alive when run normally (its activations,
    /// including its output).
    pub act_bytes: u64,
    /// Bytes of the block's output (the boundary kept when a checkpoint ends here).
    pub out_bytes: u64,
    /// Forward time of the block in nanoseconds (any consistent unit works).
    pub fwd_ns: u64,
}

/// Costs of a whole chain: the chain input, a fixed overhead and each block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainCosts {
    /// Bytes of the chain input (always alive).
    pub input_bytes: u64,
    /// Bytes added to every prediction regardless of the plan: parameter gradients, the
    /// backward workspace of one segment, the head's activations... Use 0 to budget the chain's
    /// activations only; measure it (peak of a known plan minus its prediction) to budget a
    /// whole training step.
    pub overhead_bytes: u64,
    /// One entry per block, in order.
    pub blocks: Vec<BlockCost>,
}

impl ChainCosts {
    /// `n` identical blocks, with the chain input as large as one block output.
    pub fn uniform(n: usize, block: BlockCost) -> Self {
        Self {
            input_bytes: block.out_bytes,
            overhead_bytes: 0,
            blocks: vec![block; n],
        }
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True for an empty chain.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// How to checkpoint a chain of `N` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// No checkpointing: plain Candle memory and speed.
    None,
    /// Checkpoint segments of `k` consecutive blocks (a boundary is kept every `k` blocks);
    /// `EveryK(1)` checkpoints every block on its own.
    EveryK(usize),
    /// `ceil(sqrt(N))` blocks per checkpointed segment (Chen et al. 2016).
    SqrtN,
    /// The plan with the least recompute whose predicted peak is at most this
    /// many bytes (dynamic program over the chain).
    Budget(u64),
}

/// One segment of a [`Plan`]: blocks `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSegment {
    /// First block (inclusive).
    pub start: usize,
    /// Last block (exclusive).
    pub end: usize,
    /// Whether the segment is checkpointed (recomputed in backward) or stored.
    pub checkpointed: bool,
}

/// A checkpointing plan for a chain, with its predicted cost. Printable with `{}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The policy that produced the plan.
    pub policy: Policy,
    /// Segments covering `0..n` in order.
    pub segments: Vec<PlanSegment>,
    /// Predicted activation peak in bytes (see the module docs for the model).
    pub predicted_peak_bytes: u64,
    /// Predicted peak of the same chain without checkpointing.
    pub unchecked_peak_bytes: u64,
    /// Forward time re-run in backward (ns).
    pub recompute_ns: u64,
    /// Forward time of the whole chain (ns).
    pub forward_ns: u64,
}

impl Plan {
    /// Number of blocks covered.
    pub fn len(&self) -> usize {
        self.segments.last().map_or(0, |s| s.end)
    }

    /// True for an empty plan.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// Whether block `i` is inside a checkpointed segment.
    pub fn is_checkpointed(&self, i: usize) -> bool {
        self.segments
            .iter()
            .any(|s| s.checkpointed && s.start <= i && i < s.end)
    }

    /// Recompute as a fraction of the chain's forward time.
    pub fn recompute_fraction(&self) -> f64 {
        if self.forward_ns == 0 {
            0.0
        } else {
            self.recompute_ns as f64 / self.forward_ns as f64
        }
    }

    /// Runs the chain `x -> f(0, x) -> f(1, ..) -> ...` on `tape` following the plan. Each block
    /// runs inside [`Tape::scope`]`(i, ..)`, so [`crate::dropout`] masks depend only on the tape
    /// seed and the block index: every policy computes the same function.
    ///
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_remat::{ChainCosts, BlockCost, Policy, Tape};
    /// let dev = Device::Cpu;
    /// let ws: Vec<Var> = (0..4).map(|_| Var::randn(0f32, 0.3, (8, 8), &dev)).collect::<Result<_, _>>()?;
    /// let plan = Policy::EveryK(2).plan(&ChainCosts::uniform(4, BlockCost { act_bytes: 512, out_bytes: 128, fwd_ns: 1 }))?;
    /// let tape = Tape::new(0);
    /// let x = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
    /// let y = plan.forward(&tape, &x, |i, h| h.matmul(ws[i].as_tensor())?.tanh())?;
    /// let grads = tape.backward(&y.sum_all()?)?;
    /// assert!(ws.iter().all(|w| grads.get(w).is_some()));
    /// # Ok::<(), candle_remat::RematError>(())
    /// ```
    pub fn forward<'a, F>(&self, tape: &Tape<'a>, x: &Tensor, f: F) -> Result<Tensor>
    where
        F: Fn(usize, &Tensor) -> candle_core::Result<Tensor> + 'a,
    {
        let f = Rc::new(f);
        let mut h = x.clone();
        for seg in &self.segments {
            let (start, end) = (seg.start, seg.end);
            if seg.checkpointed {
                let f = f.clone();
                let mut ys = tape.checkpoint_nested(&[&h], move |t, xs| {
                    let mut h = xs[0].clone();
                    for i in start..end {
                        h = t.scope(i as u64, || Ok(f(i, &h)?))?;
                    }
                    Ok(vec![h])
                })?;
                h = ys
                    .pop()
                    .ok_or_else(|| RematError::InvalidPlan("no output".into()))?;
            } else {
                for i in start..end {
                    h = tape.scope(i as u64, || Ok(f(i, &h)?))?;
                }
            }
        }
        Ok(h)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "plan {:?} over {} blocks:", self.policy, self.len())?;
        let segs: Vec<String> = self
            .segments
            .iter()
            .map(|s| {
                let r = if s.end - s.start == 1 {
                    format!("{}", s.start)
                } else {
                    format!("{}-{}", s.start, s.end - 1)
                };
                if s.checkpointed {
                    format!("[ckpt {r}]")
                } else {
                    format!("[store {r}]")
                }
            })
            .collect();
        writeln!(f, "  segments: {}", segs.join(" "))?;
        let ck: Vec<String> = (0..self.len())
            .filter(|&i| self.is_checkpointed(i))
            .map(|i| i.to_string())
            .collect();
        writeln!(f, "  checkpointed blocks: {{{}}}", ck.join(", "))?;
        writeln!(
            f,
            "  predicted peak: {:.2} MiB ({:.1}% of {:.2} MiB unchecked)",
            self.predicted_peak_bytes as f64 / 1048576.0,
            100.0 * self.predicted_peak_bytes as f64 / self.unchecked_peak_bytes.max(1) as f64,
            self.unchecked_peak_bytes as f64 / 1048576.0
        )?;
        write!(
            f,
            "  predicted recompute: {:.1}% of forward (~{:.1}% of a step if backward = 2x forward)",
            100.0 * self.recompute_fraction(),
            100.0 * self.recompute_fraction() / 3.0
        )
    }
}

fn seg_sum(c: &ChainCosts, s: &PlanSegment) -> (u64, u64) {
    let blocks = &c.blocks[s.start..s.end];
    (
        blocks.iter().map(|b| b.act_bytes).sum(),
        blocks.iter().map(|b| b.fwd_ns).sum(),
    )
}

/// Predicted (peak bytes, recompute ns) of `segments` under the module's cost model.
///
/// Stored segments after the last checkpointed one are owned by the loss, which the caller
/// holds during [`Tape::backward`], so they count in every checkpointed segment's peak.
pub fn predict(costs: &ChainCosts, segments: &[PlanSegment]) -> (u64, u64) {
    let last_ckpt = segments.iter().rposition(|s| s.checkpointed);
    let tail: u64 = match last_ckpt {
        Some(l) => segments[l + 1..].iter().map(|s| seg_sum(costs, s).0).sum(),
        None => 0,
    };
    let mut held = costs.input_bytes;
    let mut peak = held;
    let mut rec = 0;
    for (k, s) in segments.iter().enumerate() {
        let (a, t) = seg_sum(costs, s);
        let out = costs.blocks[s.end - 1].out_bytes;
        let extra = if last_ckpt.is_some_and(|l| k <= l) {
            tail
        } else {
            0
        };
        if s.checkpointed {
            peak = peak.max(held + a + out + extra);
            held += out;
            rec += t;
        } else {
            peak = peak.max(held + a + extra);
            held += a;
        }
    }
    (peak + costs.overhead_bytes, rec)
}

fn uniform_segments(n: usize, k: usize) -> Vec<PlanSegment> {
    (0..n)
        .step_by(k)
        .map(|start| PlanSegment {
            start,
            end: (start + k).min(n),
            checkpointed: true,
        })
        .collect()
}

impl Policy {
    /// Turns the policy into a plan for a chain with the given costs (costs only matter for
    /// the predictions, except for [`Policy::Budget`]).
    pub fn plan(&self, costs: &ChainCosts) -> Result<Plan> {
        let n = costs.len();
        if n == 0 {
            return Err(RematError::InvalidPlan("empty chain".into()));
        }
        let segments = match *self {
            Policy::None => vec![PlanSegment {
                start: 0,
                end: n,
                checkpointed: false,
            }],
            Policy::EveryK(0) => return Err(RematError::InvalidPlan("EveryK(0)".into())),
            Policy::EveryK(k) => uniform_segments(n, k),
            Policy::SqrtN => uniform_segments(n, (n as f64).sqrt().ceil() as usize),
            Policy::Budget(b) => budget_segments(costs, b)?,
        };
        Ok(self.finish(costs, segments))
    }

    fn finish(&self, costs: &ChainCosts, segments: Vec<PlanSegment>) -> Plan {
        let (peak, rec) = predict(costs, &segments);
        let all = [PlanSegment {
            start: 0,
            end: costs.len(),
            checkpointed: false,
        }];
        Plan {
            policy: *self,
            predicted_peak_bytes: peak,
            unchecked_peak_bytes: predict(costs, &all).0,
            recompute_ns: rec,
            forward_ns: costs.blocks.iter().map(|b| b.fwd_ns).sum(),
            segments,
        }
    }
}

#[derive(Clone, Copy)]
struct State {
    held: u64,
    cost: u64,
    prev: Option<(usize, usize)>, // (position, index in that position's front)
    seg: Option<PlanSegment>,
}

/// Pareto fronts of (bytes held, recompute) at every boundary `0..upto`, every segment term
/// bounded by `budget`.
#[allow(clippy::needless_range_loop)]
fn fronts(costs: &ChainCosts, upto: usize, budget: u64) -> Vec<Vec<State>> {
    let mut fronts: Vec<Vec<State>> = vec![Vec::new(); upto];
    if upto == 0 || costs.input_bytes > budget {
        return fronts;
    }
    fronts[0].push(State {
        held: costs.input_bytes,
        cost: 0,
        prev: None,
        seg: None,
    });
    for i in 0..upto {
        let front = std::mem::take(&mut fronts[i]);
        for (si, st) in front.iter().enumerate() {
            let (mut a, mut t) = (0u64, 0u64);
            for j in i + 1..upto {
                a += costs.blocks[j - 1].act_bytes;
                t += costs.blocks[j - 1].fwd_ns;
                let out = costs.blocks[j - 1].out_bytes;
                if st.held + a > budget {
                    break;
                }
                // Segment i..j reached from `st`, holding `held` bytes after it at `cost`.
                let mut push = |checkpointed, held, cost| {
                    let seg = PlanSegment {
                        start: i,
                        end: j,
                        checkpointed,
                    };
                    let s = State {
                        held,
                        cost,
                        prev: Some((i, si)),
                        seg: Some(seg),
                    };
                    push_pareto(&mut fronts[j], s);
                };
                if j == i + 1 {
                    // stored single block (longer stored runs are sequences of these)
                    push(false, st.held + a, st.cost);
                }
                if st.held + a + out <= budget {
                    push(true, st.held + out, st.cost + t);
                }
            }
        }
        fronts[i] = front;
    }
    fronts
}

fn backtrack(fronts: &[Vec<State>], mut cur: (usize, usize)) -> Vec<PlanSegment> {
    let mut segs = Vec::new();
    while let Some(st) = fronts.get(cur.0).and_then(|f| f.get(cur.1)) {
        match (st.seg, st.prev) {
            (Some(seg), Some(p)) => {
                segs.push(seg);
                cur = p;
            }
            _ => break,
        }
    }
    segs.reverse();
    segs
}

/// Exact DP; `None` when no plan fits `budget`. The plan is a prefix ending with a
/// checkpointed segment followed by a stored tail `p..n` (owned by the loss, alive during the
/// whole backward): for each `p`, the prefix is solved with the budget reduced by the tail.
#[allow(clippy::needless_range_loop)]
fn dp(costs: &ChainCosts, budget: u64) -> Option<Vec<PlanSegment>> {
    let n = costs.len();
    let budget = budget.checked_sub(costs.overhead_bytes)?;
    let mut tail = vec![0u64; n + 1];
    for p in (0..n).rev() {
        tail[p] = tail[p + 1] + costs.blocks[p].act_bytes;
    }
    let stored_tail = |p: usize| PlanSegment {
        start: p,
        end: n,
        checkpointed: false,
    };
    let mut best: Option<(u64, u64, Vec<PlanSegment>)> = None;
    if costs.input_bytes + tail[0] <= budget {
        best = Some((0, 0, vec![stored_tail(0)]));
    }
    for p in 1..=n {
        let Some(b) = budget.checked_sub(tail[p]) else {
            continue;
        };
        let fr = fronts(costs, p, b);
        for (i, front) in fr.iter().enumerate() {
            let a: u64 = costs.blocks[i..p].iter().map(|c| c.act_bytes).sum();
            let t: u64 = costs.blocks[i..p].iter().map(|c| c.fwd_ns).sum();
            let out = costs.blocks[p - 1].out_bytes;
            for (si, st) in front.iter().enumerate() {
                if st.held + a + out > b {
                    continue;
                }
                let key = (st.cost + t, st.held + out);
                if best.as_ref().is_some_and(|(c, h, _)| (*c, *h) <= key) {
                    continue;
                }
                let mut segs = backtrack(&fr, (i, si));
                segs.push(PlanSegment {
                    start: i,
                    end: p,
                    checkpointed: true,
                });
                if p < n {
                    segs.push(stored_tail(p));
                }
                best = Some((key.0, key.1, segs));
            }
        }
    }
    best.map(|(_, _, segs)| merge_stored(segs))
}

fn merge_stored(segs: Vec<PlanSegment>) -> Vec<PlanSegment> {
    let mut out: Vec<PlanSegment> = Vec::new();
    for s in segs {
        match out.last_mut() {
            Some(l) if !l.checkpointed && !s.checkpointed => l.end = s.end,
            _ => out.push(s),
        }
    }
    out
}

fn push_pareto(front: &mut Vec<State>, s: State) {
    if front.iter().any(|o| o.held <= s.held && o.cost <= s.cost) {
        return;
    }
    front.retain(|o| !(s.held <= o.held && s.cost <= o.cost));
    front.push(s);
}

/// Smallest predicted peak any plan of the space reaches (binary search on the DP).
pub fn min_peak_bytes(costs: &ChainCosts) -> u64 {
    let all = [PlanSegment {
        start: 0,
        end: costs.len(),
        checkpointed: false,
    }];
    let (mut lo, mut hi) = (0u64, predict(costs, &all).0);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if dp(costs, mid).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    hi
}

fn budget_segments(costs: &ChainCosts, budget: u64) -> Result<Vec<PlanSegment>> {
    dp(costs, budget).ok_or_else(|| RematError::ImpossibleBudget {
        budget,
        min_bytes: min_peak_bytes(costs),
    })
}
