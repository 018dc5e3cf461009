//! RMSNorm and LayerNorm cases.

use super::{grad, input, Check, Mode, Outputs};
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use std::collections::HashMap;

// rms_norm (triton/rms_norm.py TOL, ERROR): f32 y 4e-6, dx and dw 2e-5 (f32 sums in different
// orders, dx with the cancellation g - xhat mean(g xhat)); bf16 / f16: one unit in the last
// place, 2^-7 / 2^-10, relative to the row's (dw: the tensor's) largest value, since both sides
// round nearly the same f32 value once. (`rstd` stays inside the op: not compared here.)
pub(crate) const RMS_NORM: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Row,
        tol: [4e-6, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dx",
        mode: Mode::Row,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dw",
        mode: Mode::Tensor,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
];

pub(crate) fn rms_norm(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let dy = input(t, "dy", dev)?;
    let eps = f64::from(input(t, "eps", &Device::Cpu)?.to_vec1::<f32>()?[0]);
    let y = candle_fused::norm::rms_norm(x.as_tensor(), w.as_tensor(), eps)?;
    // d(sum(y * dy))/dy = dy exactly: the gradients are the backward of `dy`
    let g = (&y * &dy)?.sum_all()?.backward()?;
    Ok(vec![("y", y), ("dx", grad(&g, &x)?), ("dw", grad(&g, &w)?)])
}

// layer_norm (triton/layer_norm.py TOL, ERROR): f32 y, dx, dw, db 2e-5 (f32 sums in different
// orders: a few ulp times log C; dx with the cancellation g - mean(g) - xhat mean(g xhat); y
// in the row offset by 50, where the means' last-ulp difference is amplified by |mean| / std
// ~ 87 in x - mean); bf16 / f16: one unit in the last place, 2^-7 / 2^-10, relative to the
// row's (dw, db: the tensor's) largest value. (`mean`, `rstd` stay inside the op.)
pub(crate) const LAYER_NORM: &[Check] = &[
    Check {
        name: "y",
        mode: Mode::Row,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dx",
        mode: Mode::Row,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "dw",
        mode: Mode::Tensor,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
    Check {
        name: "db",
        mode: Mode::Tensor,
        tol: [2e-5, 1.0 / 128.0, 1.0 / 1024.0],
    },
];

pub(crate) fn layer_norm(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let b = if t.contains_key("b") {
        Some(Var::from_tensor(&input(t, "b", dev)?)?)
    } else {
        None
    };
    let dy = input(t, "dy", dev)?;
    let eps = f64::from(input(t, "eps", &Device::Cpu)?.to_vec1::<f32>()?[0]);
    let y = candle_fused::norm::layer_norm(
        x.as_tensor(),
        w.as_tensor(),
        b.as_ref().map(Var::as_tensor),
        eps,
    )?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let mut out = vec![("y", y), ("dx", grad(&g, &x)?), ("dw", grad(&g, &w)?)];
    if let Some(b) = &b {
        out.push(("db", grad(&g, b)?));
    }
    Ok(out)
}
