//! Schedules are complete and deadlock-free; the simulator reproduces the textbook bubbles.

use candle_pipeline::{simulate, Action, Costs, PipelineError, Schedule};

fn all(s: usize, v: usize, m: usize) -> Vec<Schedule> {
    vec![
        Schedule::gpipe(s, m).unwrap(),
        Schedule::one_f_one_b(s, m).unwrap(),
        Schedule::interleaved(s, v, m).unwrap(),
        Schedule::circular(s, v, m).unwrap(),
    ]
}

#[test]
fn generated_schedules_validate_for_many_shapes() {
    for s in 1..=5 {
        for v in 1..=3 {
            for m in 1..=13 {
                for sched in all(s, v, m) {
                    sched
                        .validate()
                        .unwrap_or_else(|e| panic!("{} S={s} v={v} m={m}: {e}", sched.name));
                    let per_worker = 2 * m * sched.virtual_per_worker();
                    assert!(sched.actions.iter().all(|a| a.len() == per_worker));
                }
            }
        }
    }
}

#[test]
fn deadlocking_schedule_is_rejected() {
    // Worker 1 waits for microbatch 1 while worker 0 waits for the gradient of microbatch 0.
    use Action::*;
    let actions = vec![
        vec![
            Forward { mb: 0, stage: 0 },
            Backward { mb: 0, stage: 0 },
            Forward { mb: 1, stage: 0 },
            Backward { mb: 1, stage: 0 },
        ],
        vec![
            Forward { mb: 1, stage: 1 },
            Backward { mb: 1, stage: 1 },
            Forward { mb: 0, stage: 1 },
            Backward { mb: 0, stage: 1 },
        ],
    ];
    let e = Schedule::build("bad", 2, 2, 2, actions).unwrap_err();
    assert!(
        matches!(&e, PipelineError::InvalidSchedule(m) if m.contains("deadlock")),
        "{e}"
    );
    // Incomplete and misplaced actions are rejected too.
    let e = Schedule::build(
        "short",
        1,
        1,
        2,
        vec![vec![
            Forward { mb: 0, stage: 0 },
            Backward { mb: 0, stage: 0 },
        ]],
    )
    .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    let e = Schedule::build(
        "misplaced",
        2,
        2,
        1,
        vec![vec![Forward { mb: 0, stage: 1 }], vec![]],
    )
    .unwrap_err();
    assert!(e.to_string().contains("belongs to worker 1"), "{e}");
}

#[test]
fn gpipe_and_1f1b_bubble_matches_formula() {
    for s in 1..=4usize {
        for m in 1..=8usize {
            let want = (s - 1) as f64 / (m + s - 1) as f64;
            for sched in [
                Schedule::gpipe(s, m).unwrap(),
                Schedule::one_f_one_b(s, m).unwrap(),
            ] {
                for (f, b) in [(1.0, 1.0), (1.0, 2.0)] {
                    let p = simulate(&sched, &Costs::uniform(s, f, b)).unwrap();
                    assert!(
                        (p.bubble() - want).abs() < 1e-12,
                        "{} S={s} m={m}: {} vs {want}",
                        sched.name,
                        p.bubble()
                    );
                }
            }
        }
    }
}

#[test]
fn one_f_one_b_peak_in_flight() {
    for s in 1..=5usize {
        for m in 1..=10usize {
            let p = simulate(
                &Schedule::one_f_one_b(s, m).unwrap(),
                &Costs::uniform(s, 1.0, 2.0),
            )
            .unwrap();
            let want: Vec<usize> = (0..s).map(|st| (s - st).min(m)).collect();
            assert_eq!(p.peak_in_flight, want, "S={s} m={m}");
            let g = simulate(
                &Schedule::gpipe(s, m).unwrap(),
                &Costs::uniform(s, 1.0, 2.0),
            )
            .unwrap();
            assert_eq!(g.peak_in_flight, vec![m; s], "gpipe S={s} m={m}");
        }
    }
}

/// Idle time per worker (makespan - work) of the interleaved schedule is about `1/v` of 1F1B's
/// when the same model is cut into `v` times more, `v` times cheaper stages.
#[test]
fn interleaved_bubble_is_about_v_times_smaller() {
    for (s, m) in [(2, 4), (4, 8), (4, 16), (3, 9)] {
        let base = simulate(
            &Schedule::one_f_one_b(s, m).unwrap(),
            &Costs::uniform(s, 1.0, 2.0),
        )
        .unwrap();
        let base_idle = base.timeline.makespan() - 3.0 * m as f64;
        for v in [2usize, 3, 4] {
            let sched = Schedule::interleaved(s, v, m).unwrap();
            let c = Costs::uniform(s * v, 1.0 / v as f64, 2.0 / v as f64);
            let p = simulate(&sched, &c).unwrap();
            let idle = p.timeline.makespan() - 3.0 * m as f64;
            let ratio = base_idle / idle;
            assert!(
                ratio > 0.8 * v as f64 && ratio < 1.25 * v as f64,
                "S={s} m={m} v={v}: idle ratio {ratio}"
            );
            assert!(p.bubble() < base.bubble());
            let circ = simulate(&Schedule::circular(s, v, m).unwrap(), &c).unwrap();
            assert!(circ.bubble() < base.bubble(), "circular S={s} m={m} v={v}");
        }
    }
}

#[test]
fn fewer_microbatches_than_stages() {
    for sched in [
        Schedule::one_f_one_b(4, 1).unwrap(),
        Schedule::interleaved(4, 2, 2).unwrap(),
    ] {
        let p = simulate(&sched, &Costs::uniform(sched.stages, 1.0, 2.0)).unwrap();
        assert!(p.bubble() > 0.0 && p.bubble() < 1.0);
    }
}

#[test]
fn timeline_renders() {
    let sched = Schedule::one_f_one_b(3, 4).unwrap();
    let p = simulate(&sched, &Costs::uniform(3, 1.0, 2.0)).unwrap();
    let a = p.timeline.ascii(60);
    assert_eq!(a.lines().count(), 4, "{a}");
    assert!(a.starts_with("w0 |0"), "{a}");
    let svg = p.timeline.svg("1f1b");
    assert_eq!(svg.matches("<rect").count(), 3 * 8);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(p.timeline.busy(), vec![12.0; 3]);
}
