//! The one registry of the Triton kernel families' tests ([`FAMILIES`]): for each family (or,
//! where one family's vectors check two ops, each op), its test vectors (the cases and the CPU
//! kernel that computes them), the outputs compared and their tolerances, and how its op runs on
//! a device over a vector file. Three harnesses read it:
//!
//! * `tests/triton_vectors` writes each entry's vector files
//!   (`triton/vectors/<family>.<dtype>.<case>.safetensors`) from the CPU kernels;
//! * `tests/cuda_triton` runs each entry's op over its vector files on CUDA (Triton on and off)
//!   and on the CPU (the kernel and the composite fallback), within the entry's tolerances;
//! * `tests/triton_record` holds the entries' tolerances to those the Triton interpreter was
//!   checked with (`triton/records/<family>.json`, from `TOL` and `ERROR` of
//!   `triton/<family>.py`), and every family of the launch tables to an entry.
//!
//! Adding a family: one module here (its `vectors`, its [`Check`]s, its `run`, and a
//! `pub(crate) const FAMILY: Family`) and its line in [`FAMILIES`].
//!
//! Each including test crate declares `common` (`tests/common/mod.rs`) at its root, and uses
//! only part of this module.
#![allow(dead_code)]

use anyhow::{anyhow, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

pub(crate) mod adamw;
pub(crate) mod attention;
pub(crate) mod cross_entropy;
pub(crate) mod dropout;
pub(crate) mod embedding;
pub(crate) mod gelu;
pub(crate) mod layer_norm;
pub(crate) mod nf4;
pub(crate) mod rms_norm;
pub(crate) mod rope;
pub(crate) mod swiglu;

/// Every family, in the order the trials run.
pub(crate) const FAMILIES: &[Family] = &[
    rms_norm::FAMILY,
    layer_norm::FAMILY,
    rope::FAMILY,
    attention::FAMILY,
    cross_entropy::FAMILY,
    cross_entropy::LINEAR_FAMILY,
    dropout::FAMILY,
    swiglu::FAMILY,
    gelu::FAMILY,
    gelu::GEGLU_FAMILY,
    adamw::FAMILY,
    embedding::FAMILY,
    nf4::FAMILY,
];

/// A vector file's tensors, by name.
pub(crate) type Tensors = HashMap<String, Tensor>;

/// Named tensors: a vector file's contents, or what a `run` returns.
pub(crate) type Outputs = Vec<(&'static str, Tensor)>;

/// One entry of [`FAMILIES`].
pub(crate) struct Family {
    /// The trials' name: `on_cuda::<name>`, `harness_on_the_cpu::<name>`,
    /// `<name>::write_vectors`.
    pub(crate) name: &'static str,
    /// The vector files' prefix, the Triton source `triton/<family>.py`.
    pub(crate) family: &'static str,
    /// The compared outputs and their tolerances.
    pub(crate) checks: &'static [Check],
    /// The composite fallback's tolerance where it is not the kernels' (by output name).
    pub(crate) fallback: &'static [(&'static str, [f64; 3])],
    /// The op forward + backward on the device over a vector file's tensors.
    pub(crate) run: fn(&Device, &Tensors) -> Result<Outputs>,
    /// Triton kernels one `run` launches (forward and backward) on a vector file's tensors.
    pub(crate) launches: fn(&Tensors) -> Result<u64>,
    /// The CPU trial's tolerance for the composite on the CPU, in multiples of the fallback's,
    /// for f32, bf16, f16: 1 unless Candle's CPU ops round where its CUDA ops do not.
    pub(crate) cpu_composite: [f64; 3],
    /// Writes the family's vector files into a directory (`None`: another entry of the same
    /// family writes them).
    pub(crate) write_vectors: Option<fn(&Path) -> Result<()>>,
}

impl Family {
    /// An entry checking `checks` of `run` on the vectors of `family`, which it writes with
    /// `write_vectors`; the fallback held to the kernels' tolerances, the CPU composite too.
    pub(crate) const fn new(
        family: &'static str,
        checks: &'static [Check],
        run: fn(&Device, &Tensors) -> Result<Outputs>,
        launches: fn(&Tensors) -> Result<u64>,
        write_vectors: fn(&Path) -> Result<()>,
    ) -> Self {
        Self {
            name: family,
            family,
            checks,
            fallback: &[],
            run,
            launches,
            cpu_composite: [1.0; 3],
            write_vectors: Some(write_vectors),
        }
    }

    /// The tolerances of `check` for the kernels (`Against::Kernels`) or for the composite
    /// fallback (`Against::Fallback`: the entry's `fallback` line, else the kernels' own).
    pub(crate) fn tol(&self, check: &Check, against: Against) -> [f64; 3] {
        match against {
            Against::Kernels => check.tol,
            Against::Fallback => self
                .fallback
                .iter()
                .find(|(n, _)| *n == check.name)
                .map_or(check.tol, |(_, tol)| *tol),
        }
    }
}

/// Whose tolerances a comparison uses: the Triton kernels' or the composite fallback's.
#[derive(Clone, Copy)]
pub(crate) enum Against {
    Kernels,
    Fallback,
}

/// How an output's error is measured (`ERROR` in `triton/<family>.py`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mode {
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

impl Mode {
    /// Its name in `ERROR` (and the interpreter's records).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Row => "row",
            Mode::Tensor => "tensor",
            Mode::Elem => "elem",
            Mode::Abs => "abs",
        }
    }
}

/// One compared output: its name in the vector file, its error measure, its tolerance for f32,
/// bf16 and f16.
pub(crate) struct Check {
    pub(crate) name: &'static str,
    pub(crate) mode: Mode,
    pub(crate) tol: [f64; 3],
}

impl Check {
    pub(crate) const fn new(name: &'static str, mode: Mode, tol: [f64; 3]) -> Self {
        Self { name, mode, tol }
    }
}

/// One unit in the last place of bf16 / f16, relative to the largest value compared: both
/// sides round f32 values a few f32 ulp apart, which can land one 16-bit ulp apart.
pub(crate) const ULP16: [f64; 2] = [1.0 / 128.0, 1.0 / 1024.0];
/// Bit-identical (the `exact` of the families' `ERROR`).
pub(crate) const EXACT: [f64; 3] = [0.0; 3];

/// The index of `dt` in a tolerance `[f32, bf16, f16]`.
pub(crate) fn tol_index(dt: DType) -> usize {
    match dt {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    }
}

/// The tensor `name` of a vector file, on `dev`.
pub(crate) fn input(t: &Tensors, name: &str, dev: &Device) -> Result<Tensor> {
    let v = t.get(name).with_context(|| format!("no tensor {name:?}"))?;
    Ok(v.to_device(dev)?)
}

/// The gradient of `v` in `g`.
pub(crate) fn grad(g: &GradStore, v: &Var) -> Result<Tensor> {
    g.get(v.as_tensor()).cloned().context("no gradient")
}

/// The gradients of `sum(y * dy)`: as d(sum(y * dy))/dy = dy exactly, the backward of `dy`.
pub(crate) fn backward_of(y: &Tensor, dy: &Tensor) -> Result<GradStore> {
    Ok((y * dy)?.sum_all()?.backward()?)
}

/// `op` on `inputs` (each made a variable) and the gradient of `sum(y * dy)` with respect to
/// each: the op's forward and, as d(sum(y * dy))/dy = dy exactly, its backward of `dy`.
pub(crate) fn forward_backward<const N: usize>(
    inputs: [&Tensor; N],
    dy: &Tensor,
    op: impl FnOnce([&Tensor; N]) -> candle_core::Result<Tensor>,
) -> Result<(Tensor, [Tensor; N])> {
    let vars = inputs
        .iter()
        .map(|t| Var::from_tensor(t))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let y = op(std::array::from_fn(|i| vars[i].as_tensor()))?;
    let g = backward_of(&y, dy)?;
    let grads = vars
        .iter()
        .map(|v| grad(&g, v))
        .collect::<Result<Vec<_>>>()?;
    let grads = grads.try_into().map_err(|_| anyhow!("{N} gradients"))?;
    Ok((y, grads))
}

/// Writes, for every case and each of its dtypes, `vectors(case, dtype, seed)` to
/// `<dir>/<family>.<dtype>.<label(case)>.safetensors`, seeded `base + 10 * (the dtype's index
/// in the case's list) + (the case's index)`.
pub(crate) fn write_each<C>(
    dir: &Path,
    family: &str,
    base: u64,
    cases: &[C],
    dtypes: impl Fn(&C) -> &[DType],
    label: impl Fn(&C) -> String,
    vectors: impl Fn(&C, DType, u64) -> Result<Outputs>,
) -> Result<()> {
    for (s, case) in cases.iter().enumerate() {
        for (k, &dt) in dtypes(case).iter().enumerate() {
            let t = vectors(case, dt, base + 10 * k as u64 + s as u64)?;
            write(
                dir,
                &format!("{family}.{}.{}", dtype_name(dt), label(case)),
                t,
            )?;
        }
    }
    Ok(())
}

/// `dt`'s name in the vector files' names.
pub(crate) fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => panic!("no Triton test vectors in {other:?}"),
    }
}

/// The three dtypes every family's kernels take.
pub(crate) const ALL_DTYPES: &[DType] = &[DType::F32, DType::BF16, DType::F16];

/// A shape as a case label: `37x129`.
pub(crate) fn shape_label(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    dims.join("x")
}

/// Writes `tensors` to `<dir>/<stem>.safetensors`.
pub(crate) fn write(dir: &Path, stem: &str, tensors: Outputs) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| (k.to_string(), t))
        .collect();
    let path = dir.join(format!("{stem}.safetensors"));
    candle_core::safetensors::save(&map, &path)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
