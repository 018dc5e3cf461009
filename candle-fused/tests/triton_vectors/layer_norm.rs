//! LayerNorm (`triton/layer_norm.py`): each file `layer_norm.<dtype>.<N>x<C>-<bias|nobias>
//! .safetensors` holds `x [N, C]`, `w [C]`, `dy [N, C]` and, for `bias`, `b [C]` (inputs, in
//! the dtype), `eps [1]` (f32), and the CPU kernel's `y [N, C]`, `dx [N, C]`, `dw [C]`, `db [C]`
//! (`bias` only; the dtype) and `mean [N]`, `rstd [N]` (f32, the saved statistics, here from
//! f32 composite ops since the op keeps its own private). The sizes are not multiples of the
//! Triton block sizes (C = 129, 257, 1500 against BLOCK_C = 4096 and the reduction's 256; N =
//! 37, 70 against 32 rows per backward program, so 2 and 3 partial rows), and rows cycle
//! through magnitudes 1, 1e3, 1e-3 and a row offset by 50 with spread 1 (within f16's normal
//! range), so both statistics are exercised, the centred variance included.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_fused::norm::layer_norm;

const EPS: f64 = 1e-5;
/// `(N, C, with bias)`.
const CASES: [(usize, usize, bool); 3] = [(37, 129, true), (70, 257, false), (3, 1500, true)];
const DTYPES: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::BF16, "bf16"),
    (DType::F16, "f16"),
];

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
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let dx = g.get(xv.as_tensor()).expect("dx").clone();
    let dw = g.get(wv.as_tensor()).expect("dw").clone();
    let xf = x.to_dtype(DType::F32)?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let var = xf.broadcast_sub(&mean)?.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + EPS)?.sqrt()?.recip()?.flatten_all()?;
    let eps = Tensor::new(&[EPS as f32], &Device::Cpu)?;
    let mut t = vec![("x", x), ("w", w), ("dy", dy), ("eps", eps)];
    if bias {
        let db = g.get(bv.as_tensor()).expect("db").clone();
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

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (k, (dt, name)) in DTYPES.into_iter().enumerate() {
        for (s, (n, c, bias)) in CASES.into_iter().enumerate() {
            let t = vectors(n, c, bias, dt, 2000 + 10 * k as u64 + s as u64)?;
            let case = if bias { "bias" } else { "nobias" };
            crate::write(&dir, &format!("layer_norm.{name}.{n}x{c}-{case}"), t)?;
        }
    }
    Ok(())
}
