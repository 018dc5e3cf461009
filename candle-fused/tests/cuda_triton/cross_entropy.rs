//! `cross_entropy` and `linear_cross_entropy` cases.

use super::*;

// cross_entropy (triton/cross_entropy.py TOL, ERROR), the op `cross_entropy` on the vectors'
// logits: the loss is f32 for every dtype, its sums in other orders than the CPU's (the
// kernel's online max / sum over blocks of 4096 classes), 2e-6 elementwise; dlogits: f32 1e-6
// of the tensor's largest (exp of an lse a few ulp apart, plus ex2.approx's 3e-7 on the GPU),
// 16-bit one unit in the last place (2^-7, 2^-10) as both sides round nearly the same f32 once.
// Relative to the tensor's largest, not the row's: a row whose target takes nearly all the
// probability has entries of only coef (1 - p_t), whose error coef 2^-24 is the rounding of p_t.
pub(crate) const CROSS_ENTROPY: &[Check] = &[
    Check {
        name: "loss",
        mode: Mode::Elem,
        tol: [2e-6; 3],
    },
    Check {
        name: "dlogits",
        mode: Mode::Tensor,
        tol: [1e-6, 1.0 / 128.0, 1.0 / 1024.0],
    },
];

/// `cross_entropy`'s upstream gradient in the vectors (`G` of `tests/triton_vectors/cross_entropy.rs`).
pub(crate) const CE_G: f64 = 0.75;

pub(crate) fn cross_entropy(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let logits = Var::from_tensor(&input(t, "logits", dev)?)?;
    let targets = input(t, "targets", dev)?;
    let ignore = input(t, "ignore_index", &Device::Cpu)?.to_vec1::<u32>()?[0];
    // the vectors give `weight` = ones where the op got no mask: that case runs without one
    let weight = input(t, "weight", &Device::Cpu)?;
    let masked = weight.to_vec1::<f32>()?.iter().any(|&w| w != 1.0);
    let mask = masked.then(|| weight.to_device(dev)).transpose()?;
    let loss = candle_fused::cross_entropy::cross_entropy(
        logits.as_tensor(),
        &targets,
        mask.as_ref(),
        Some(ignore),
    )?;
    let g = loss.affine(CE_G, 0.0)?.backward()?;
    Ok(vec![("loss", loss), ("dlogits", grad(&g, &logits)?)])
}

// linear_cross_entropy (the same TOL, ERROR): the chunk loop end to end, `chunk` rows at a time
// as the vectors' CPU op ran it, cuBLAS for the GEMMs: the loss as above; dx = dl W and
// dW = Σ dlᵀ x sum in other orders than the CPU's GEMMs, with cancellation (Σ_j |dl_ij| <= 2
// coef): f32 5e-5 of the largest; 16-bit one rounding of the result plus gradients that may
// differ by a unit, 2^-6 (bf16) and 2^-9 (f16).
pub(crate) const LINEAR_CROSS_ENTROPY: &[Check] = &[
    Check {
        name: "lce_loss",
        mode: Mode::Elem,
        tol: [2e-6; 3],
    },
    Check {
        name: "dx",
        mode: Mode::Tensor,
        tol: [5e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dw",
        mode: Mode::Tensor,
        tol: [5e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
];

pub(crate) fn linear_cross_entropy(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let targets = input(t, "targets", dev)?;
    let ignore = input(t, "ignore_index", &Device::Cpu)?.to_vec1::<u32>()?[0];
    let chunk = input(t, "chunk", &Device::Cpu)?.to_vec1::<u32>()?[0] as usize;
    let loss = candle_fused::linear_cross_entropy::linear_cross_entropy_chunked(
        x.as_tensor(),
        w.as_tensor(),
        &targets,
        Some(ignore),
        chunk,
    )?;
    let g = loss.backward()?;
    Ok(vec![
        ("lce_loss", loss),
        ("dx", grad(&g, &x)?),
        ("dw", grad(&g, &w)?),
    ])
}

/// One `ce_fwd_bwd` per chunk of counted rows (the backward launches nothing: the gradients
/// come from the forward).
pub(crate) fn lce_chunks(t: &HashMap<String, Tensor>) -> Result<u64> {
    let ignore = input(t, "ignore_index", &Device::Cpu)?.to_vec1::<u32>()?[0];
    let chunk = input(t, "chunk", &Device::Cpu)?.to_vec1::<u32>()?[0] as usize;
    let targets = input(t, "targets", &Device::Cpu)?.to_vec1::<u32>()?;
    let counted = targets.iter().filter(|&&x| x != ignore).count();
    Ok(counted.div_ceil(chunk.max(1)) as u64)
}
