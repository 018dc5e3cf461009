//! RMSNorm (`triton/rms_norm.py`): each file `rms_norm.<dtype>.<N>x<C>.safetensors` holds
//! `x [N, C]`, `w [C]`, `dy [N, C]` (inputs, in the dtype), `eps [1]` (f32), and the CPU
//! kernel's `y [N, C]`, `dx [N, C]`, `dw [C]` (the dtype) and `rstd [N]` (f32, the saved
//! statistic, here from f32 composite ops since the op keeps its own private). The sizes are not
//! multiples of the Triton block sizes (C = 129, 1500 against BLOCK_C = 4096; N = 37 against 32
//! rows per backward program), and rows cycle through magnitudes 1, 1e3 and 1e-3 (within
//! f16's normal range) so the f32 statistics are exercised.

use super::{
    forward_backward, input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, ULP16,
};
use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_fused::norm::rms_norm;
use std::path::Path;

pub(crate) const FAMILY: Family = Family::new("rms_norm", RMS_NORM, run, |_| Ok(3), write_vectors);

const EPS: f64 = 1e-5;
const SHAPES: [(usize, usize); 2] = [(37, 129), (3, 1500)];

/// `[N, C]` uniform in [-1, 1), row `r` scaled by 1, 1e3 or 1e-3 (`r % 3`), in `dt`.
fn rows_with_magnitudes(n: usize, c: usize, dt: DType, rng: &mut Lcg) -> Result<Tensor> {
    let v: Vec<f64> = (0..n * c)
        .map(|i| rng.next() * [1.0, 1e3, 1e-3][(i / c) % 3])
        .collect();
    Ok(Tensor::from_vec(v, (n, c), &Device::Cpu)?.to_dtype(dt)?)
}

fn vectors(n: usize, c: usize, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let x = rows_with_magnitudes(n, c, dt, &mut rng)?;
    let w = common::rand(&[c], dt, &mut rng, 0.5, 1.0)?;
    let dy = common::rand(&[n, c], dt, &mut rng, 1.0, 0.0)?;
    let (y, [dx, dw]) = forward_backward([&x, &w], &dy, |[x, w]| rms_norm(x, w, EPS))?;
    let xf = x.to_dtype(DType::F32)?;
    let rstd = (xf.sqr()?.mean_keepdim(D::Minus1)? + EPS)?
        .sqrt()?
        .recip()?
        .flatten_all()?;
    let eps = Tensor::new(&[EPS as f32], &Device::Cpu)?;
    Ok(vec![
        ("x", x),
        ("w", w),
        ("dy", dy),
        ("eps", eps),
        ("y", y),
        ("rstd", rstd),
        ("dx", dx),
        ("dw", dw),
    ])
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |(n, c): &(usize, usize)| format!("{n}x{c}");
    write_each(
        dir,
        "rms_norm",
        1000,
        &SHAPES,
        |_| ALL_DTYPES,
        label,
        |&(n, c), dt, seed| vectors(n, c, dt, seed),
    )
}

// rms_norm (triton/rms_norm.py TOL, ERROR): f32 y 4e-6, dx and dw 2e-5 (f32 sums in different
// orders, dx with the cancellation g - xhat mean(g xhat)); bf16 / f16: one unit in the last
// place, 2^-7 / 2^-10, relative to the row's (dw: the tensor's) largest value, since both sides
// round nearly the same f32 value once. (`rstd` stays inside the op: not compared here.)
const RMS_NORM: &[Check] = &[
    Check::new("y", Mode::Row, [4e-6, ULP16[0], ULP16[1]]),
    Check::new("dx", Mode::Row, [2e-5, ULP16[0], ULP16[1]]),
    Check::new("dw", Mode::Tensor, [2e-5, ULP16[0], ULP16[1]]),
];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let [x, w, dy] = ["x", "w", "dy"].map(|n| input(t, n, dev));
    let eps = f64::from(input(t, "eps", &Device::Cpu)?.to_vec1::<f32>()?[0]);
    let (y, [dx, dw]) = forward_backward([&x?, &w?], &dy?, |[x, w]| rms_norm(x, w, eps))?;
    Ok(vec![("y", y), ("dx", dx), ("dw", dw)])
}
