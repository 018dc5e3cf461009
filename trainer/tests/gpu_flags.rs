//! The CUDA settings of a run (`--tf32`, on by default as in nanoGPT; `--triton-kernels`
//! true / false / unset: the flag over `CANDLE_FUSED_TRITON` over candle-fused's default, off
//! until the GPU check has passed): typed config fields like every other, recorded in the run's
//! config, applied when a run is set up, shown in the banner only on CUDA (they change nothing
//! on the CPU).

mod common;

use common::{output_text as text, run_cli as trainer, tiny_config};
use trainer::config::{DeviceList, DeviceSpec, TrainConfig};

#[test]
fn defaults_flags_and_toml() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let o = trainer(&["train", "--print-config"], dir);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    // unset: recorded as absent, so the environment or the default decides at every run
    assert!(
        out.contains("tf32 = true") && !out.contains("triton_kernels"),
        "{out}"
    );

    let args = common::words("train --print-config --tf32 false --triton-kernels true");
    let o = trainer(&args, dir);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("tf32 = false") && out.contains("triton_kernels = true"));
    let o = trainer(
        &["train", "--print-config", "--triton-kernels", "false"],
        dir,
    );
    assert!(text(&o).contains("triton_kernels = false"), "{}", text(&o));

    std::fs::write(dir.join("run.toml"), "tf32 = false\n").unwrap();
    let o = trainer(&["train", "--print-config", "--config", "run.toml"], dir);
    assert!(text(&o).contains("tf32 = false"), "{}", text(&o));

    // A bad value is one clear error naming the flag (or the file and key) and the value.
    let o = trainer(&["train", "--tf32", "maybe"], dir);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--tf32") && err.contains("maybe"), "{err}");
    std::fs::write(dir.join("bad.toml"), "triton_kernels = \"yes\"\n").unwrap();
    let o = trainer(&["train", "--config", "bad.toml"], dir);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    common::assert_mentions(&err, &["bad.toml", "triton_kernels", "boolean"]);

    let o = trainer(&["train", "--help"], dir);
    let help = text(&o);
    assert!(help.contains("--tf32") && help.contains("--triton-kernels"));
    assert!(help.contains("No effect on the CPU"), "{help}");
}

#[test]
fn shown_for_cuda_runs_only_and_applied_at_set_up() {
    let cfg = TrainConfig::default();
    assert_eq!(cfg.cuda_summary(), None);
    let cuda = TrainConfig {
        device: DeviceSpec::Cuda(0),
        triton_kernels: Some(false),
        ..TrainConfig::default()
    };
    assert_eq!(
        cuda.cuda_summary().as_deref(),
        Some("cuda: tf32 on (f32 matmuls), triton kernels off (--triton-kernels)")
    );
    let stages = TrainConfig {
        pipeline_devices: DeviceList(vec![DeviceSpec::Cpu, DeviceSpec::Cuda(1)]),
        tf32: false,
        triton_kernels: Some(true),
        ..TrainConfig::default()
    };
    assert_eq!(
        stages.cuda_summary().as_deref(),
        Some("cuda: tf32 off (f32 matmuls), triton kernels on (--triton-kernels)")
    );
}

/// The three states, the flag over the environment over the default, as a run applies them
/// to the process; the environment is this test's alone (the other test's child processes
/// only print configs, which it does not change).
#[test]
fn flag_over_environment_over_default() {
    use candle_fused::cuda_kernels::{TRITON_DEFAULT, TRITON_ENV};
    let tmp = tempfile::tempdir().unwrap();
    let cuda = |flag: Option<bool>| TrainConfig {
        device: DeviceSpec::Cuda(0),
        triton_kernels: flag,
        ..TrainConfig::default()
    };
    let on = |b: bool| if b { "on" } else { "off" };
    let cases = [
        // (environment, flag, expected, what decided)
        (None, None, TRITON_DEFAULT, "default"),
        (Some("1"), None, true, TRITON_ENV),
        (Some("0"), None, false, TRITON_ENV),
        (Some("maybe"), None, TRITON_DEFAULT, "default"),
        (Some("1"), Some(false), false, "--triton-kernels"),
        (Some("0"), Some(true), true, "--triton-kernels"),
        (None, Some(true), true, "--triton-kernels"),
        // after a run that gave the flag, a run without it goes back to the environment
        (Some("0"), None, false, TRITON_ENV),
    ];
    for (env, flag, want, by) in cases {
        match env {
            Some(v) => std::env::set_var(TRITON_ENV, v),
            None => std::env::remove_var(TRITON_ENV),
        }
        let case = format!("{TRITON_ENV}={env:?}, --triton-kernels {flag:?}");
        assert_eq!(cuda(flag).triton_choice(), (want, by), "{case}");
        assert!(
            cuda(flag)
                .cuda_summary()
                .is_some_and(|s| s.ends_with(&format!("triton kernels {} ({by})", on(want)))),
            "{case}"
        );
        // setting a (CPU) run up applies the same choice to the process
        let cfg = TrainConfig {
            triton_kernels: flag,
            ..tiny_config(&tmp.path().join("run"))
        };
        let _t = trainer::train::Trainer::new(cfg).unwrap();
        assert_eq!(trainer::runtime::triton_kernels(), want, "{case}");
    }
    std::env::remove_var(TRITON_ENV);
}
