//! Planner: budgets are met, the DP is never worse than sqrt(N) / every-k at the same budget,
//! it is optimal (brute force on small chains), and impossible budgets are reported clearly.

use candle_remat::policy::{min_peak_bytes, predict};
use candle_remat::{BlockCost, ChainCosts, PlanSegment, Policy, RematError};
use rand::Rng;
use test_support::random::{rng, ChaCha8Rng};

fn random_chain(rng: &mut ChaCha8Rng, n: usize) -> ChainCosts {
    ChainCosts {
        input_bytes: rng.random_range(1..200),
        overhead_bytes: rng.random_range(0..3) * rng.random_range(0..1000),
        blocks: (0..n)
            .map(|_| {
                let out = rng.random_range(1..300u64);
                BlockCost {
                    act_bytes: out + rng.random_range(0..5000u64),
                    out_bytes: out,
                    fwd_ns: rng.random_range(1..1000u64),
                }
            })
            .collect(),
    }
}

/// Runs `f` on `trials` random chains of 1 to `max_blocks` blocks drawn from `rng(seed)`, with
/// the trial's number, the chain's cheapest feasible peak and its peak without recompute, and the
/// generator for further draws; returns the generator.
fn for_random_chains(
    seed: u64,
    trials: usize,
    max_blocks: usize,
    mut f: impl FnMut(usize, &ChainCosts, (u64, u64), &mut ChaCha8Rng),
) -> ChaCha8Rng {
    let mut rng = rng(seed);
    for trial in 0..trials {
        let n = rng.random_range(1..=max_blocks);
        let c = random_chain(&mut rng, n);
        let lo = min_peak_bytes(&c);
        let hi = Policy::None.plan(&c).unwrap().predicted_peak_bytes;
        f(trial, &c, (lo, hi), &mut rng);
    }
    rng
}

#[test]
fn budget_plan_meets_budget_and_beats_fixed_policies() {
    for_random_chains(0, 300, 16, |trial, c, (lo, hi), rng| {
        let n = c.blocks.len();
        let mut fixed = vec![Policy::SqrtN, Policy::None];
        fixed.extend((1..=n).map(Policy::EveryK));
        for p in fixed {
            let fp = p.plan(c).unwrap();
            let bp = Policy::Budget(fp.predicted_peak_bytes).plan(c).unwrap();
            assert!(
                bp.predicted_peak_bytes <= fp.predicted_peak_bytes,
                "trial {trial}: {bp}"
            );
            assert!(
                bp.recompute_ns <= fp.recompute_ns,
                "trial {trial}: budget plan recomputes {} > {:?} {}\n{bp}\n{fp}",
                bp.recompute_ns,
                p,
                fp.recompute_ns
            );
        }
        // random feasible budgets are met
        for _ in 0..5 {
            let b = rng.random_range(lo..=hi);
            let plan = Policy::Budget(b).plan(c).unwrap();
            assert!(plan.predicted_peak_bytes <= b);
            assert_eq!(plan.len(), n);
            assert_eq!(
                predict(c, &plan.segments),
                (plan.predicted_peak_bytes, plan.recompute_ns)
            );
        }
        // the whole budget -> no recompute at all
        assert_eq!(Policy::Budget(hi).plan(c).unwrap().recompute_ns, 0);
    });
}

/// All plans of the space for n blocks: partitions into segments x stored/checkpointed.
fn all_plans(n: usize) -> Vec<Vec<PlanSegment>> {
    let mut out = Vec::new();
    for cuts in 0u32..(1 << (n - 1)) {
        let mut bounds = vec![0];
        for i in 1..n {
            if cuts & (1 << (i - 1)) != 0 {
                bounds.push(i);
            }
        }
        bounds.push(n);
        let m = bounds.len() - 1;
        for flags in 0u32..(1 << m) {
            out.push(
                (0..m)
                    .map(|s| PlanSegment {
                        start: bounds[s],
                        end: bounds[s + 1],
                        checkpointed: flags & (1 << s) != 0,
                    })
                    .collect(),
            );
        }
    }
    out
}

#[test]
fn budget_plan_is_optimal_by_brute_force() {
    for_random_chains(1, 60, 7, |_, c, (lo, hi), rng| {
        let plans = all_plans(c.blocks.len());
        let brute_min_peak = plans.iter().map(|p| predict(c, p).0).min().unwrap();
        assert_eq!(lo, brute_min_peak);
        for _ in 0..8 {
            let b = rng.random_range(lo..=hi);
            let best = plans
                .iter()
                .map(|p| predict(c, p))
                .filter(|(pk, _)| *pk <= b)
                .map(|(_, r)| r)
                .min()
                .unwrap();
            assert_eq!(Policy::Budget(b).plan(c).unwrap().recompute_ns, best);
        }
    });
}

#[test]
fn impossible_budget_is_a_clear_error() {
    let mut rng = for_random_chains(2, 50, 12, |_, c, (lo, _), _| {
        assert!(Policy::Budget(lo).plan(c).is_ok());
        match Policy::Budget(lo - 1).plan(c) {
            Err(RematError::ImpossibleBudget { budget, min_bytes }) => {
                assert_eq!((budget, min_bytes), (lo - 1, lo));
                let msg = RematError::ImpossibleBudget { budget, min_bytes }.to_string();
                assert!(
                    msg.contains(&lo.to_string()) && msg.contains("impossible"),
                    "{msg}"
                );
            }
            other => panic!("expected ImpossibleBudget, got {other:?}"),
        }
    });
    assert!(matches!(
        Policy::EveryK(0).plan(&random_chain(&mut rng, 3)),
        Err(RematError::InvalidPlan(_))
    ));
    assert!(matches!(
        Policy::SqrtN.plan(&ChainCosts {
            input_bytes: 1,
            overhead_bytes: 0,
            blocks: vec![]
        }),
        Err(RematError::InvalidPlan(_))
    ));
}

#[test]
fn fixed_policies_have_the_expected_shape_and_print() {
    let c = ChainCosts::uniform(
        12,
        BlockCost {
            act_bytes: 100 << 20,
            out_bytes: 2 << 20,
            fwd_ns: 1_000_000,
        },
    );
    let sq = Policy::SqrtN.plan(&c).unwrap();
    assert_eq!(sq.segments.len(), 3); // ceil(sqrt 12) = 4 blocks per segment
    assert!((0..12).all(|i| sq.is_checkpointed(i)));
    assert!((sq.recompute_fraction() - 1.0).abs() < 1e-12);
    let none = Policy::None.plan(&c).unwrap();
    assert_eq!(none.recompute_ns, 0);
    assert_eq!(none.predicted_peak_bytes, (2 << 20) + 12 * (100 << 20));
    let k1 = Policy::EveryK(1).plan(&c).unwrap();
    // input + 11 boundaries + the last block's activations and its leaf copy
    assert_eq!(
        k1.predicted_peak_bytes,
        (2 << 20) + 11 * (2 << 20) + (100 << 20) + (2 << 20)
    );
    let b = Policy::Budget(400 << 20).plan(&c).unwrap();
    let text = b.to_string();
    assert!(
        text.contains("checkpointed blocks")
            && text.contains("predicted peak")
            && text.contains("recompute"),
        "{text}"
    );
    assert!(b.predicted_peak_bytes <= 400 << 20);
    assert!(b.recompute_ns < sq.recompute_ns);
}
