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
//!
//! Case `group` (the multi-tensor kernels): six tensors of odd sizes (1 to 4099 elements, not
//! multiples of the 1024-element blocks), `sizes [6]` and `decay [6]` (i64 flags, alternate
//! members decayed), the members' `param_in`, `exp_avg_in`, `exp_avg_sq_in`, `grad`
//! concatenated, `scalars` for the decayed members; the CPU's `adamw_update_multi` results
//! concatenated, and `sumsq_group [1]` (`sum_of_squares_multi`). Step 7, clipping active.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::adamw::{
    adamw_update, adamw_update_multi, clip_coefficient, global_norm, sum_of_squares,
    sum_of_squares_multi, AdamWParam, AdamWStep,
};
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

/// The group case: see the module documentation.
fn group_vectors(dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    const SIZES: [usize; 6] = [3001, 1, 1024, 2055, 5, 4099];
    let mut rng = Lcg(seed);
    let dev = &Device::Cpu;
    let mut members = Vec::new();
    for (i, &e) in SIZES.iter().enumerate() {
        let g: Vec<f64> = (0..e)
            .map(|j| rng.next() * [1e-3, 1e-2, 1e-1, 1.0, 10.0][(i + j) % 5] / 3.0)
            .collect();
        let grad = Tensor::from_vec(g, e, dev)?.to_dtype(dt)?;
        let param = common::rand(&[e], DType::F32, &mut rng, 1.0, 0.0)?;
        let exp_avg = common::rand(&[e], DType::F32, &mut rng, 0.1, 0.0)?;
        let exp_avg_sq = common::rand(&[e], DType::F32, &mut rng, 0.1, 0.0)?.sqr()?;
        members.push((param, grad, exp_avg, exp_avg_sq));
    }
    let grads: Vec<&Tensor> = members.iter().map(|m| &m.1).collect();
    let step = AdamWStep {
        lr: 3e-4,
        weight_decay: 0.1,
        step: 7,
        grad_scale: clip_coefficient(global_norm(&grads)?, 1.0),
        ..Default::default()
    };
    let sumsq = sum_of_squares_multi(&grads)?.expect("a group").reshape(1)?;
    // the update is in place: step copies
    let out: Vec<(Var, Tensor, Tensor)> = (members.iter())
        .map(|(p, _, m, v)| Ok((Var::from_tensor(&p.copy()?)?, m.copy()?, v.copy()?)))
        .collect::<Result<_>>()?;
    let group: Vec<AdamWParam> = (out.iter().zip(&members).enumerate())
        .map(|(i, ((p, m, v), src))| AdamWParam {
            param: p,
            grad: &src.1,
            exp_avg: m,
            exp_avg_sq: v,
            decay: i % 2 == 0,
        })
        .collect();
    adamw_update_multi(&group, &step)?;
    let s: Vec<f32> = scalars(&step)?
        .iter()
        .map(|s| match s {
            Scalar::F32(v) => *v,
            Scalar::I32(_) => unreachable!("the AdamW scalars are f32"),
        })
        .collect();
    let cat =
        |f: &dyn Fn(usize) -> Tensor| Tensor::cat(&(0..SIZES.len()).map(f).collect::<Vec<_>>(), 0);
    let sizes: Vec<i64> = SIZES.iter().map(|&e| e as i64).collect();
    let decay: Vec<i64> = (0..SIZES.len()).map(|i| i64::from(i % 2 == 0)).collect();
    Ok(vec![
        ("sizes", Tensor::new(sizes.as_slice(), dev)?),
        ("decay", Tensor::new(decay.as_slice(), dev)?),
        ("param_in", cat(&|i| members[i].0.clone())?),
        ("grad", cat(&|i| members[i].1.clone())?),
        ("exp_avg_in", cat(&|i| members[i].2.clone())?),
        ("exp_avg_sq_in", cat(&|i| members[i].3.clone())?),
        ("scalars", Tensor::new(s.as_slice(), dev)?),
        ("param", cat(&|i| out[i].0.as_tensor().clone())?),
        ("exp_avg", cat(&|i| out[i].1.clone())?),
        ("exp_avg_sq", cat(&|i| out[i].2.clone())?),
        ("sumsq_group", sumsq),
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
        let name = candle_fused::cuda_kernels::dtype_suffix(dt);
        let t = group_vectors(dt, 5100 + k as u64)?;
        crate::write(&dir, &format!("adamw.{name}.group"), t)?;
    }
    Ok(())
}
