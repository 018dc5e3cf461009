//! RMSNorm (`triton/rms_norm.py`): each file `rms_norm.<dtype>.<N>x<C>.safetensors` holds
//! `x [N, C]`, `w [C]`, `dy [N, C]` (inputs, in the dtype), `eps [1]` (f32), and the CPU
//! kernel's `y [N, C]`, `dx [N, C]`, `dw [C]` (the dtype) and `rstd [N]` (f32, the saved
//! statistic, here from f32 composite ops since the op keeps its own private). The sizes are not
//! multiples of the Triton block sizes (C = 129, 1500 against BLOCK_C = 4096; N = 37 against 32
//! rows per backward program), and rows cycle through magnitudes 1, 1e3 and 1e-3 (within
//! f16's normal range) so the f32 statistics are exercised.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_fused::norm::rms_norm;

const EPS: f64 = 1e-5;
const SHAPES: [(usize, usize); 2] = [(37, 129), (3, 1500)];
const DTYPES: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::BF16, "bf16"),
    (DType::F16, "f16"),
];

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
    let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
    let y = rms_norm(xv.as_tensor(), wv.as_tensor(), EPS)?;
    // d(sum(y * dy))/dy = dy exactly, so the gradients are the backward of `dy`.
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let dx = g.get(xv.as_tensor()).expect("dx").clone();
    let dw = g.get(wv.as_tensor()).expect("dw").clone();
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

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (k, (dt, name)) in DTYPES.into_iter().enumerate() {
        for (s, (n, c)) in SHAPES.into_iter().enumerate() {
            let t = vectors(n, c, dt, 1000 + 10 * k as u64 + s as u64)?;
            crate::write(&dir, &format!("rms_norm.{name}.{n}x{c}"), t)?;
        }
    }
    Ok(())
}
