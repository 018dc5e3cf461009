//! RoPE cases.

use super::{grad, input, Check, Mode, Outputs};
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use std::collections::HashMap;

// rope (triton/rope.py TOL, ERROR): exact, every dtype: each output is one rounding of
// `a * c -/+ b * s` computed in f32 with the same operations in the same order on both sides
// (two products, one add or subtract, no FMA: the cubins are compiled without contraction).
// The composite fallback on CUDA (separate mul, neg, add kernels) computes the same roundings.
pub(crate) const ROPE: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Exact,
        tol: [0.0; 3],
    },
    Check {
        name: "dx",
        mode: Mode::Exact,
        tol: [0.0; 3],
    },
];

pub(crate) fn rope(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    // `[B, T, D/2]` (each batch row its own positions) or `[T, D/2]` (shared by the batch)
    let (cos, sin) = (input(t, "cos", dev)?, input(t, "sin", dev)?);
    let dy = input(t, "dy", dev)?;
    let y = candle_fused::rope::rope(x.as_tensor(), &cos, &sin)?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    Ok(vec![("y", y), ("dx", grad(&g, &x)?)])
}
