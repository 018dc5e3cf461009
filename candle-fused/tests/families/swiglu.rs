//! SwiGLU (`triton/swiglu.py`): each file `swiglu.<dtype>.<shape>.safetensors` holds `gate`,
//! `up`, `dy` (inputs, in the dtype) and the CPU kernel's `y`, `d_gate`, `d_up` (the dtype).
//! The element counts (37 x 129 = 4773, 3001) are not multiples of the Triton block (1024);
//! `gate` is uniform in [-8, 8) with the sigmoid's tails and the exponential's clamp
//! (|g| = 30, 90, 104.5, 200) and both zeros at the start.

use super::{grad, input, shape_label, write_each, Check, Family, Mode, Outputs, Tensors};
use super::{ALL_DTYPES, EXACT, ULP16};
use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
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
    let (gv, uv) = (Var::from_tensor(&gate)?, Var::from_tensor(&up)?);
    let y = swiglu(gv.as_tensor(), uv.as_tensor())?;
    // d(sum(y * dy))/dy = dy exactly, so the gradients are the backward of `dy`.
    let grads = (&y * &dy)?.sum_all()?.backward()?;
    let d_gate = grads.get(gv.as_tensor()).expect("d_gate").clone();
    let d_up = grads.get(uv.as_tensor()).expect("d_up").clone();
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
