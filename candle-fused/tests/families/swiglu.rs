//! SwiGLU (`triton/swiglu.py`): each file `swiglu.<dtype>.<shape>.safetensors` holds `gate`,
//! `up`, `dy` (inputs, in the dtype) and the CPU kernel's `y`, `d_gate`, `d_up` (the dtype).
//! The element counts (37 x 129 = 4773, 3001) are not multiples of the Triton block (1024);
//! `gate` is uniform in [-8, 8) with the sigmoid's tails and the exponential's clamp
//! (|g| = 30, 90, 104.5, 200) and both zeros at the start.

use super::{
    forward_backward, input, shape_label, write_each, Check, Family, Mode, Outputs, Tensors,
};
use super::{ALL_DTYPES, EXACT, ULP16};
use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::swiglu::swiglu;
use std::path::Path;

pub(crate) const FAMILY: Family = Family {
    // Candle's `exp` (libm on the CPU, CUDA's `expf` on the GPU) against the kernels' `exp_f32`
    // (< 1.5 ulp), through a few more roundings (the composite's backward is several ops): f32
    // 1e-5 of the row's largest value (measured on the CPU: 9e-8); bf16 / f16 one 16-bit ulp.
    fallback: &[
        ("y", [1e-5, ULP16[0], ULP16[1]]),
        ("d_gate", [1e-5, ULP16[0], ULP16[1]]),
        ("d_up", [1e-5, ULP16[0], ULP16[1]]),
    ],
    ..Family::new("swiglu", SWIGLU, run, |_| Ok(2), write_vectors)
};

const SHAPES: [&[usize]; 2] = [&[37, 129], &[3001]];
const TAILS: [f64; 10] = [
    -200.0, -104.5, -90.0, -30.0, -0.0, 0.0, 30.0, 90.0, 104.5, 200.0,
];

fn vectors(shape: &[usize], dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let n: usize = shape.iter().product();
    let mut g: Vec<f64> = (0..n).map(|_| rng.next() * 8.0).collect();
    g[..TAILS.len()].copy_from_slice(&TAILS);
    let gate = Tensor::from_vec(g, shape, &Device::Cpu)?.to_dtype(dt)?;
    let up = common::rand(shape, dt, &mut rng, 2.0, 0.0)?;
    let dy = common::rand(shape, dt, &mut rng, 1.0, 0.0)?;
    let (y, [d_gate, d_up]) = forward_backward([&gate, &up], &dy, |[g, u]| swiglu(g, u))?;
    Ok(vec![
        ("gate", gate),
        ("up", up),
        ("dy", dy),
        ("y", y),
        ("d_gate", d_gate),
        ("d_up", d_up),
    ])
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |shape: &&[usize]| shape_label(shape);
    write_each(
        dir,
        "swiglu",
        2000,
        &SHAPES,
        |_| ALL_DTYPES,
        label,
        |shape, dt, seed| vectors(shape, dt, seed),
    )
}

// swiglu (triton/swiglu.py): every output bit-identical, every dtype.
const SWIGLU: &[Check] = &[
    Check::new("y", Mode::Row, EXACT),
    Check::new("d_gate", Mode::Row, EXACT),
    Check::new("d_up", Mode::Row, EXACT),
];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    run_gated(dev, t, "gate", ["y", "d_gate", "d_up"], swiglu)
}

/// A gated op (`swiglu`, `geglu`) forward and backward on the file's `<gate>`, `up` and `dy`:
/// its outputs under `names` (`y`, `d_gate`, `d_up`).
pub(crate) fn run_gated(
    dev: &Device,
    t: &Tensors,
    gate: &str,
    names: [&'static str; 3],
    op: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Result<Outputs> {
    let [g, u, dy] = [gate, "up", "dy"].map(|n| input(t, n, dev));
    let (y, [dg, du]) = forward_backward([&g?, &u?], &dy?, |[g, u]| op(g, u))?;
    Ok(names.into_iter().zip([y, dg, du]).collect())
}
