//! Bias + tanh GELU (`triton/gelu.py`): each file `gelu.<dtype>.<N>x<C>.safetensors` holds
//! `x [N, C]`, `b [C]`, `dy [N, C]` (inputs, in the dtype) and the CPU kernel's outputs with the
//! bias, `y`, `dx [N, C]` and `db [C]`, and without it on the same `x`, `y_nobias`,
//! `dx_nobias [N, C]` (the dtype), and GeGLU's on `x` as the gate with `up [N, C]`: `geglu_y`,
//! `geglu_d_gate`, `geglu_d_up` (the [`GEGLU_FAMILY`] entry checks those). Sizes are not multiples of the Triton blocks (C = 129, 300
//! against 256 columns; N = 37 against 16-row programs; N x C against 1024 elements); the
//! 4097-row case (f32) is past 4096 rows, where the CPU's `db` blocks grow to 17 rows
//! (`max(16, cdiv(N, 256))`) against the Triton kernel's 16. `x` is uniform in [-4, 4) with the tails of tanh (|x| = 5.5, 10, 50) and both
//! zeros at the start.

use super::{
    forward_backward, input, write_each, Check, Family, Mode, Outputs, Tensors, EXACT, ULP16,
};
use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::geglu::geglu;
use candle_fused::gelu::{bias_gelu, gelu};
use std::path::Path;

/// Launches: with a bias: forward, dx + db partials, db; without: forward, backward.
pub(crate) const FAMILY: Family = Family {
    // Candle's `tanh` (libm on the CPU, CUDA's `tanhf` on the GPU) against the kernels'
    // `tanh_f32` (< 1.5 ulp), through a few more roundings; bf16 / f16 one 16-bit ulp. f32,
    // relative to the row's largest value, 1e-4: its rows of 2 (the 4097 x 2 vectors) can hold
    // only values near gelu's minimum (`z ~ -0.75`, where `gelu'` cancels to 0 and `gelu` is
    // small), whose rounding differences are large against the row (measured on the CPU: 1.4e-5
    // for `dx`, 8.8e-6 for `y`; 2.2e-7 on rows of 129). `db`: the f32 sum over rows in Candle's
    // order against the kernels' blocks: 1e-5 of the largest `|db|` (f32).
    fallback: &[
        ("y", [1e-4, ULP16[0], ULP16[1]]),
        ("dx", [1e-4, ULP16[0], ULP16[1]]),
        ("db", [1e-5, ULP16[0], ULP16[1]]),
        ("y_nobias", [1e-4, ULP16[0], ULP16[1]]),
        ("dx_nobias", [1e-4, ULP16[0], ULP16[1]]),
    ],
    ..Family::new("gelu", GELU, run, |_| Ok(5), write_vectors)
};

/// GeGLU (`geglu_fwd`, `geglu_bwd`) on the gelu vectors: `x` as the gate, with `up`.
pub(crate) const GEGLU_FAMILY: Family = Family {
    name: "geglu",
    // The composite's `tanh` as for GELU (above): f32 1e-4 of the row's largest value (the
    // 4097 x 2 rows), bf16 / f16 one 16-bit ulp.
    fallback: &[
        ("geglu_y", [1e-4, ULP16[0], ULP16[1]]),
        ("geglu_d_gate", [1e-4, ULP16[0], ULP16[1]]),
        ("geglu_d_up", [1e-4, ULP16[0], ULP16[1]]),
    ],
    write_vectors: None,
    ..Family::new("gelu", GEGLU, run_geglu, |_| Ok(2), write_vectors)
};

const CASES: [(usize, usize, &[DType]); 3] = [
    (37, 129, &[DType::F32, DType::BF16, DType::F16]),
    (5, 300, &[DType::F32, DType::BF16, DType::F16]),
    (4097, 2, &[DType::F32]),
];
const TAILS: [f64; 8] = [-50.0, -10.0, -5.5, -0.0, 0.0, 5.5, 10.0, 50.0];

fn vectors(n: usize, c: usize, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let mut v: Vec<f64> = (0..n * c).map(|_| rng.next() * 4.0).collect();
    v[..TAILS.len()].copy_from_slice(&TAILS);
    let x = Tensor::from_vec(v, (n, c), &Device::Cpu)?.to_dtype(dt)?;
    let b = common::rand(&[c], dt, &mut rng, 0.5, 0.0)?;
    let dy = common::rand(&[n, c], dt, &mut rng, 1.0, 0.0)?;
    let (y, [dx, db]) = forward_backward([&x, &b], &dy, |[x, b]| bias_gelu(x, Some(b)))?;
    let (y_nobias, [dx_nobias]) = forward_backward([&x], &dy, |[x]| gelu(x))?;
    let up = common::rand(&[n, c], dt, &mut rng, 2.0, 0.0)?;
    let (geglu_y, [geglu_d_gate, geglu_d_up]) =
        forward_backward([&x, &up], &dy, |[g, u]| geglu(g, u))?;
    Ok(vec![
        ("up", up),
        ("geglu_y", geglu_y),
        ("geglu_d_gate", geglu_d_gate),
        ("geglu_d_up", geglu_d_up),
        ("x", x),
        ("b", b),
        ("dy", dy),
        ("y", y),
        ("dx", dx),
        ("db", db),
        ("y_nobias", y_nobias),
        ("dx_nobias", dx_nobias),
    ])
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |&(n, c, _): &(usize, usize, &[DType])| format!("{n}x{c}");
    write_each(
        dir,
        "gelu",
        3000,
        &CASES,
        |c| c.2,
        label,
        |&(n, c, _), dt, seed| vectors(n, c, dt, seed),
    )
}

// gelu (triton/gelu.py): y, dx with and without the bias bit-identical; db the same f32 sums
// up to 4096 rows, past that within 1e-5 of max |db| (f32: the CPU's row blocks grow), one
// rounding (2^-7 / 2^-10) for bf16 / f16.
const GELU: &[Check] = &[
    Check::new("y", Mode::Row, EXACT),
    Check::new("dx", Mode::Row, EXACT),
    Check::new("db", Mode::Tensor, [1e-5, ULP16[0], ULP16[1]]),
    Check::new("y_nobias", Mode::Row, EXACT),
    Check::new("dx_nobias", Mode::Row, EXACT),
];

// geglu (`geglu_*` of triton/gelu.py): every output bit-identical, every dtype.
const GEGLU: &[Check] = &[
    Check::new("geglu_y", Mode::Row, EXACT),
    Check::new("geglu_d_gate", Mode::Row, EXACT),
    Check::new("geglu_d_up", Mode::Row, EXACT),
];

fn run_geglu(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let names = ["geglu_y", "geglu_d_gate", "geglu_d_up"];
    super::swiglu::run_gated(dev, t, "x", names, geglu)
}

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let [x, b, dy] = ["x", "b", "dy"].map(|n| input(t, n, dev));
    let (x, dy) = (x?, dy?);
    let (y, [dx, db]) = forward_backward([&x, &b?], &dy, |[x, b]| bias_gelu(x, Some(b)))?;
    let (y_nobias, [dx_nobias]) = forward_backward([&x], &dy, |[x]| gelu(x))?;
    Ok(vec![
        ("y", y),
        ("dx", dx),
        ("db", db),
        ("y_nobias", y_nobias),
        ("dx_nobias", dx_nobias),
    ])
}
