//! What runs the cases, apart from the cases themselves: where the vector files are, and each
//! family's files checked one by one (all of them, whatever fails); and the CPU trials that
//! check these (`harness::*`).

use anyhow::{anyhow, bail, ensure, Result};
use candle_core::DType;
use libtest_mimic::Trial;
use std::ffi::OsStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// The environment variable naming the directory of the vector files.
pub(crate) const VECTORS_ENV: &str = "CANDLE_FUSED_VECTORS";

/// The vector files' directory, relative to the package.
const IN_PACKAGE: &str = "triton/vectors";

/// Where the vector files are: the directory `env` names (the value of `CANDLE_FUSED_VECTORS`,
/// unset when `None` or empty), else `triton/vectors` under `cwd` (the working directory:
/// cargo runs a test executable in its package's directory), else `triton/vectors` under
/// `built` (the package's directory on the machine that built the executable). A set variable
/// that is not a directory is an error, not a reason to look elsewhere; nothing found is an
/// error that lists the three places tried.
pub(crate) fn vectors_dir(
    env: Option<&OsStr>,
    cwd: Option<&Path>,
    built: &Path,
) -> Result<PathBuf> {
    match env.filter(|v| !v.is_empty()) {
        Some(v) => {
            let dir = PathBuf::from(v);
            ensure!(
                dir.is_dir(),
                "{VECTORS_ENV}={} is not a directory (unset it to use {IN_PACKAGE} under the \
                 working directory or {})",
                dir.display(),
                built.join(IN_PACKAGE).display()
            );
            Ok(dir)
        }
        None => {
            let here = cwd.map(|c| c.join(IN_PACKAGE));
            if let Some(dir) = here.as_ref().filter(|d| d.is_dir()) {
                return Ok(dir.clone());
            }
            let there = built.join(IN_PACKAGE);
            if there.is_dir() {
                return Ok(there);
            }
            bail!(
                "no test vectors: tried {VECTORS_ENV} (unset), {} (the working directory's), {} \
                 (where this executable was built); set {VECTORS_ENV} to a copy of \
                 candle-fused/{IN_PACKAGE}",
                here.map_or("<no working directory>".into(), |d| d.display().to_string()),
                there.display()
            )
        }
    }
}

/// The family's vector files in `dir`, with the dtype of each
/// (`<family>.<dtype>.<case>.safetensors`), sorted by name.
pub(crate) fn vector_files(dir: &Path, family: &str) -> Result<Vec<(PathBuf, DType)>> {
    let mut files = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| anyhow!("reading {}: {e}", dir.display()))?;
    for e in entries {
        let path = e?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() == 4 && parts[0] == family && parts[3] == "safetensors" {
            let dt = match parts[1] {
                "f32" => DType::F32,
                "bf16" => DType::BF16,
                "f16" => DType::F16,
                other => bail!("{name}: unknown dtype {other}"),
            };
            files.push((path, dt));
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    ensure!(
        !files.is_empty(),
        "no vector files for {family} in {}",
        dir.display()
    );
    Ok(files)
}

/// `check` on every item, whatever an earlier one did (an error or a panic); then an error
/// listing every failed item by `name`, with its error, if any failed.
pub(crate) fn check_each<T>(
    items: &[T],
    name: impl Fn(&T) -> String,
    mut check: impl FnMut(&T) -> Result<()>,
) -> Result<()> {
    let mut failed = Vec::new();
    for item in items {
        let outcome = catch_unwind(AssertUnwindSafe(|| check(item))).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(anyhow!("panicked: {msg}"))
        });
        if let Err(e) = outcome {
            failed.push(format!("  {}: {e:#}", name(item)));
        }
    }
    ensure!(
        failed.is_empty(),
        "{} of {} failed:\n{}",
        failed.len(),
        items.len(),
        failed.join("\n")
    );
    Ok(())
}

/// A vector file's name without `.safetensors`: what the checks' lines and errors call it.
pub(crate) fn file_label(path: &Path) -> String {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    name.strip_suffix(".safetensors")
        .unwrap_or(&name)
        .to_string()
}

/// The CPU trials of the runner itself.
pub(crate) fn trials() -> Vec<Trial> {
    let t = |name: &str, f: fn() -> Result<()>| {
        Trial::test(format!("harness::{name}"), move || {
            f().map_err(|e| format!("{e:#}").into())
        })
    };
    vec![
        t("vectors_dir_lookup_order", vectors_dir_lookup_order),
        t("vectors_from_the_environment", vectors_from_the_environment),
        t(
            "check_each_goes_on_after_a_failure",
            check_each_goes_on_after_a_failure,
        ),
    ]
}

/// `CANDLE_FUSED_VECTORS` first (and an error if it is not a directory), then the working
/// directory's `triton/vectors`, then the build-time one; nothing found names all three.
fn vectors_dir_lookup_order() -> Result<()> {
    let root = test_support::fs::TempDir::new("cuda_triton-lookup");
    let (env, cwd, built) = (root.join("env"), root.join("cwd"), root.join("built"));
    for d in [&env, &cwd.join(IN_PACKAGE), &built.join(IN_PACKAGE)] {
        std::fs::create_dir_all(d)?;
    }
    let (no_cwd, no_built) = (root.join("no-cwd"), root.join("no-built"));
    let look = |e: Option<&PathBuf>, c: Option<&PathBuf>, b: &PathBuf| {
        vectors_dir(
            e.map(|p| p.as_os_str()),
            c.map(PathBuf::as_path),
            b.as_path(),
        )
    };
    ensure!(look(Some(&env), Some(&cwd), &built)? == env);
    ensure!(look(None, Some(&cwd), &built)? == cwd.join(IN_PACKAGE));
    // an empty value is unset
    ensure!(vectors_dir(Some(OsStr::new("")), Some(&cwd), &built)? == cwd.join(IN_PACKAGE));
    ensure!(look(None, Some(&no_cwd), &built)? == built.join(IN_PACKAGE));
    ensure!(look(None, None, &built)? == built.join(IN_PACKAGE));

    let e = look(None, Some(&no_cwd), &no_built)
        .unwrap_err()
        .to_string();
    for place in [
        format!("{VECTORS_ENV} (unset)"),
        format!(
            "{} (the working directory's)",
            no_cwd.join(IN_PACKAGE).display()
        ),
        format!("{} (where", no_built.join(IN_PACKAGE).display()),
    ] {
        ensure!(e.contains(&place), "{e:?} does not name {place:?}");
    }
    // a variable that names no directory is an error even where the others exist
    let e = look(Some(&no_cwd), Some(&cwd), &built)
        .unwrap_err()
        .to_string();
    ensure!(
        e.contains(&format!(
            "{VECTORS_ENV}={} is not a directory",
            no_cwd.display()
        )),
        "{e:?}"
    );
    Ok(())
}

/// The executable itself, run with `CANDLE_FUSED_VECTORS` naming a directory that holds a copy
/// of RMSNorm's vector files: its CPU trial checks those copies; then an empty directory: the
/// trial fails, saying where it looked.
fn vectors_from_the_environment() -> Result<()> {
    let here = vectors_dir(
        None,
        std::env::current_dir().ok().as_deref(),
        Path::new(env!("CARGO_MANIFEST_DIR")),
    )?;
    let copy = test_support::fs::TempDir::new("cuda_triton-env");
    let files = vector_files(&here, "rms_norm")?;
    for (path, _) in &files {
        std::fs::copy(path, copy.join(path.file_name().unwrap_or_default()))?;
    }
    let empty = test_support::fs::TempDir::new("cuda_triton-empty");
    let run = |dir: &Path| -> Result<(bool, String)> {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args([
                "--exact",
                "harness_on_the_cpu::rms_norm",
                "--test-threads",
                "1",
            ])
            .env(VECTORS_ENV, dir)
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        Ok((out.status.success(), text))
    };

    let (ok, text) = run(copy.path())?;
    ensure!(ok, "with a copy of the files:\n{text}");
    ensure!(
        text.contains("1 passed"),
        "with a copy of the files, the trial did not run:\n{text}"
    );
    for (path, _) in &files {
        let copied = copy.join(path.file_name().unwrap_or_default());
        ensure!(
            text.contains(&copied.display().to_string()),
            "{} not checked:\n{text}",
            copied.display()
        );
    }
    let (ok, text) = run(empty.path())?;
    ensure!(!ok, "with an empty directory the trial passed:\n{text}");
    let want = format!("no vector files for rms_norm in {}", empty.path().display());
    ensure!(text.contains(&want), "no {want:?} in:\n{text}");
    Ok(())
}

/// A failing case (an error, then a panic) in the middle: the cases after it still run, and the
/// error names exactly the failed ones.
fn check_each_goes_on_after_a_failure() -> Result<()> {
    let cases = ["a", "b", "c", "d", "e"];
    let mut ran = Vec::new();
    let e = check_each(
        &cases,
        |c| format!("case {c}"),
        |c| {
            ran.push(*c);
            match *c {
                "b" => bail!("b is wrong"),
                // a panic that skips the panic hook's message and backtrace
                "d" => std::panic::resume_unwind(Box::new("d blew up")),
                _ => Ok(()),
            }
        },
    )
    .unwrap_err()
    .to_string();
    ensure!(ran == cases, "ran {ran:?} of {cases:?}");
    ensure!(e.starts_with("2 of 5 failed"), "{e:?}");
    ensure!(e.contains("case b: b is wrong"), "{e:?}");
    ensure!(e.contains("case d: panicked: d blew up"), "{e:?}");
    for ok in ["case a", "case c", "case e"] {
        ensure!(!e.contains(ok), "{ok} listed in {e:?}");
    }
    check_each(&cases, |c| c.to_string(), |_| Ok(()))?;
    Ok(())
}
