//! The elementwise families' cases: dropout, SwiGLU, GELU (with and without a bias) and AdamW
//! (the in-place update and the sum of squares of the global norm).
//!
//! Their Triton kernels reproduce the CPU kernels operation for operation, so `TOL` is 0 (no
//! element differs) except for GELU's `db` past 4096 rows and the f64 sum of squares (see
//! `triton/gelu.py`, `triton/adamw.py`). The composite fallback is another computation
//! (Candle's `exp` / `tanh` / `silu`, sums in another order): [`FALLBACK`] states its
//! tolerances.

use super::{grad, input, Case, Check, Mode, Outputs};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::adamw::{
    adamw_update, adamw_update_multi, sum_of_squares, sum_of_squares_multi, AdamWParam, AdamWStep,
};
use candle_fused::cuda_kernels::{adamw, dropout::scalars, may_launch, Scalar};
use candle_fused::dropout::{dropout, dropout_mask};
use candle_fused::gelu::{bias_gelu, gelu};
use candle_fused::swiglu::swiglu;
use candle_fused::RngKey;
use std::collections::HashMap;

/// One unit in the last place of bf16 / f16, relative to the largest value compared: both
/// sides round f32 values a few f32 ulp apart, which can land one 16-bit ulp apart.
const ULP16: [f64; 2] = [1.0 / 128.0, 1.0 / 1024.0];
/// Bit-identical (the `exact` of the families' `ERROR`).
const EXACT: [f64; 3] = [0.0; 3];

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "dropout",
            family: "dropout",
            checks: DROPOUT,
            run: run_dropout,
            // forward, backward, `dropout_mask`
            launches: |_| Ok(3),
            cpu_composite: [1.0; 3],
        },
        Case {
            name: "swiglu",
            family: "swiglu",
            checks: SWIGLU,
            run: run_swiglu,
            launches: |_| Ok(2),
            cpu_composite: [1.0; 3],
        },
        Case {
            name: "gelu",
            family: "gelu",
            checks: GELU,
            run: run_gelu,
            // with a bias: forward, dx + db partials, db; without: forward, backward
            launches: |_| Ok(5),
            cpu_composite: [1.0; 3],
        },
        Case {
            name: "adamw",
            family: "adamw",
            checks: ADAMW,
            run: run_adamw,
            // the update, sum-of-squares partials and total; a group file (`sizes`): the same
            // three multi-tensor kernels, or without them (`UNPROVEN`) three per member
            launches: |t| {
                Ok(match t.get("sizes") {
                    Some(s) if !may_launch("adamw_update_multi") => 3 * s.elem_count() as u64,
                    _ => 3,
                })
            },
            cpu_composite: [1.0; 3],
        },
    ]
}

/// The tolerance of the composite fallback (Triton off: Candle ops on the device; on the CPU
/// under `with_composite_fallback`) where it is not the kernels' `TOL`: `(family, output,
/// [f32, bf16, f16])`.
///
/// * SwiGLU, GELU: Candle's `exp` / `tanh` (libm on the CPU, CUDA's `expf` / `tanhf` on the
///   GPU) against the kernels' `exp_f32` / `tanh_f32` (< 1.5 ulp each), through a few more
///   roundings (the composite's backward is several ops); bf16 / f16 one 16-bit ulp (`ULP16`).
///   f32, relative to the row's largest value: SwiGLU 1e-5 (measured on the CPU: 9e-8); GELU
///   1e-4: its rows of 2 (the 4097 x 2 vectors) can hold only values near gelu's minimum
///   (`z ~ -0.75`, where `gelu'` cancels to 0 and `gelu` is small), whose rounding differences
///   are large against the row (measured on the CPU: 1.4e-5 for `dx`, 8.8e-6 for `y`; 2.2e-7
///   on rows of 129).
/// * GELU `db`: the f32 sum over rows in Candle's order against the kernels' blocks: 1e-5 of
///   the largest `|db|` (f32), one 16-bit ulp otherwise.
/// * AdamW `sumsq`: the composite sums f32 squares in f32 (the kernels in f64): 1e-5 relative.
pub(super) const FALLBACK: &[(&str, &str, [f64; 3])] = &[
    ("swiglu", "y", [1e-5, ULP16[0], ULP16[1]]),
    ("swiglu", "d_gate", [1e-5, ULP16[0], ULP16[1]]),
    ("swiglu", "d_up", [1e-5, ULP16[0], ULP16[1]]),
    ("gelu", "y", [1e-4, ULP16[0], ULP16[1]]),
    ("gelu", "dx", [1e-4, ULP16[0], ULP16[1]]),
    ("gelu", "db", [1e-5, ULP16[0], ULP16[1]]),
    ("gelu", "y_nobias", [1e-4, ULP16[0], ULP16[1]]),
    ("gelu", "dx_nobias", [1e-4, ULP16[0], ULP16[1]]),
    ("adamw", "sumsq", [1e-5, 1e-5, 1e-5]),
    ("adamw", "sumsq_group", [1e-5, 1e-5, 1e-5]),
];

// dropout (triton/dropout.py): y, dx and the mask bit-identical (integer Philox words, one f32
// multiply rounded once); the composite multiplies by the same mask: also exact.
const DROPOUT: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Abs,
        tol: EXACT,
    },
    Check {
        name: "dx",
        mode: Mode::Abs,
        tol: EXACT,
    },
    Check {
        name: "mask",
        mode: Mode::Abs,
        tol: EXACT,
    },
];

fn run_dropout(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let dy = input(t, "dy", dev)?;
    let key = input(t, "key", &Device::Cpu)?.to_vec1::<i32>()?;
    let word = |i: usize| u64::from(key[i] as u32) | u64::from(key[i + 1] as u32) << 32;
    let key = RngKey::new(word(0), word(2)).with_offset(word(4));
    let p = input(t, "p", &Device::Cpu)?.to_vec1::<f32>()?[0];
    let scale = input(t, "scale", &Device::Cpu)?.to_vec1::<f32>()?[0];
    // the key and scale read back are the ones the vectors were written with
    let s = scalars(p, key, x.dtype())?;
    ensure!(
        s[7] == Scalar::F32(scale),
        "dropout: scale {scale}, scalars {s:?}"
    );
    let y = dropout(x.as_tensor(), p, key)?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let mask = dropout_mask(x.shape(), p, key, DType::F32, dev)?
        .ne(0f64)?
        .to_dtype(DType::U8)?;
    Ok(vec![("y", y), ("dx", grad(&g, &x)?), ("mask", mask)])
}

// swiglu (triton/swiglu.py): every output bit-identical, every dtype.
const SWIGLU: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Row,
        tol: EXACT,
    },
    Check {
        name: "d_gate",
        mode: Mode::Row,
        tol: EXACT,
    },
    Check {
        name: "d_up",
        mode: Mode::Row,
        tol: EXACT,
    },
];

fn run_swiglu(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let gate = Var::from_tensor(&input(t, "gate", dev)?)?;
    let up = Var::from_tensor(&input(t, "up", dev)?)?;
    let dy = input(t, "dy", dev)?;
    let y = swiglu(gate.as_tensor(), up.as_tensor())?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    Ok(vec![
        ("y", y),
        ("d_gate", grad(&g, &gate)?),
        ("d_up", grad(&g, &up)?),
    ])
}

// gelu (triton/gelu.py): y, dx with and without the bias bit-identical; db the same f32 sums
// up to 4096 rows, past that within 1e-5 of max |db| (f32: the CPU's row blocks grow), one
// rounding (2^-7 / 2^-10) for bf16 / f16.
const GELU: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Row,
        tol: EXACT,
    },
    Check {
        name: "dx",
        mode: Mode::Row,
        tol: EXACT,
    },
    Check {
        name: "db",
        mode: Mode::Tensor,
        tol: [1e-5, ULP16[0], ULP16[1]],
    },
    Check {
        name: "y_nobias",
        mode: Mode::Row,
        tol: EXACT,
    },
    Check {
        name: "dx_nobias",
        mode: Mode::Row,
        tol: EXACT,
    },
];

fn run_gelu(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let b = Var::from_tensor(&input(t, "b", dev)?)?;
    let dy = input(t, "dy", dev)?;
    let y = bias_gelu(x.as_tensor(), Some(b.as_tensor()))?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let y_nobias = gelu(x.as_tensor())?;
    let g_nobias = (&y_nobias * &dy)?.sum_all()?.backward()?;
    Ok(vec![
        ("y", y),
        ("dx", grad(&g, &x)?),
        ("db", grad(&g, &b)?),
        ("y_nobias", y_nobias),
        ("dx_nobias", grad(&g_nobias, &x)?),
    ])
}

// adamw (triton/adamw.py): the update bit-identical (the CPU's f32 operations in its order,
// sqrt and division correctly rounded); sumsq: f64 sums in two fixed orders, rounded to f32,
// within one f32 rounding (2^-23 relative).
const ADAMW: &[Check] = &[
    Check {
        name: "param",
        mode: Mode::Abs,
        tol: EXACT,
    },
    Check {
        name: "exp_avg",
        mode: Mode::Abs,
        tol: EXACT,
    },
    Check {
        name: "exp_avg_sq",
        mode: Mode::Abs,
        tol: EXACT,
    },
    Check {
        name: "sumsq",
        mode: Mode::Elem,
        tol: [1.0 / 8_388_608.0; 3],
    },
    // a group's total: each member's sum within 2^-23, their f32 sum in order (adamw.py's TOL)
    Check {
        name: "sumsq_group",
        mode: Mode::Elem,
        tol: [8.0 / 8_388_608.0; 3],
    },
];

/// The step `tests/triton_vectors/adamw.rs` took for a file (by its size), checked against the
/// scalars the file holds. The grad scale is the file's (it rounds back to the same f32): the
/// vectors computed it from the CPU kernel's global norm.
fn adamw_step(t: &HashMap<String, Tensor>) -> Result<AdamWStep> {
    let want = input(t, "scalars", &Device::Cpu)?.to_vec1::<f32>()?;
    let e = t.get("grad").context("no tensor \"grad\"")?.elem_count();
    let grad_scale = f64::from(want[0]);
    let step = if e > 5 {
        AdamWStep {
            lr: 3e-4,
            weight_decay: 0.1,
            step: 7,
            grad_scale,
            ..Default::default()
        }
    } else {
        AdamWStep {
            weight_decay: 0.0,
            grad_scale,
            ..Default::default()
        }
    };
    let got: Vec<f32> = adamw::scalars(&step)?
        .iter()
        .map(|s| match s {
            Scalar::F32(v) => Ok(*v),
            Scalar::I32(_) => anyhow::bail!("an i32 AdamW scalar"),
        })
        .collect::<Result<_>>()?;
    ensure!(
        got == want,
        "adamw: step scalars {got:?}, the file's {want:?}"
    );
    Ok(step)
}

fn run_adamw(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    if t.contains_key("sizes") {
        return run_adamw_group(dev, t);
    }
    let step = adamw_step(t)?;
    // fresh copies: the update is in place (and `to_device` to the CPU shares the storage)
    let fresh = |name: &str| -> Result<Tensor> { Ok(input(t, name, dev)?.copy()?) };
    let param = Var::from_tensor(&fresh("param_in")?)?;
    let (m, v, g) = (
        fresh("exp_avg_in")?,
        fresh("exp_avg_sq_in")?,
        fresh("grad")?,
    );
    adamw_update(&param, &g, &m, &v, &step)?;
    let sumsq = sum_of_squares(&g)?.reshape(1)?;
    Ok(vec![
        ("param", param.as_tensor().clone()),
        ("exp_avg", m),
        ("exp_avg_sq", v),
        ("sumsq", sumsq),
    ])
}

/// A group file (`tests/triton_vectors/adamw.rs`'s `group`): its members split out of the
/// concatenated tensors into their own allocations, stepped by `adamw_update_multi` and their
/// gradients summed by `sum_of_squares_multi`; the outputs concatenated again.
fn run_adamw_group(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let step = adamw_step(t)?;
    let sizes = input(t, "sizes", &Device::Cpu)?.to_vec1::<i64>()?;
    let decay = input(t, "decay", &Device::Cpu)?.to_vec1::<i64>()?;
    let split = |name: &str| -> Result<Vec<Tensor>> {
        let all = input(t, name, dev)?;
        let mut at = 0;
        sizes
            .iter()
            .map(|&n| {
                let piece = all.narrow(0, at, n as usize)?.copy()?;
                at += n as usize;
                Ok(piece)
            })
            .collect()
    };
    let params = split("param_in")?
        .iter()
        .map(|p| Ok(Var::from_tensor(p)?))
        .collect::<Result<Vec<_>>>()?;
    let (m, v, g) = (
        split("exp_avg_in")?,
        split("exp_avg_sq_in")?,
        split("grad")?,
    );
    let group: Vec<AdamWParam> = (0..sizes.len())
        .map(|i| AdamWParam {
            param: &params[i],
            grad: &g[i],
            exp_avg: &m[i],
            exp_avg_sq: &v[i],
            decay: decay[i] != 0,
        })
        .collect();
    adamw_update_multi(&group, &step)?;
    let grads: Vec<&Tensor> = g.iter().collect();
    let sumsq = sum_of_squares_multi(&grads)?
        .context("an empty group")?
        .reshape(1)?;
    let params: Vec<Tensor> = params.iter().map(|p| p.as_tensor().clone()).collect();
    Ok(vec![
        ("param", Tensor::cat(&params, 0)?),
        ("exp_avg", Tensor::cat(&m, 0)?),
        ("exp_avg_sq", Tensor::cat(&v, 0)?),
        ("sumsq_group", sumsq),
    ])
}
