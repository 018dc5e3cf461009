//! LayerNorm (`triton/layer_norm.py`): each file `layer_norm.<dtype>.<N>x<C>-<bias|nobias>
//! .safetensors` holds `x [N, C]`, `w [C]`, `dy [N, C]` and, for `bias`, `b [C]` (inputs, in
//! the dtype), `eps [1]` (f32), and the CPU kernel's `y [N, C]`, `dx [N, C]`, `dw [C]`, `db [C]`
//! (`bias` only; the dtype) and `mean [N]`, `rstd [N]` (f32, the saved statistics, here from
//! f32 composite ops since the op keeps its own private). The sizes are not multiples of the
//! Triton block sizes (C = 129, 257, 1500 against BLOCK_C = 4096 and the reduction's 256; N =
//! 37, 70 against 32 rows per backward program, so 2 and 3 partial rows), and rows cycle
//! through magnitudes 1, 1e3, 1e-3 and a row offset by 50 with spread 1 (within f16's normal
//! range), so both statistics are exercised, the centred variance included.

use super::{
    backward_of, grad, input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, ULP16,
};
use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_fused::norm::layer_norm;
use std::path::Path;

/// Launches: forward, dx (+ partial sums), the dw reduction and, with a bias, the db one.
pub(crate) const FAMILY: Family = Family::new(
    "layer_norm",
    LAYER_NORM,
    run,
    |t| Ok(if t.contains_key("b") { 4 } else { 3 }),
    write_vectors,
);

const EPS: f64 = 1e-5;
/// `(N, C, with bias)`.
const CASES: [(usize, usize, bool); 3] = [(37, 129, true), (70, 257, false), (3, 1500, true)];

/// `[N, C]` uniform in [-1, 1), row `r` scaled by 1, 1e3 or 1e-3 or shifted by 50 (`r % 4`),
/// in `dt`.
fn rows_with_magnitudes(n: usize, c: usize, dt: DType, rng: &mut Lcg) -> Result<Tensor> {
    let v: Vec<f64> = (0..n * c)
        .map(|i| {
            let u = rng.next();
            match (i / c) % 4 {
                0 => u,
                1 => u * 1e3,
                2 => u * 1e-3,
                _ => 50.0 + u,
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, (n, c), &Device::Cpu)?.to_dtype(dt)?)
}

fn vectors(
    n: usize,
    c: usize,
    bias: bool,
    dt: DType,
    seed: u64,
) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let x = rows_with_magnitudes(n, c, dt, &mut rng)?;
    let w = common::rand(&[c], dt, &mut rng, 0.5, 1.0)?;
    let b = common::rand(&[c], dt, &mut rng, 0.5, 0.0)?;
    let dy = common::rand(&[n, c], dt, &mut rng, 1.0, 0.0)?;
    let (xv, wv, bv) = (
        Var::from_tensor(&x)?,
        Var::from_tensor(&w)?,
        Var::from_tensor(&b)?,
    );
    let y = layer_norm(
        xv.as_tensor(),
        wv.as_tensor(),
        bias.then(|| bv.as_tensor()),
        EPS,
    )?;
    // d(sum(y * dy))/dy = dy exactly, so the gradients are the backward of `dy`.
    let g = backward_of(&y, &dy)?;
    let dx = grad(&g, &xv)?;
    let dw = grad(&g, &wv)?;
    let xf = x.to_dtype(DType::F32)?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let var = xf.broadcast_sub(&mean)?.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + EPS)?.sqrt()?.recip()?.flatten_all()?;
    let eps = Tensor::new(&[EPS as f32], &Device::Cpu)?;
    let mut t = vec![("x", x), ("w", w), ("dy", dy), ("eps", eps)];
    if bias {
        let db = grad(&g, &bv)?;
        t.extend([("b", b), ("db", db)]);
    }
    t.extend([
        ("y", y),
        ("mean", mean.flatten_all()?),
        ("rstd", rstd),
        ("dx", dx),
        ("dw", dw),
    ]);
    Ok(t)
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |&(n, c, bias): &(usize, usize, bool)| {
        format!("{n}x{c}-{}", if bias { "bias" } else { "nobias" })
    };
    write_each(
        dir,
        "layer_norm",
        2000,
        &CASES,
        |_| ALL_DTYPES,
        label,
        |&(n, c, bias), dt, seed| vectors(n, c, bias, dt, seed),
    )
}

// layer_norm (triton/layer_norm.py TOL, ERROR): f32 y, dx, dw, db 2e-5 (f32 sums in different
// orders: a few ulp times log C; dx with the cancellation g - mean(g) - xhat mean(g xhat); y
// in the row offset by 50, where the means' last-ulp difference is amplified by |mean| / std
// ~ 87 in x - mean); bf16 / f16: one unit in the last place, 2^-7 / 2^-10, relative to the
// row's (dw, db: the tensor's) largest value. (`mean`, `rstd` stay inside the op.)
const LAYER_NORM: &[Check] = &[
    Check::new("y", Mode::Row, [2e-5, ULP16[0], ULP16[1]]),
    Check::new("dx", Mode::Row, [2e-5, ULP16[0], ULP16[1]]),
    Check::new("dw", Mode::Tensor, [2e-5, ULP16[0], ULP16[1]]),
    Check::new("db", Mode::Tensor, [2e-5, ULP16[0], ULP16[1]]),
];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let b = if t.contains_key("b") {
        Some(Var::from_tensor(&input(t, "b", dev)?)?)
    } else {
        None
    };
    let dy = input(t, "dy", dev)?;
    let eps = f64::from(input(t, "eps", &Device::Cpu)?.to_vec1::<f32>()?[0]);
    let y = layer_norm(
        x.as_tensor(),
        w.as_tensor(),
        b.as_ref().map(Var::as_tensor),
        eps,
    )?;
    let g = backward_of(&y, &dy)?;
    let mut out = vec![("y", y), ("dx", grad(&g, &x)?), ("dw", grad(&g, &w)?)];
    if let Some(b) = &b {
        out.push(("db", grad(&g, b)?));
    }
    Ok(out)
}
