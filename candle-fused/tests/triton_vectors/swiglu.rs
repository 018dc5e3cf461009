//! SwiGLU (`triton/swiglu.py`): each file `swiglu.<dtype>.<shape>.safetensors` holds `gate`,
//! `up`, `dy` (inputs, in the dtype) and the CPU kernel's `y`, `d_gate`, `d_up` (the dtype).
//! The element counts (37 x 129 = 4773, 3001) are not multiples of the Triton block (1024);
//! `gate` is uniform in [-8, 8) with the sigmoid's tails and the exponential's clamp
//! (|g| = 30, 90, 104.5, 200) and both zeros at the start.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::swiglu::swiglu;

const SHAPES: [&[usize]; 2] = [&[37, 129], &[3001]];
const DTYPES: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::BF16, "bf16"),
    (DType::F16, "f16"),
];
const TAILS: [f64; 10] = [
    -200.0, -104.5, -90.0, -30.0, -0.0, 0.0, 30.0, 90.0, 104.5, 200.0,
];

fn vectors(shape: &[usize], dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let n: usize = shape.iter().product();
    let mut g: Vec<f64> = (0..n).map(|_| rng.next() * 8.0).collect();
    g[..TAILS.len()].copy_from_slice(&TAILS);
    let gate = Tensor::from_vec(g, shape, &Device::Cpu)?.to_dtype(dt)?;
    let up = common::rand(shape, dt, &mut rng, 2.0, 0.0)?;
    let dy = common::rand(shape, dt, &mut rng, 1.0, 0.0)?;
    let (gv, uv) = (Var::from_tensor(&gate)?, Var::from_tensor(&up)?);
    let y = swiglu(gv.as_tensor(), uv.as_tensor())?;
    // d(sum(y * dy))/dy = dy exactly, so the gradients are the backward of `dy`.
    let grads = (&y * &dy)?.sum_all()?.backward()?;
    let d_gate = grads.get(gv.as_tensor()).expect("d_gate").clone();
    let d_up = grads.get(uv.as_tensor()).expect("d_up").clone();
    Ok(vec![
        ("gate", gate),
        ("up", up),
        ("dy", dy),
        ("y", y),
        ("d_gate", d_gate),
        ("d_up", d_up),
    ])
}

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (k, (dt, name)) in DTYPES.into_iter().enumerate() {
        for (s, shape) in SHAPES.into_iter().enumerate() {
            let t = vectors(shape, dt, 2000 + 10 * k as u64 + s as u64)?;
            let case = shape.iter().map(|d| d.to_string()).collect::<Vec<_>>();
            crate::write(&dir, &format!("swiglu.{name}.{}", case.join("x")), t)?;
        }
    }
    Ok(())
}
