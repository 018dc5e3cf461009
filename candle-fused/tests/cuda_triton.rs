//! The Triton kernels on CUDA against the test vectors the CPU kernels wrote
//! (`triton/vectors/<family>.<dtype>.<case>.safetensors`), through the ops themselves: forward
//! and backward with the kernels switched on (`cuda_kernels::set_triton`).
//!
//! Compiled always, meaningful with `--features cuda` on a machine with a GPU:
//! `cargo test -p candle-fused --release --features cuda --test cuda_triton`. Where no CUDA
//! device opens, `on_cuda` prints a notice and returns. `harness_on_the_cpu` runs the same cases
//! on the CPU kernels (which wrote the vectors) and on the composite fallback (the path CUDA takes
//! with Triton off), so loading, error measures and tolerance tables are exercised everywhere.
//!
//! On CUDA each case checks, for every vector file of its family:
//! * Triton on: every output within the family's tolerance of the vector (the `TOL` and `ERROR`
//!   of `triton/<family>.py`, restated in the case), and the expected number of kernel launches
//!   (so a silent fallback fails);
//! * Triton on, run again: bit-identical (the kernels have no atomics);
//! * Triton off (the composite fallback): no launch, and within twice the tolerance of the
//!   Triton outputs (both are within the tolerance of the CPU kernel's vector).
//!
//! Adding a family: write its `run` (inputs from the vector file, moved to the device; the op
//! forward and backward; outputs by the names the vector file uses) and add a [`Case`] to
//! [`cases`]. A checked output that a vector file lacks (LayerNorm's `db` without a bias) must
//! be missing from the run's outputs too, and is then not compared for that file.

use anyhow::{bail, ensure, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::attention::AttentionConfig;
use candle_fused::cuda_kernels::{launch_count, set_triton};
use candle_fused::RngKey;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

/// Held by every test that switches the kernels or counts launches (both process-wide), so
/// the tests of this binary do not disturb each other when they run in parallel.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// How an output's error is measured (`ERROR` in `triton/<family>.py`).
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)] // the measures of the families still to come
enum Mode {
    /// The number of elements whose values differ (bit-exact results: tolerance 0).
    Exact,
    /// max |got - want| / max |want| of the same row (last dimension).
    Row,
    /// max |got - want| / max |want| of the whole tensor.
    Tensor,
    /// max |got - want| / |want|, elementwise.
    Elem,
    /// max |got - want|.
    Abs,
}

/// One compared output: its name in the vector file, its error measure, its tolerance for f32,
/// bf16 and f16.
struct Check {
    name: &'static str,
    mode: Mode,
    tol: [f64; 3],
}

type Outputs = Vec<(&'static str, Tensor)>;

/// One kernel family.
struct Case {
    family: &'static str,
    checks: &'static [Check],
    /// The op forward + backward on the device over a vector file's tensors.
    run: fn(&Device, &HashMap<String, Tensor>) -> Result<Outputs>,
    /// Triton kernels one `run` launches (forward and backward) on a vector file's tensors.
    launches: fn(&HashMap<String, Tensor>) -> u64,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            family: "rms_norm",
            checks: RMS_NORM,
            run: rms_norm,
            launches: |_| 3,
        },
        Case {
            family: "layer_norm",
            checks: LAYER_NORM,
            run: layer_norm,
            // forward, dx (+ partial sums), the dw reduction and, with a bias, the db one
            launches: |t| if t.contains_key("b") { 4 } else { 3 },
        },
        Case {
            family: "rope",
            checks: ROPE,
            run: rope,
            launches: |_| 2,
        },
        Case {
            family: "attention",
            checks: ATTENTION,
            run: attention,
            // attn_fwd; attn_bwd_delta, attn_bwd_dkdv, attn_bwd_dq
            launches: |_| 4,
        },
    ]
}

// rms_norm (triton/rms_norm.py TOL, ERROR): f32 y 4e-6, dx and dw 2e-5 (f32 sums in different
// orders, dx with the cancellation g - xhat mean(g xhat)); bf16 / f16: one unit in the last
// place, 2^-7 / 2^-10, relative to the row's (dw: the tensor's) largest value, since both sides
// round nearly the same f32 value once. (`rstd` stays inside the op: not compared here.)
const RMS_NORM: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Row,
        tol: [4e-6, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dx",
        mode: Mode::Row,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dw",
        mode: Mode::Tensor,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
];

fn rms_norm(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let dy = input(t, "dy", dev)?;
    let eps = f64::from(input(t, "eps", &Device::Cpu)?.to_vec1::<f32>()?[0]);
    let y = candle_fused::norm::rms_norm(x.as_tensor(), w.as_tensor(), eps)?;
    // d(sum(y * dy))/dy = dy exactly: the gradients are the backward of `dy`
    let g = (&y * &dy)?.sum_all()?.backward()?;
    Ok(vec![("y", y), ("dx", grad(&g, &x)?), ("dw", grad(&g, &w)?)])
}

// layer_norm (triton/layer_norm.py TOL, ERROR): f32 y, dx, dw, db 2e-5 (f32 sums in different
// orders: a few ulp times log C; dx with the cancellation g - mean(g) - xhat mean(g xhat); y
// in the row offset by 50, where the means' last-ulp difference is amplified by |mean| / std
// ~ 87 in x - mean); bf16 / f16: one unit in the last place, 2^-7 / 2^-10, relative to the
// row's (dw, db: the tensor's) largest value. (`mean`, `rstd` stay inside the op.)
const LAYER_NORM: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Row,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dx",
        mode: Mode::Row,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dw",
        mode: Mode::Tensor,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "db",
        mode: Mode::Tensor,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
];

fn layer_norm(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let b = if t.contains_key("b") {
        Some(Var::from_tensor(&input(t, "b", dev)?)?)
    } else {
        None
    };
    let dy = input(t, "dy", dev)?;
    let eps = f64::from(input(t, "eps", &Device::Cpu)?.to_vec1::<f32>()?[0]);
    let y = candle_fused::norm::layer_norm(
        x.as_tensor(),
        w.as_tensor(),
        b.as_ref().map(Var::as_tensor),
        eps,
    )?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let mut out = vec![("y", y), ("dx", grad(&g, &x)?), ("dw", grad(&g, &w)?)];
    if let Some(b) = &b {
        out.push(("db", grad(&g, b)?));
    }
    Ok(out)
}

// rope (triton/rope.py TOL, ERROR): exact, every dtype: each output is one rounding of
// `a * c -/+ b * s` computed in f32 with the same operations in the same order on both sides
// (two products, one add or subtract, no FMA: the cubins are compiled without contraction).
// The composite fallback on CUDA (separate mul, neg, add kernels) computes the same roundings.
const ROPE: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Exact,
        tol: [0.0; 3],
    },
    Check {
        name: "dx",
        mode: Mode::Exact,
        tol: [0.0; 3],
    },
];

fn rope(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    // `[B, T, D/2]` (each batch row its own positions) or `[T, D/2]` (shared by the batch)
    let (cos, sin) = (input(t, "cos", dev)?, input(t, "sin", dev)?);
    let dy = input(t, "dy", dev)?;
    let y = candle_fused::rope::rope(x.as_tensor(), &cos, &sin)?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    Ok(vec![("y", y), ("dx", grad(&g, &x)?)])
}

// attention (triton/attention.py TOL, ERROR): o relative to its row's largest value, dq, dk,
// dv to the tensor's (a key few queries see has a tiny dK row). f32 1e-5: both sides in f32
// with IEEE products, different summation orders and exp implementations (measured under the
// interpreter: 1e-6). bf16 2^-6, f16 2^-9: two units in the last place; the outputs are rounded
// once on each side and the kernels round P and dS to the dtype for the tensor-core dots (the
// CPU keeps them f32). `lse` stays inside the op: not compared here.
const ATTENTION: &[Check] = &[
    Check {
        name: "o",
        mode: Mode::Row,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dq",
        mode: Mode::Tensor,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dk",
        mode: Mode::Tensor,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dv",
        mode: Mode::Tensor,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
];

/// The vector file's configuration (`flags`, `doc`, `dropout`, `rng`; the scale is the
/// default, checked against `scale`): document ids only when some id is not 0 (all-zero ids
/// stand for none, so both kernel paths of `DOC` run).
fn attention_cfg(t: &HashMap<String, Tensor>, dev: &Device) -> Result<AttentionConfig> {
    let cpu = &Device::Cpu;
    let d = input(t, "q", cpu)?.dim(3)?;
    let scale = input(t, "scale", cpu)?.to_vec1::<f32>()?[0];
    ensure!(
        scale == (1.0 / (d as f64).sqrt()) as f32,
        "scale {scale} is not 1/sqrt({d})"
    );
    let flags = input(t, "flags", cpu)?.to_vec1::<u32>()?;
    let mut cfg = AttentionConfig::causal().with_causal(flags[0] != 0);
    if flags[1] > 0 {
        cfg = cfg.with_window(flags[1] as usize);
    }
    let doc = input(t, "doc", cpu)?;
    if doc.max_all()?.to_scalar::<u32>()? > 0 {
        cfg = cfg.with_doc_ids(doc.to_device(dev)?);
    }
    let p = input(t, "dropout", cpu)?.to_vec1::<f32>()?[0];
    if p > 0.0 {
        let w = input(t, "rng", cpu)?.to_vec1::<u32>()?;
        let u64_of = |i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
        let key = RngKey::new(u64_of(0), u64_of(2)).with_offset(u64_of(4));
        cfg = cfg.with_dropout(p, key);
    }
    Ok(cfg)
}

/// `attention` on `(q, k, v)`: the output and the gradients of `sum(o * dout)`.
fn attention_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    cfg: &AttentionConfig,
) -> Result<Outputs> {
    let (q, k, v) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let o = candle_fused::attention::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), cfg)?;
    let g = (&o * dout)?.sum_all()?.backward()?;
    Ok(vec![
        ("o", o),
        ("dq", grad(&g, &q)?),
        ("dk", grad(&g, &k)?),
        ("dv", grad(&g, &v)?),
    ])
}

fn attention(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let cfg = attention_cfg(t, dev)?;
    let [q, k, v, dout] = ["q", "k", "v", "do"].map(|n| input(t, n, dev));
    attention_grads(&q?, &k?, &v?, &dout?, &cfg)
}

/// `[B, H, T, D]` -> `[B, T, H * D]`.
fn merge(x: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = x.dims4()?;
    Ok(x.transpose(1, 2)?.reshape((b, n, h * d))?)
}

/// `[B, T, H * D]` -> `[B, H, T, D]`.
fn unmerge(x: &Tensor, h: usize) -> Result<Tensor> {
    let (b, n, c) = x.dims3()?;
    Ok(x.reshape((b, n, h, c / h))?.transpose(1, 2)?.contiguous()?)
}

/// `attention_merged` and `attention_qkv` give the bits of `attention` on the same heads (they
/// run the same kernels; only the copies around them differ): merged on the vector's grouped
/// q, k, v; qkv (one kv head per query head) against `attention` with k, v repeated per group.
fn attention_layouts(dev: &Device) -> Result<()> {
    for (path, _) in vector_files("attention")? {
        eprintln!("{} (layouts)", path.display());
        let t = candle_core::safetensors::load(&path, &Device::Cpu)?;
        let cfg = attention_cfg(&t, dev)?;
        let [q, k, v, dout] = ["q", "k", "v", "do"].map(|n| input(&t, n, dev));
        let (q, k, v, dout) = (q?, k?, v?, dout?);
        let (b, h, n, d) = q.dims4()?;
        let kvh = k.dim(1)?;
        let counted = |what: &str, run: &dyn Fn() -> Result<Outputs>| -> Result<Outputs> {
            let before = launch_count();
            let out = run()?;
            let launched = launch_count() - before;
            let want = if dev.is_cuda() { 4 } else { 0 };
            ensure!(
                launched == want,
                "{what}: {launched} Triton launches, expected {want}"
            );
            Ok(out)
        };

        let bhtd = attention_grads(&q, &k, &v, &dout, &cfg)?;
        let merged = counted("attention_merged", &|| {
            let vars = [&q, &k, &v].map(Var::from_tensor);
            let [qv, kv, vv] = vars;
            let (qv, kv, vv) = (qv?, kv?, vv?);
            let y = candle_fused::attention::attention_merged(
                qv.as_tensor(),
                kv.as_tensor(),
                vv.as_tensor(),
                &cfg,
            )?;
            let g = (&y * &merge(&dout)?)?.sum_all()?.backward()?;
            Ok(vec![
                ("o", unmerge(&y, h)?),
                ("dq", grad(&g, &qv)?),
                ("dk", grad(&g, &kv)?),
                ("dv", grad(&g, &vv)?),
            ])
        })?;
        ensure!(
            same_bits(&bhtd, &merged)?,
            "{}: attention_merged differs from attention",
            path.display()
        );

        let rep = |x: &Tensor| -> Result<Tensor> {
            Ok(x.unsqueeze(2)?
                .expand((b, kvh, h / kvh, n, d))?
                .reshape((b, h, n, d))?)
        };
        let (k, v) = (rep(&k)?, rep(&v)?);
        let repeated = attention_grads(&q, &k, &v, &dout, &cfg)?;
        let qkv_out = counted("attention_qkv", &|| {
            let qkv = Var::from_tensor(&Tensor::cat(&[merge(&q)?, merge(&k)?, merge(&v)?], 2)?)?;
            let y = candle_fused::attention::attention_qkv(qkv.as_tensor(), h, &cfg)?;
            let g = (&y * &merge(&dout)?)?.sum_all()?.backward()?;
            let dqkv = grad(&g, &qkv)?;
            let part = |i: usize| unmerge(&dqkv.narrow(2, i * h * d, h * d)?, h);
            Ok(vec![
                ("o", unmerge(&y, h)?),
                ("dq", part(0)?),
                ("dk", part(1)?),
                ("dv", part(2)?),
            ])
        })?;
        ensure!(
            same_bits(&repeated, &qkv_out)?,
            "{}: attention_qkv differs from attention",
            path.display()
        );
    }
    Ok(())
}

#[test]
fn attention_layouts_on_cuda() -> Result<()> {
    let _one = exclusive();
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("cuda_triton::attention_layouts_on_cuda: no CUDA device (or no `cuda` feature), skipped");
        return Ok(());
    };
    set_triton(true);
    attention_layouts(&dev)
}

#[test]
fn attention_layouts_on_the_cpu() -> Result<()> {
    let _one = exclusive();
    attention_layouts(&Device::Cpu)
}

fn input(t: &HashMap<String, Tensor>, name: &str, dev: &Device) -> Result<Tensor> {
    let v = t.get(name).with_context(|| format!("no tensor {name:?}"))?;
    Ok(v.to_device(dev)?)
}

fn grad(g: &GradStore, v: &Var) -> Result<Tensor> {
    g.get(v.as_tensor()).cloned().context("no gradient")
}

/// The family's vector files, with the dtype of each (`<family>.<dtype>.<case>.safetensors`).
fn vector_files(family: &str) -> Result<Vec<(PathBuf, DType)>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("triton/vectors");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&dir)? {
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
    ensure!(!files.is_empty(), "no vector files for {family}");
    Ok(files)
}

fn tol_index(dt: DType) -> usize {
    match dt {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    }
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
    let f = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()?)
    };
    let (g, w) = (f(got)?, f(want)?);
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
    case: &Case,
    dt: DType,
    got: &Outputs,
    want: &Outputs,
    scale: f64,
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
        let tol = scale * check.tol[tol_index(dt)];
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
fn references(case: &Case, t: &HashMap<String, Tensor>) -> Result<Outputs> {
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
        let bits = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?)
        };
        let (x, y) = (bits(x)?, bits(y)?);
        if x.iter().zip(&y).any(|(p, q)| p.to_bits() != q.to_bits()) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[test]
fn on_cuda() -> Result<()> {
    let _one = exclusive();
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("cuda_triton::on_cuda: no CUDA device (or no `cuda` feature), skipped");
        return Ok(());
    };
    for case in cases() {
        for (path, dt) in vector_files(case.family)? {
            eprintln!("{}", path.display());
            let t = candle_core::safetensors::load(&path, &Device::Cpu)?;
            let want = references(&case, &t)?;

            set_triton(true);
            let before = launch_count();
            let on = (case.run)(&dev, &t)?;
            dev.synchronize()?;
            let launched = launch_count() - before;
            let expected = (case.launches)(&t);
            ensure!(
                launched == expected,
                "{}: {launched} Triton launches, expected {expected}",
                case.family
            );
            compare(&case, dt, &on, &want, 1.0, "triton vs cpu")?;
            let again = (case.run)(&dev, &t)?;
            ensure!(
                same_bits(&on, &again)?,
                "{}: Triton run twice differs",
                case.family
            );

            set_triton(false);
            let before = launch_count();
            let off = (case.run)(&dev, &t)?;
            ensure!(
                launch_count() == before,
                "{}: launched with Triton off",
                case.family
            );
            compare(&case, dt, &off, &on, 2.0, "composite vs triton")?;
        }
    }
    Ok(())
}

#[test]
fn harness_on_the_cpu() -> Result<()> {
    for case in cases() {
        for (path, dt) in vector_files(case.family)? {
            let t = candle_core::safetensors::load(&path, &Device::Cpu)?;
            let want = references(&case, &t)?;
            eprintln!("{}", path.display());
            let got = (case.run)(&Device::Cpu, &t)?;
            compare(&case, dt, &got, &want, 1.0, "cpu kernel vs vector")?;
            // the path CUDA takes with Triton off, here on the CPU: within the same tolerance
            let composite = candle_fused::with_composite_fallback(|| (case.run)(&Device::Cpu, &t))?;
            compare(&case, dt, &composite, &want, 1.0, "cpu composite vs vector")?;
        }
    }
    Ok(())
}
