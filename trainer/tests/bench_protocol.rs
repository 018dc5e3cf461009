//! The bench protocol's arithmetic (trainer/benches/support/protocol.rs) on recorded
//! `/proc` samples: the other processes' share, steal, the re-run rule and the CPU line.

#[path = "../benches/support/protocol.rs"]
#[allow(dead_code)]
mod protocol;

use protocol::{cpu_line, rerun, CpuTimes, Share, MAX_RERUNS};

// Two readings 1 s apart on a 2-CPU machine (200 ticks): this process used 150 ticks (user +
// system, plus 4 of a waited child), the machine's busy time grew by 160, steal by 6.
const STAT_A: &str = "cpu  3687880 1501608 632121 1013379 116045 0 6011 9720 0 0
cpu0 1843940 750804 316060 506689 58022 0 3005 4860 0 0
intr 1 2 3
";
const STAT_B: &str = "cpu  3688000 1501610 632144 1013399 116055 0 6016 9726 0 0
cpu0 1844000 750805 316072 506699 58027 0 3008 4863 0 0
intr 1 2 3
";
// A command name with a space and a parenthesis, as proc(5) allows.
const SELF_A: &str = "15081 (py thon) x) R 15033 15033 12946 0 -1 4194304 101 0 0 0 500 40 3 1 20 0 1 0 3494734 3133440 390";
const SELF_B: &str = "15081 (py thon) x) R 15033 15033 12946 0 -1 4194304 101 0 0 0 620 66 5 3 20 0 1 0 3494734 3133440 390";

#[test]
fn shares_from_recorded_samples() {
    let a = CpuTimes::parse(STAT_A, SELF_A).unwrap();
    let b = CpuTimes::parse(STAT_B, SELF_B).unwrap();
    assert_eq!(a.own, 500 + 40 + 3 + 1);
    // busy: user 120 + nice 2 + system 23 + irq 0 + softirq 5 = 150; idle 20, iowait 10,
    // steal 6: 186 ticks in all.
    assert_eq!(b.busy - a.busy, 150);
    assert_eq!(b.total - a.total, 186);
    let s = Share::between(&a, &b);
    // own grew by 120 + 26 + 2 + 2 = 150: every busy tick was ours.
    assert_eq!(s.other, 0.0);
    assert!((s.steal - 6.0 / 186.0).abs() < 1e-12);
    // The same machine time with our process idle: all 150 busy ticks are others'.
    let s = Share::between(&a, &CpuTimes { own: a.own, ..b });
    assert!((s.other - 150.0 / 186.0).abs() < 1e-12);
    assert!((s.load() - 156.0 / 186.0).abs() < 1e-12);
    // No tick passed: no share (not NaN).
    assert_eq!(Share::between(&a, &a), Share::default());
}

#[test]
fn bad_samples_are_named() {
    let e = CpuTimes::parse("intr 1 2\n", SELF_A).unwrap_err();
    assert!(e.to_string().contains("/proc/stat"), "{e}");
    let e = CpuTimes::parse(STAT_A, "15081 (cat) R 1 2").unwrap_err();
    assert!(e.to_string().contains("/proc/self/stat"), "{e}");
}

fn share(load: f64) -> Share {
    Share {
        other: load,
        steal: 0.0,
    }
}

#[test]
fn rerun_rule() {
    // Under 2% at once: one try.
    let t = rerun(|| Ok((1.0, share(0.01)))).unwrap();
    assert_eq!((t.secs, t.tries), (1.0, 1));
    // Exactly 2% is not over it.
    assert_eq!(rerun(|| Ok((1.0, share(0.02)))).unwrap().tries, 1);
    // Over, then under at the third try: that try is kept.
    let mut loads = [0.3, 0.05, 0.015, 0.0].into_iter().enumerate();
    let t = rerun(|| {
        let (i, l) = loads.next().unwrap();
        Ok((i as f64, share(l)))
    })
    .unwrap();
    assert_eq!((t.secs, t.tries, t.share.other), (2.0, 3, 0.015));
    // Always over: 1 + MAX_RERUNS tries, the lowest share kept and reported.
    let mut n = 0;
    let t = rerun(|| {
        n += 1;
        let l = [0.5, 0.1, 0.04, 0.3, 0.2, 0.09][n - 1];
        Ok((
            n as f64,
            Share {
                other: l,
                steal: 0.01,
            },
        ))
    })
    .unwrap();
    assert_eq!(MAX_RERUNS, 5);
    assert_eq!((t.tries, t.secs, t.share.other), (6, 3.0, 0.04));
    // Errors stop the rule.
    assert!(rerun(|| anyhow::bail!("step failed")).is_err());
}

#[test]
fn cpu_line_names_model_and_flags() {
    let info = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\
                flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n\n\
                processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n";
    let l = cpu_line(info);
    assert!(
        l.starts_with("Intel(R) Xeon(R) Platinum 8480+ | 2 CPUs | "),
        "{l}"
    );
    assert!(
        l.contains("avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 |"),
        "{l}"
    );
    assert!(
        l.ends_with("absent: avx512_vnni avx_vnni avx512_fp16 amx_int8"),
        "{l}"
    );
    assert!(cpu_line("").starts_with("unknown CPU | 0 CPUs"));
}

#[test]
fn rounds_pool_into_one_side() {
    use serde_json::json;
    let a = json!({"case": "x", "step_median_s": 3.0, "tokens_per_s": 512.0, "mfu": 0.3,
        "step_mean_s": 2.5,
        "step_times_s": [2.0, 3.0], "share_other_max": 0.01, "share_steal_max": 0.0,
        "reruns": 1, "over_limit": 0});
    let b = json!({"case": "x", "step_median_s": 1.0, "tokens_per_s": 1024.0,
        "step_times_s": [1.0, 1.5], "share_other_max": 0.005, "share_steal_max": 0.03,
        "reruns": 5, "over_limit": 1});
    let p = protocol::pool(&[a, b]);
    assert_eq!(p["step_times_s"], json!([2.0, 3.0, 1.0, 1.5]));
    // Median of 4 takes the upper middle (as the benches always have): 2.0.
    assert_eq!(p["step_median_s"], json!(2.0));
    assert_eq!(p["step_mean_s"], json!(7.5 / 4.0));
    // Per-time figures rescaled from the first round's median (3 s) to the pooled one.
    assert_eq!(p["tokens_per_s"], json!(768.0));
    assert_eq!(p["mfu"], json!(0.3 * 3.0 / 2.0));
    assert_eq!(p["share_other_max"], json!(0.01));
    assert_eq!(p["share_steal_max"], json!(0.03));
    assert_eq!(
        (p["reruns"].clone(), p["over_limit"].clone()),
        (json!(6), json!(1))
    );
    assert_eq!(
        (p["rounds"].clone(), p["case"].clone()),
        (json!(2), json!("x"))
    );
    assert_eq!(protocol::pool(&[]), serde_json::Value::Null);
}
