//! RoPE (`triton/rope.py`): each file `rope.<dtype>.<B>x<T>x<H>x<D>-<tables>.safetensors`
//! holds `x [B, T, H, D]` and `dy [B, H, T, D]` (inputs, in the dtype), `cos`, `sin` (f32
//! tables from `rope_tables`: `[B, T, D/2]` for `batch`, each batch row its own positions;
//! `[T, D/2]` for `shared`), and the CPU kernel's `y [B, H, T, D]` and `dx [B, T, H, D]` (the
//! dtype; dx the backward of `sum(y * dy)`). Odd T and H, head dims that are not powers of two
//! (6, 10, 160), and one case whose `H * D/2 = 1040` pairs per position span three of the
//! kernel's blocks of 512 (the last one masked). Positions reach a few thousand and the
//! frequencies are Llama's (`theta = 10000`), so the angles cover many turns.

use super::{
    forward_backward, input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, EXACT,
};
use crate::common::Lcg;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::rope::{rope, rope_tables};
use std::path::Path;

pub(crate) const FAMILY: Family = Family::new("rope", ROPE, run, |_| Ok(2), write_vectors);

/// `(B, T, H, D, tables per batch row)`.
const CASES: [(usize, usize, usize, usize, bool); 3] = [
    (2, 7, 3, 10, true),
    (3, 5, 5, 6, false),
    (1, 3, 13, 160, true),
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
    let (y, [dx]) = forward_backward([&x], &dy, |[x]| rope(x, &cos, &sin))?;
    Ok(vec![
        ("x", x),
        ("dy", dy),
        ("cos", cos),
        ("sin", sin),
        ("y", y),
        ("dx", dx),
    ])
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |&(b, t, h, d, per_batch): &(usize, usize, usize, usize, bool)| {
        let tables = if per_batch { "batch" } else { "shared" };
        format!("{b}x{t}x{h}x{d}-{tables}")
    };
    write_each(
        dir,
        "rope",
        3000,
        &CASES,
        |_| ALL_DTYPES,
        label,
        |&case, dt, seed| vectors(case, dt, seed),
    )
}

// rope (triton/rope.py TOL, ERROR): exact, every dtype: each output is one rounding of
// `a * c -/+ b * s` computed in f32 with the same operations in the same order on both sides
// (two products, one add or subtract, no FMA: the cubins are compiled without contraction).
// The composite fallback on CUDA (separate mul, neg, add kernels) computes the same roundings.
const ROPE: &[Check] = &[
    Check::new("y", Mode::Exact, EXACT),
    Check::new("dx", Mode::Exact, EXACT),
];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    // `[B, T, D/2]` (each batch row its own positions) or `[T, D/2]` (shared by the batch)
    let [x, cos, sin, dy] = ["x", "cos", "sin", "dy"].map(|n| input(t, n, dev));
    let (cos, sin) = (cos?, sin?);
    let (y, [dx]) = forward_backward([&x?], &dy?, |[x]| rope(x, &cos, &sin))?;
    Ok(vec![("y", y), ("dx", dx)])
}
