//! RoPE (`triton/rope.py`): each file `rope.<dtype>.<B>x<T>x<H>x<D>-<tables>.safetensors`
//! holds `x [B, T, H, D]` and `dy [B, H, T, D]` (inputs, in the dtype), `cos`, `sin` (f32
//! tables from `rope_tables`: `[B, T, D/2]` for `batch`, each batch row its own positions;
//! `[T, D/2]` for `shared`), and the CPU kernel's `y [B, H, T, D]` and `dx [B, T, H, D]` (the
//! dtype; dx the backward of `sum(y * dy)`). Odd T and H, head dims that are not powers of two
//! (6, 10, 160), and one case whose `H * D/2 = 1040` pairs per position span three of the
//! kernel's blocks of 512 (the last one masked). Positions reach a few thousand and the
//! frequencies are Llama's (`theta = 10000`), so the angles cover many turns.

use crate::common::Lcg;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::rope::{rope, rope_tables};

/// `(B, T, H, D, tables per batch row)`.
const CASES: [(usize, usize, usize, usize, bool); 3] = [
    (2, 7, 3, 10, true),
    (3, 5, 5, 6, false),
    (1, 3, 13, 160, true),
];
const DTYPES: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::BF16, "bf16"),
    (DType::F16, "f16"),
];

fn uniform(shape: &[usize], dt: DType, rng: &mut Lcg) -> Result<Tensor> {
    let v: Vec<f64> = (0..shape.iter().product()).map(|_| rng.next()).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dt)?)
}

fn vectors(
    (b, t, h, d, per_batch): (usize, usize, usize, usize, bool),
    dt: DType,
    seed: u64,
) -> Result<Vec<(&'static str, Tensor)>> {
    let dev = Device::Cpu;
    let mut rng = Lcg(seed);
    let x = uniform(&[b, t, h, d], dt, &mut rng)?;
    let dy = uniform(&[b, h, t, d], dt, &mut rng)?;
    let half = d / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64) as f32)
        .collect();
    let inv_freq = Tensor::new(inv_freq, &dev)?;
    // batch row r starts at position 1000 r + 17 (shared tables: at 3000)
    let pos = if per_batch {
        let p: Vec<u32> = (0..b * t)
            .map(|k| (1000 * (k / t) + 17 + k % t) as u32)
            .collect();
        Tensor::from_vec(p, (b, t), &dev)?
    } else {
        Tensor::arange(3000u32, 3000 + t as u32, &dev)?
    };
    let (cos, sin) = rope_tables(&pos, &inv_freq)?;
    let xv = Var::from_tensor(&x)?;
    let y = rope(xv.as_tensor(), &cos, &sin)?;
    // d(sum(y * dy))/dy = dy exactly, so dx is the backward of `dy`.
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let dx = g.get(xv.as_tensor()).expect("dx").clone();
    Ok(vec![
        ("x", x),
        ("dy", dy),
        ("cos", cos),
        ("sin", sin),
        ("y", y),
        ("dx", dx),
    ])
}

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (k, (dt, name)) in DTYPES.into_iter().enumerate() {
        for (s, case) in CASES.into_iter().enumerate() {
            let t = vectors(case, dt, 3000 + 10 * k as u64 + s as u64)?;
            let (b, tt, h, d, per_batch) = case;
            let tables = if per_batch { "batch" } else { "shared" };
            crate::write(&dir, &format!("rope.{name}.{b}x{tt}x{h}x{d}-{tables}"), t)?;
        }
    }
    Ok(())
}
