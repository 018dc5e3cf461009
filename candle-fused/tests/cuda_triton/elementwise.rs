//! The elementwise families' cases: dropout and SwiGLU (GELU and AdamW to come).
//!
//! Their Triton kernels reproduce the CPU kernels operation for operation, so `TOL` is 0 (no
//! element differs) except for GELU's `db` past 4096 rows and the f64 sum of squares (see
//! `triton/gelu.py`, `triton/adamw.py`). The composite fallback is another computation
//! (Candle's `exp` / `tanh` / `silu`, sums in another order): [`FALLBACK`] states its
//! tolerances.

use super::{grad, input, Case, Check, Mode, Outputs};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::cuda_kernels::{dropout::scalars, Scalar};
use candle_fused::dropout::{dropout, dropout_mask};
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
            family: "dropout",
            checks: DROPOUT,
            run: run_dropout,
            // forward, backward, `dropout_mask`
            launches: 3,
        },
        Case {
            family: "swiglu",
            checks: SWIGLU,
            run: run_swiglu,
            launches: 2,
        },
    ]
}

/// The tolerance of the composite fallback (Triton off: Candle ops on the device; on the CPU
/// under `with_composite_fallback`) where it is not the kernels' `TOL`: `(family, output,
/// [f32, bf16, f16])`.
///
/// * SwiGLU: Candle's `exp` / `silu` (libm on the CPU, CUDA's `expf` on the GPU) against the
///   kernels' `exp_f32` (< 1 ulp), through a few more roundings (the composite's backward is
///   several ops): f32 within 1e-5 of the row's largest value (measured on the CPU: 9e-8);
///   bf16 / f16 one 16-bit ulp (`ULP16`).
pub(super) const FALLBACK: &[(&str, &str, [f64; 3])] = &[
    ("swiglu", "y", [1e-5, ULP16[0], ULP16[1]]),
    ("swiglu", "d_gate", [1e-5, ULP16[0], ULP16[1]]),
    ("swiglu", "d_up", [1e-5, ULP16[0], ULP16[1]]),
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
