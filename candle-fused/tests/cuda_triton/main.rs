//! The Triton kernels on CUDA against the test vectors the CPU kernels wrote
//! (`triton/vectors/<family>.<dtype>.<case>.safetensors`), through the ops themselves: forward
//! and backward with the kernels switched on (`cuda_kernels::set_triton`).
//!
//! Compiled always, meaningful with `--features cuda` on a machine with a GPU:
//! `cargo test -p candle-fused --release --features cuda --test cuda_triton`. Its own test
//! runner (`harness = false`, libtest-mimic: filters, `--exact`, `--skip`, `--list`,
//! `--test-threads` as usual) runs one trial per case (kernel family) and target:
//! * `on_cuda::<case>`: the kernels on CUDA. Where no CUDA device opens (no `cuda` feature, or
//!   `Device::new_cuda(0)` fails), decided before any trial runs, these trials are reported
//!   *ignored*, not passed, with one line on stderr:
//!   `cuda_triton: no CUDA device (<reason>): N CUDA trials skipped`.
//! * `harness_on_the_cpu::<case>`: the same case on the CPU kernels (which wrote the vectors)
//!   and on the composite fallback (the path CUDA takes with Triton off), so loading, error
//!   measures and tolerance tables are exercised everywhere.
//! * `harness::*`: the runner itself ([`runner`]).
//!
//! A failing trial does not stop the others, and within a trial every vector file is checked
//! whatever an earlier one did: the trial's error lists each failed file with its error.
//!
//! The vector files are looked for in the directory `CANDLE_FUSED_VECTORS` names (an error if
//! it is set to anything but a directory), else in `triton/vectors` under the working
//! directory (cargo runs a test in `candle-fused/`), else in `triton/vectors` under the
//! package's directory on the machine that built the executable; where none exists, every
//! trial that needs them fails naming the three places. The directory used is printed first.
//!
//! On CUDA each case checks, for every vector file of its family:
//! * Triton on: every output within the family's tolerance of the vector (the `TOL` and `ERROR`
//!   of `triton/<family>.py`, restated in the case), and the expected number of kernel launches
//!   (so a silent fallback fails);
//! * Triton on, run again: bit-identical (the kernels have no atomics);
//! * Triton off (the composite fallback): no launch, and within twice the tolerance of the
//!   Triton outputs (both are within the tolerance of the CPU kernel's vector).
//!
//! The families, their tolerances and how each runs come from the one registry of the Triton
//! tests, `tests/families` ([`families::FAMILIES`]); adding a family is an entry there. A checked
//! output that a vector file lacks (LayerNorm's `db` without a bias) must be missing from the
//! run's outputs too, and is then not compared for that file. Where the composite fallback is
//! held to another tolerance than the kernels (the families whose kernels are bit-identical to
//! the CPU's), the entry's `fallback` says so.

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor, WithDType};
use candle_fused::cuda_kernels::{launch_count, set_triton};
use families::{input, tol_index, Against, Family, Mode, Outputs, FAMILIES};
use libtest_mimic::{Arguments, Trial};
use runner::{check_each, file_label, vector_files, vectors_dir, VECTORS_ENV};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

/// Held by every trial that switches the kernels or counts launches (both process-wide), so
/// the trials of this binary do not disturb each other when they run in parallel; switches the
/// kernels off again when dropped (also when a trial fails half way).
fn exclusive() -> Exclusive {
    static LOCK: Mutex<()> = Mutex::new(());
    Exclusive {
        _lock: LOCK.lock().unwrap_or_else(|e| e.into_inner()),
    }
}

/// The guard of [`exclusive`].
struct Exclusive {
    _lock: MutexGuard<'static, ()>,
}

impl Drop for Exclusive {
    fn drop(&mut self) {
        set_triton(false);
    }
}

mod attention;
#[path = "../common/mod.rs"]
mod common;
#[path = "../families/mod.rs"]
mod families;
mod runner;

/// `t`'s elements on the host, converted to `T`.
fn host<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(T::DTYPE)?
        .flatten_all()?
        .to_vec1()?)
}

/// The error of `got` against `want` as `mode` measures it.
fn error(mode: Mode, got: &Tensor, want: &Tensor) -> Result<f64> {
    ensure!(
        got.dims() == want.dims(),
        "shape {:?}, want {:?}",
        got.dims(),
        want.dims()
    );
    let c = want.dims().last().copied().unwrap_or(1).max(1);
    let (g, w) = (host::<f64>(got)?, host::<f64>(want)?);
    let tensor_max = w.iter().fold(0f64, |m, v| m.max(v.abs()));
    if let Mode::Exact = mode {
        // a NaN differs from everything, itself included
        return Ok(g.iter().zip(&w).filter(|(a, b)| a != b).count() as f64);
    }
    let mut worst = 0f64;
    for (gr, wr) in g.chunks(c).zip(w.chunks(c)) {
        let row_max = wr.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (a, b) in gr.iter().zip(wr) {
            let d = (a - b).abs();
            let e = match mode {
                Mode::Row => d / row_max.max(1e-30),
                Mode::Tensor => d / tensor_max.max(1e-30),
                Mode::Elem => d / b.abs().max(1e-30),
                Mode::Abs => d,
                Mode::Exact => unreachable!("counted above"),
            };
            // a NaN anywhere is an error, not a skipped element
            worst = if e.is_nan() {
                f64::INFINITY
            } else {
                worst.max(e)
            };
        }
    }
    Ok(worst)
}

/// Every output of `case` within `scale` times its tolerance of `want`'s (by name).
fn compare(
    case: &Family,
    dt: DType,
    got: &Outputs,
    want: &Outputs,
    (against, scale): (Against, f64),
    what: &str,
) -> Result<()> {
    for check in case.checks {
        let pick = |o: &Outputs| {
            o.iter()
                .find(|(n, _)| *n == check.name)
                .map(|(_, t)| t.clone())
        };
        let (g, w) = match (pick(got), pick(want)) {
            (Some(g), Some(w)) => (g, w),
            // an output this vector file does not have (e.g. db without a bias)
            (None, None) => continue,
            (g, _) => bail!(
                "{} {dt:?} {what}: output {} {}",
                case.family,
                check.name,
                if g.is_none() {
                    "missing"
                } else {
                    "not expected"
                }
            ),
        };
        let tol = scale * case.tol(check, against)[tol_index(dt)];
        let e = error(check.mode, &g, &w)?;
        eprintln!(
            "  {what} {}: {:?} error {e:.3e} (tolerance {tol:.3e})",
            check.name, check.mode
        );
        ensure!(
            e <= tol,
            "{} {dt:?} {what}: {} error {e:.3e} > {tol:.3e}",
            case.family,
            check.name
        );
    }
    Ok(())
}

/// The checked outputs the vector file holds.
fn references(case: &Family, t: &families::Tensors) -> Result<Outputs> {
    case.checks
        .iter()
        .filter(|c| t.contains_key(c.name))
        .map(|c| Ok((c.name, input(t, c.name, &Device::Cpu)?)))
        .collect()
}

fn same_bits(a: &Outputs, b: &Outputs) -> Result<bool> {
    ensure!(
        a.len() == b.len(),
        "{} outputs against {}",
        a.len(),
        b.len()
    );
    for ((_, x), (_, y)) in a.iter().zip(b) {
        ensure!(
            x.dims() == y.dims(),
            "shape {:?} against {:?}",
            x.dims(),
            y.dims()
        );
        let (x, y) = (host::<f32>(x)?, host::<f32>(y)?);
        if x.iter().zip(&y).any(|(p, q)| p.to_bits() != q.to_bits()) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Triton on CUDA for one vector file of `case`: within the tolerance of the vector, the
/// expected launches, bit-identical when run again; the composite fallback (Triton off)
/// without launches and within twice the tolerance of the kernels.
fn on_cuda_file(case: &Family, dev: &Device, path: &Path, dt: DType) -> Result<()> {
    let label = file_label(path);
    eprintln!("{}", path.display());
    let t = candle_core::safetensors::load(path, &Device::Cpu)?;
    let want = references(case, &t)?;

    set_triton(true);
    let before = launch_count();
    let on = (case.run)(dev, &t)?;
    dev.synchronize()?;
    let launched = launch_count() - before;
    let expected = (case.launches)(&t)?;
    ensure!(
        launched == expected,
        "{launched} Triton launches, expected {expected}"
    );
    compare(
        case,
        dt,
        &on,
        &want,
        (Against::Kernels, 1.0),
        &format!("{label} triton vs cpu"),
    )?;
    let again = (case.run)(dev, &t)?;
    ensure!(same_bits(&on, &again)?, "Triton run twice differs");

    set_triton(false);
    let before = launch_count();
    let off = (case.run)(dev, &t)?;
    ensure!(launch_count() == before, "launched with Triton off");
    compare(
        case,
        dt,
        &off,
        &on,
        (Against::Fallback, 2.0),
        &format!("{label} composite vs triton"),
    )
}

/// The same case on the CPU for one vector file: the CPU kernel (which wrote the vector) and
/// the composite fallback (the path CUDA takes with Triton off), each within the tolerance.
fn cpu_file(case: &Family, path: &Path, dt: DType) -> Result<()> {
    let label = file_label(path);
    eprintln!("{}", path.display());
    let t = candle_core::safetensors::load(path, &Device::Cpu)?;
    let want = references(case, &t)?;
    let got = (case.run)(&Device::Cpu, &t)?;
    compare(
        case,
        dt,
        &got,
        &want,
        (Against::Kernels, 1.0),
        &format!("{label} cpu kernel vs vector"),
    )?;
    let composite = candle_fused::with_composite_fallback(|| (case.run)(&Device::Cpu, &t))?;
    let scale = case.cpu_composite[tol_index(dt)];
    compare(
        case,
        dt,
        &composite,
        &want,
        (Against::Fallback, scale),
        &format!("{label} cpu composite vs vector"),
    )
}

/// Every vector file of `case` through `file`, all of them whatever fails.
fn each_file(
    case: &Family,
    dir: &Path,
    mut file: impl FnMut(&Path, DType) -> Result<()>,
) -> Result<()> {
    let files = vector_files(dir, case.family)?;
    check_each(&files, |(p, _)| file_label(p), |(p, dt)| file(p, *dt))
}

/// What one trial checks, on CUDA and (its `harness_on_the_cpu` twin) on the CPU.
enum Work {
    Case(&'static Family),
    /// [`attention::attention_layouts`].
    AttentionLayouts,
}

impl Work {
    fn name(&self) -> &'static str {
        match self {
            Work::Case(c) => c.name,
            Work::AttentionLayouts => "attention_layouts",
        }
    }

    fn on_cuda(&self, dev: &Device, dir: &Path) -> Result<()> {
        let _one = exclusive();
        match self {
            Work::Case(c) => each_file(c, dir, |p, dt| on_cuda_file(c, dev, p, dt)),
            Work::AttentionLayouts => {
                set_triton(true);
                attention::attention_layouts(dev, dir)
            }
        }
    }

    fn on_the_cpu(&self, dir: &Path) -> Result<()> {
        match self {
            Work::Case(c) => each_file(c, dir, |p, dt| cpu_file(c, p, dt)),
            Work::AttentionLayouts => {
                // counts launches (none on the CPU): process-wide
                let _one = exclusive();
                attention::attention_layouts(&Device::Cpu, dir)
            }
        }
    }
}

/// The CUDA device, or why none opened.
fn cuda_device() -> std::result::Result<Device, String> {
    Device::new_cuda(0).map_err(|e| e.to_string().lines().next().unwrap_or("").to_string())
}

fn main() {
    let args = Arguments::from_args();
    let vectors = vectors_dir(
        std::env::var_os(VECTORS_ENV).as_deref(),
        std::env::current_dir().ok().as_deref(),
        Path::new(env!("CARGO_MANIFEST_DIR")),
    )
    .map_err(|e| format!("{e:#}"));
    let work: Vec<Arc<Work>> = FAMILIES
        .iter()
        .map(Work::Case)
        .chain([Work::AttentionLayouts])
        .map(Arc::new)
        .collect();
    // The CUDA trials the command line asks for (as ignored trials, so that `--ignored` selects
    // them too).
    let asked = work
        .iter()
        .map(|w| Trial::test(format!("on_cuda::{}", w.name()), || Ok(())).with_ignored_flag(true))
        .filter(|t| !args.is_filtered_out(t))
        .count();
    // The device opens before any trial runs, and only when a CUDA trial is asked for: where
    // none opens, the CUDA trials are ignored (counted as such), with one notice.
    let dev = if args.list || asked == 0 {
        Err(String::new())
    } else {
        cuda_device()
    };
    if !args.list {
        match &vectors {
            Ok(dir) => eprintln!("cuda_triton: test vectors from {}", dir.display()),
            Err(e) => eprintln!("cuda_triton: {e}"),
        }
        if let (Err(reason), true) = (&dev, asked > 0) {
            eprintln!("cuda_triton: no CUDA device ({reason}): {asked} CUDA trials skipped");
        }
    }

    let mut trials = Vec::new();
    for w in work {
        let (w2, d, v) = (w.clone(), dev.clone(), vectors.clone());
        let no_device = d.is_err() && !args.list;
        trials.push(
            Trial::test(format!("on_cuda::{}", w.name()), move || {
                let dev = d.map_err(|e| format!("no CUDA device ({e})"))?;
                let dir = v?;
                w2.on_cuda(&dev, &dir).map_err(|e| format!("{e:#}").into())
            })
            .with_ignored_flag(no_device),
        );
        let v = vectors.clone();
        trials.push(Trial::test(
            format!("harness_on_the_cpu::{}", w.name()),
            move || {
                let dir = v?;
                w.on_the_cpu(&dir).map_err(|e| format!("{e:#}").into())
            },
        ));
    }
    trials.extend(runner::trials());
    libtest_mimic::run(&args, trials).exit()
}
