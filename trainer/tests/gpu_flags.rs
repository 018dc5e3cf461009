//! The CUDA settings of a run (`--tf32`, on by default as in nanoGPT; `--triton-kernels`, off
//! until the GPU check has passed): typed config fields like every other, recorded in the
//! run's config, applied when a run is set up, shown in the banner only on CUDA (they change
//! nothing on the CPU).

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
    assert!(out.contains("tf32 = true") && out.contains("triton_kernels = false"));

    let args = [
        "train",
        "--print-config",
        "--tf32",
        "false",
        "--triton-kernels",
        "true",
    ];
    let o = trainer(&args, dir);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("tf32 = false") && out.contains("triton_kernels = true"));

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
    assert!(
        err.contains("bad.toml") && err.contains("triton_kernels") && err.contains("boolean"),
        "{err}"
    );

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
        ..TrainConfig::default()
    };
    assert_eq!(
        cuda.cuda_summary().as_deref(),
        Some("cuda: tf32 on (f32 matmuls), triton kernels off")
    );
    let stages = TrainConfig {
        pipeline_devices: DeviceList(vec![DeviceSpec::Cpu, DeviceSpec::Cuda(1)]),
        tf32: false,
        triton_kernels: true,
        ..TrainConfig::default()
    };
    assert_eq!(
        stages.cuda_summary().as_deref(),
        Some("cuda: tf32 off (f32 matmuls), triton kernels on")
    );

    // Setting up a run applies its settings to the process (the CPU run is unchanged): the
    // flag switches the kernels on; without it candle-fused's default (the environment) holds.
    let tmp = tempfile::tempdir().unwrap();
    let env_on = std::env::var(candle_fused::cuda_kernels::TRITON_ENV).is_ok_and(|v| v == "1");
    for on in [false, true] {
        let cfg = TrainConfig {
            triton_kernels: on,
            ..tiny_config(&tmp.path().join("run"))
        };
        let _t = trainer::train::Trainer::new(cfg).unwrap();
        assert_eq!(trainer::runtime::triton_kernels(), on || env_on);
    }
}
