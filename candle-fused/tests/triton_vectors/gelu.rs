//! Bias + tanh GELU (`triton/gelu.py`): each file `gelu.<dtype>.<N>x<C>.safetensors` holds
//! `x [N, C]`, `b [C]`, `dy [N, C]` (inputs, in the dtype) and the CPU kernel's outputs with the
//! bias, `y`, `dx [N, C]` and `db [C]`, and without it on the same `x`, `y_nobias`,
//! `dx_nobias [N, C]` (the dtype). Sizes are not multiples of the Triton blocks (C = 129, 300
//! against 256 columns; N = 37 against 16-row programs; N x C against 1024 elements); the
//! 4097-row case (f32) is past 4096 rows, where the CPU's `db` blocks grow to 17 rows
//! (`max(16, cdiv(N, 256))`) against the Triton kernel's 16. `x` is uniform in [-4, 4) with the tails of tanh (|x| = 5.5, 10, 50) and both
//! zeros at the start.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::gelu::{bias_gelu, gelu};

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
    let (xv, bv) = (Var::from_tensor(&x)?, Var::from_tensor(&b)?);
    // d(sum(y * dy))/dy = dy exactly, so the gradients are the backward of `dy`.
    let y = bias_gelu(xv.as_tensor(), Some(bv.as_tensor()))?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let dx = g.get(xv.as_tensor()).expect("dx").clone();
    let db = g.get(bv.as_tensor()).expect("db").clone();
    let y_nobias = gelu(xv.as_tensor())?;
    let g = (&y_nobias * &dy)?.sum_all()?.backward()?;
    let dx_nobias = g.get(xv.as_tensor()).expect("dx").clone();
    Ok(vec![
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

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (s, (n, c, dtypes)) in CASES.into_iter().enumerate() {
        for (k, &dt) in dtypes.iter().enumerate() {
            let t = vectors(n, c, dt, 3000 + 10 * k as u64 + s as u64)?;
            let name = candle_fused::cuda_kernels::dtype_suffix(dt);
            crate::write(&dir, &format!("gelu.{name}.{n}x{c}"), t)?;
        }
    }
    Ok(())
}
