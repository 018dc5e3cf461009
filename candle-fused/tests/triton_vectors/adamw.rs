//! AdamW (`triton/adamw.py`): each file `adamw.<dtype>.<E>.safetensors` (dtype: the
//! gradient's) holds the inputs `param_in`, `exp_avg_in`, `exp_avg_sq_in` (f32) and `grad`,
//! `scalars [9]` (f32, from `cuda_kernels::adamw::scalars`), and the CPU's results: `param`,
//! `exp_avg`, `exp_avg_sq` after `adamw_update` (f32) and `sumsq [1]` (f32,
//! `sum_of_squares(grad)`).
//!
//! Case 3001 (not a multiple of the 1024-element blocks): step 7, weight decay, and the grad
//! scale `clip_coefficient(global_norm([grad]), 1.0)` (clipping active: the norm is ~47);
//! gradient elements cycle through magnitudes 1e-3 .. 10 so the f64 sum of squares spans them.
//! Case 5: step 1, no weight decay, no clipping (grad scale 1).

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::adamw::{adamw_update, clip_coefficient, global_norm, sum_of_squares, AdamWStep};
use candle_fused::cuda_kernels::{adamw::scalars, Scalar};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn vectors(e: usize, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let dev = &Device::Cpu;
    let g: Vec<f64> = (0..e)
        .map(|i| rng.next() * [1e-3, 1e-2, 1e-1, 1.0, 10.0][i % 5] / 3.0)
        .collect();
    let grad = Tensor::from_vec(g, e, dev)?.to_dtype(dt)?;
    let param = common::rand(&[e], DType::F32, &mut rng, 1.0, 0.0)?;
    let exp_avg = common::rand(&[e], DType::F32, &mut rng, 0.1, 0.0)?;
    let exp_avg_sq = common::rand(&[e], DType::F32, &mut rng, 0.1, 0.0)?.sqr()?;
    let step = if e > 5 {
        let norm = global_norm(&[&grad])?;
        AdamWStep {
            lr: 3e-4,
            weight_decay: 0.1,
            step: 7,
            grad_scale: clip_coefficient(norm, 1.0),
            ..Default::default()
        }
    } else {
        AdamWStep {
            weight_decay: 0.0,
            ..Default::default()
        }
    };
    let s: Vec<f32> = scalars(&step)?
        .iter()
        .map(|s| match s {
            Scalar::F32(v) => *v,
            Scalar::I32(_) => unreachable!("the AdamW scalars are f32"),
        })
        .collect();
    // the update is in place: keep the inputs
    let (p, m, v) = (param.copy()?, exp_avg.copy()?, exp_avg_sq.copy()?);
    let pv = Var::from_tensor(&p)?;
    adamw_update(&pv, &grad, &m, &v, &step)?;
    let sumsq = sum_of_squares(&grad)?.reshape(1)?;
    Ok(vec![
        ("param_in", param),
        ("exp_avg_in", exp_avg),
        ("exp_avg_sq_in", exp_avg_sq),
        ("grad", grad),
        ("scalars", Tensor::new(s.as_slice(), dev)?),
        ("param", pv.as_tensor().copy()?),
        ("exp_avg", m),
        ("exp_avg_sq", v),
        ("sumsq", sumsq),
    ])
}

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (k, dt) in DTYPES.into_iter().enumerate() {
        for (s, e) in [3001usize, 5].into_iter().enumerate() {
            let t = vectors(e, dt, 5000 + 10 * k as u64 + s as u64)?;
            let name = candle_fused::cuda_kernels::dtype_suffix(dt);
            crate::write(&dir, &format!("adamw.{name}.{e}"), t)?;
        }
    }
    Ok(())
}
