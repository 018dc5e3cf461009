//! AdamW (`triton/adamw.py`): each file `adamw.<dtype>.<E>.safetensors` (dtype: the
//! gradient's) holds the inputs `param_in`, `exp_avg_in`, `exp_avg_sq_in` (f32) and `grad`,
//! `scalars [9]` (f32: the kernel's, see [`f32_scalars`]), and the CPU's results: `param`,
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

use super::{input, write, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, EXACT};
use crate::common::{self, Lcg};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::adamw::{
    adamw_update, adamw_update_multi, clip_coefficient, global_norm, sum_of_squares,
    sum_of_squares_multi, AdamWParam, AdamWStep,
};
use candle_fused::cuda_kernels::may_launch;
use std::path::Path;

/// Launches: the update, sum-of-squares partials and total; a group file (`sizes`): the same
/// three multi-tensor kernels, or without them (`UNPROVEN`) three per member.
pub(crate) const FAMILY: Family = Family {
    // the composite sums f32 squares in f32 (the kernels in f64): 1e-5 relative
    fallback: &[("sumsq", [1e-5; 3]), ("sumsq_group", [1e-5; 3])],
    ..Family::new("adamw", ADAMW, run, launches, write_vectors)
};

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
    let s = f32_scalars(&step)?;
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
    let s = f32_scalars(&step)?;
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

/// The kernel's nine f32 scalars for `step`, each PyTorch's AdamW constant computed in f64 and
/// rounded once: grad scale, b1, 1 - b1, b2, 1 - b2, `1 - lr wd`, `lr / bc1`, `1 / bc2`, eps
/// (the crate's own, which its launches pass, are held to the committed files by its unit test
/// `adamw_scalars_are_the_vector_files`).
fn f32_scalars(step: &AdamWStep) -> Result<Vec<f32>> {
    let (b1, b2, t) = (step.beta1, step.beta2, step.step as f64);
    ensure!(step.step > 0, "adamw: step is 1-based");
    let (bc1, bc2) = (1.0 - b1.powf(t), 1.0 - b2.powf(t));
    let decay = 1.0 - step.lr * step.weight_decay;
    let all = [step.grad_scale, b1, 1.0 - b1, b2, 1.0 - b2, decay];
    let tail = [step.lr / bc1, 1.0 / bc2, step.eps];
    Ok(all.iter().chain(&tail).map(|&v| v as f32).collect())
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |e: &usize| e.to_string();
    write_each(
        dir,
        "adamw",
        5000,
        &[3001, 5],
        |_| ALL_DTYPES,
        label,
        |&e, dt, seed| vectors(e, dt, seed),
    )?;
    for (k, &dt) in ALL_DTYPES.iter().enumerate() {
        let t = group_vectors(dt, 5100 + k as u64)?;
        write(dir, &format!("adamw.{}.group", super::dtype_name(dt)), t)?;
    }
    Ok(())
}

fn launches(t: &Tensors) -> Result<u64> {
    Ok(match t.get("sizes") {
        Some(s) if !may_launch("adamw_update_multi") => 3 * s.elem_count() as u64,
        _ => 3,
    })
}

// adamw (triton/adamw.py): the update bit-identical (the CPU's f32 operations in its order,
// sqrt and division correctly rounded); sumsq: f64 sums in two fixed orders, rounded to f32,
// within one f32 rounding (2^-23 relative); a group's total: each member's sum within 2^-23,
// their f32 sum in order (adamw.py's TOL).
const ADAMW: &[Check] = &[
    Check::new("param", Mode::Abs, EXACT),
    Check::new("exp_avg", Mode::Abs, EXACT),
    Check::new("exp_avg_sq", Mode::Abs, EXACT),
    Check::new("sumsq", Mode::Elem, [1.0 / 8_388_608.0; 3]),
    Check::new("sumsq_group", Mode::Elem, [8.0 / 8_388_608.0; 3]),
];

/// The step [`vectors`] took for a file (by its size), checked against the
/// scalars the file holds. The grad scale is the file's (it rounds back to the same f32): the
/// vectors computed it from the CPU kernel's global norm.
fn adamw_step(t: &Tensors) -> Result<AdamWStep> {
    let want = input(t, "scalars", &Device::Cpu)?.to_vec1::<f32>()?;
    let e = t.get("grad").context("no tensor \"grad\"")?.elem_count();
    let grad_scale = f64::from(want[0]);
    let step = if e > 5 {
        AdamWStep {
            lr: 3e-4,
            weight_decay: 0.1,
            step: 7,
            grad_scale,
            ..Default::default()
        }
    } else {
        AdamWStep {
            weight_decay: 0.0,
            grad_scale,
            ..Default::default()
        }
    };
    let got = f32_scalars(&step)?;
    ensure!(
        got == want,
        "adamw: step scalars {got:?}, the file's {want:?}"
    );
    Ok(step)
}

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    if t.contains_key("sizes") {
        return run_group(dev, t);
    }
    let step = adamw_step(t)?;
    // fresh copies: the update is in place (and `to_device` to the CPU shares the storage)
    let fresh = |name: &str| -> Result<Tensor> { Ok(input(t, name, dev)?.copy()?) };
    let param = Var::from_tensor(&fresh("param_in")?)?;
    let (m, v, g) = (
        fresh("exp_avg_in")?,
        fresh("exp_avg_sq_in")?,
        fresh("grad")?,
    );
    adamw_update(&param, &g, &m, &v, &step)?;
    let sumsq = sum_of_squares(&g)?.reshape(1)?;
    Ok(vec![
        ("param", param.as_tensor().clone()),
        ("exp_avg", m),
        ("exp_avg_sq", v),
        ("sumsq", sumsq),
    ])
}

/// A group file ([`group_vectors`]): its members split out of the
/// concatenated tensors into their own allocations, stepped by `adamw_update_multi` and their
/// gradients summed by `sum_of_squares_multi`; the outputs concatenated again.
fn run_group(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let step = adamw_step(t)?;
    let sizes = input(t, "sizes", &Device::Cpu)?.to_vec1::<i64>()?;
    let decay = input(t, "decay", &Device::Cpu)?.to_vec1::<i64>()?;
    let split = |name: &str| -> Result<Vec<Tensor>> {
        let all = input(t, name, dev)?;
        let mut at = 0;
        sizes
            .iter()
            .map(|&n| {
                let piece = all.narrow(0, at, n as usize)?.copy()?;
                at += n as usize;
                Ok(piece)
            })
            .collect()
    };
    let params = split("param_in")?
        .iter()
        .map(|p| Ok(Var::from_tensor(p)?))
        .collect::<Result<Vec<_>>>()?;
    let (m, v, g) = (
        split("exp_avg_in")?,
        split("exp_avg_sq_in")?,
        split("grad")?,
    );
    let group: Vec<AdamWParam> = (0..sizes.len())
        .map(|i| AdamWParam {
            param: &params[i],
            grad: &g[i],
            exp_avg: &m[i],
            exp_avg_sq: &v[i],
            decay: decay[i] != 0,
        })
        .collect();
    adamw_update_multi(&group, &step)?;
    let grads: Vec<&Tensor> = g.iter().collect();
    let sumsq = sum_of_squares_multi(&grads)?
        .context("an empty group")?
        .reshape(1)?;
    let params: Vec<Tensor> = params.iter().map(|p| p.as_tensor().clone()).collect();
    Ok(vec![
        ("param", Tensor::cat(&params, 0)?),
        ("exp_avg", Tensor::cat(&m, 0)?),
        ("exp_avg_sq", Tensor::cat(&v, 0)?),
        ("sumsq_group", sumsq),
    ])
}
