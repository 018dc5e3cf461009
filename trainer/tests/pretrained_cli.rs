//! The `trainer` binary on models it did not train: `inspect` failing on weights that do not
//! match their config. Nothing is downloaded: the tests build the model directories
//! themselves.

mod support;

use std::path::Path;
use std::process::{Command, Output};

/// Runs the binary in `cwd` with `HF_HOME` and the data cache inside `home`.
fn trainer(args: &[&str], cwd: &Path, home: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .current_dir(cwd)
        .env("HF_HOME", home.join("hf"))
        .env("XDG_CACHE_HOME", home.join("cache"))
        .output()
        .expect("run the trainer binary")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "{}", text(&o));
    text(&o)
}

fn fails(o: Output) -> String {
    assert!(!o.status.success(), "succeeded:\n{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(err.contains("error:"), "{err}");
    err
}

#[test]
fn inspect_fails_on_weights_that_do_not_match_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let hf = support::hf_model_dir(&dir.join("hf"), 16);
    let out = ok(trainer(&["inspect", "hf"], dir, dir));
    assert!(out.contains("weights match the config"), "{out}");

    // config.json claims 3 layers; the weights have 2.
    let mut cfg = support::config_json(&hf);
    cfg["n_layer"] = 3.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = fails(trainer(&["inspect", "hf"], dir, dir));
    assert!(
        err.contains("config.json") && err.contains("missing `transformer.h.2."),
        "{err}"
    );
    // n_positions 8 against 16 rows of wpe.
    cfg["n_layer"] = 2.into();
    cfg["n_positions"] = 8.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = fails(trainer(&["inspect", "hf"], dir, dir));
    assert!(err.contains("transformer.wpe.weight"), "{err}");
}
