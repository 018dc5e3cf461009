//! Cross-entropy (`triton/cross_entropy.py`): each file
//! `cross_entropy.<dtype>.<N>x<C>x<V>.safetensors` is one case of the fused linear
//! cross-entropy, from the CPU ops:
//!
//! * inputs: `x [N, C]`, `w [V, C]` (the dtype), `targets [N]` (u32, ignored rows included),
//!   `ignore_index [1]` (u32: 4294967196, HF's -100), `weight [N]` (f32: the mask given to
//!   `cross_entropy`, or ones where it is given none), `chunk [1]` (u32, rows per chunk of
//!   `linear_cross_entropy_chunked`);
//! * the kernels' inputs: `logits [N, V]` = `x Wᵀ` as cuBLAS (and the CPU op's GEMM) computes
//!   them: f32 products and sums, rounded once to the dtype; `scale [1]` (f32) = g / count of
//!   `cross_entropy` for the upstream gradient g = 0.75 (the CPU's own rounding: count in f32,
//!   the quotient in f64, then f32); `lce_scale [1]` (f32) = 1 / #counted rows;
//! * the CPU `cross_entropy(logits, targets, mask, ignore_index)`: `loss []` (f32) and, from its
//!   backward for g, `dlogits [N, V]` (the dtype); its per-row `lse` and `nll = lse - l_t`
//!   (`[N]` f32, 0 for skipped rows) are private to the op, so they are computed here in f64
//!   from the same logits and rounded to f32;
//! * the CPU `linear_cross_entropy_chunked(x, w, targets, ignore_index, chunk)`: `lce_loss []`
//!   (f32) and, for an upstream gradient of 1, `dx [N, C]`, `dw [V, C]` (the dtype): what the
//!   GPU's chunk loop must give.
//!
//! Sizes against the kernels' block of 4096 classes: V = 777 (one partial block) and V = 8311
//! (two full blocks and 119 classes, with targets at 4095, 4096 and V - 1). Rows cycle through
//! kinds: ordinary logits, logits peaked at the target, all logits shifted by +100 (the max
//! must be subtracted), nearly flat logits around -5, and ignored rows (one of them NaN: it must
//! not be read); a mask with fractional weights and a zero on a counted row in the first case.

use super::{grad, input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, ULP16};
use crate::common::Lcg;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::cross_entropy::cross_entropy;
use candle_fused::linear_cross_entropy::linear_cross_entropy_chunked;
use std::path::Path;

/// `cross_entropy` on the vectors' logits; it writes the family's vectors.
pub(crate) const FAMILY: Family = Family::new(
    "cross_entropy",
    CROSS_ENTROPY,
    run,
    |_| Ok(2),
    write_vectors,
);

/// `linear_cross_entropy_chunked` on the same vectors' `x` and `w`.
pub(crate) const LINEAR_FAMILY: Family = Family {
    name: "linear_cross_entropy",
    // Candle's f16 matmul on the CPU (the gemm crate) rounds its f32 partial sums to f16
    // between blocks of the summed dimension (dx = G W sums V = 777 and 8311 classes);
    // cuBLAS, on the path this stands for, rounds once
    cpu_composite: [1.0, 1.0, 4.0],
    write_vectors: None,
    ..Family::new(
        "cross_entropy",
        LINEAR_CROSS_ENTROPY,
        run_linear,
        lce_chunks,
        write_vectors,
    )
};

/// HF's -100 as a u32.
const IGNORE: u32 = (-100i32) as u32;
/// The upstream gradient of `cross_entropy`'s loss.
const G: f64 = 0.75;

/// One case: sizes, rows per chunk, whether `cross_entropy` gets a mask, and fixed targets.
struct Case {
    n: usize,
    c: usize,
    v: usize,
    chunk: usize,
    masked: bool,
    /// `(row, target)` set after the random ones.
    fixed: &'static [(usize, u32)],
}

const CASES: [Case; 2] = [
    Case {
        n: 21,
        c: 16,
        v: 777,
        chunk: 8,
        masked: true,
        fixed: &[(0, 776)],
    },
    Case {
        n: 5,
        c: 4,
        v: 8311,
        chunk: 2,
        masked: false,
        fixed: &[(0, 4095), (1, 8310), (3, 4096), (4, 0)],
    },
];

/// Row `i`'s kind: 0 ordinary, 1 peaked at the target, 2 shifted by +100, 3 flat around -5,
/// 4 ignored (and all NaN for the second ignored row).
fn kind(case: &Case, i: usize) -> usize {
    if case.n == 5 {
        [0, 1, 4, 2, 3][i]
    } else {
        i % 5
    }
}

/// `(x [N, C], w [V, C], targets)` in f32 on the host: column 0 of `w` is 1, so `x[i, 0]`
/// shifts every logit of row `i`.
fn inputs(case: &Case, rng: &mut Lcg) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let (n, c, v) = (case.n, case.c, case.v);
    let mut w: Vec<f32> = (0..v * c).map(|_| rng.next() as f32).collect();
    for j in 0..v {
        w[j * c] = 1.0;
    }
    let mut targets: Vec<u32> = (0..n).map(|_| rng.below(v) as u32).collect();
    for &(i, t) in case.fixed {
        targets[i] = t;
    }
    let mut x = vec![0f32; n * c];
    let mut ignored = 0;
    for i in 0..n {
        let row = &mut x[i * c..(i + 1) * c];
        let t = targets[i] as usize;
        let (shift, amp) = match kind(case, i) {
            0 => (0.0, 3.0),
            1 => (0.0, 0.0),
            2 => (100.0, 2.0),
            3 => (-5.0, 0.01),
            _ => (0.0, 3.0),
        };
        for (k, e) in row.iter_mut().enumerate() {
            *e = if kind(case, i) == 1 {
                // along the target's own weights: l_t = 8 |w_t|^2 stands out
                8.0 * w[t * c + k]
            } else {
                (rng.next() * amp) as f32
            };
        }
        if kind(case, i) != 1 {
            row[0] = shift;
        }
        if kind(case, i) == 4 {
            targets[i] = IGNORE;
            ignored += 1;
            if ignored == 2 {
                row.fill(f32::NAN);
            }
        }
    }
    (x, w, targets)
}

/// `(lse, nll)` of each row in f64 from the logits as stored (0, 0 for a skipped row), as f32.
fn row_stats(logits: &Tensor, targets: &[u32], counted: &[bool]) -> Result<(Tensor, Tensor)> {
    let l = logits.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    let (mut lse, mut nll) = (vec![0f32; l.len()], vec![0f32; l.len()]);
    for (i, row) in l.iter().enumerate() {
        if !counted[i] {
            continue;
        }
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s = m + row.iter().map(|e| (e - m).exp()).sum::<f64>().ln();
        lse[i] = s as f32;
        nll[i] = (s - row[targets[i] as usize]) as f32;
    }
    let dev = &Device::Cpu;
    Ok((
        Tensor::from_vec(lse, l.len(), dev)?,
        Tensor::from_vec(nll, l.len(), dev)?,
    ))
}

fn vectors(case: &Case, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let dev = &Device::Cpu;
    let (n, c, v) = (case.n, case.c, case.v);
    let mut rng = Lcg(seed);
    let (xh, wh, th) = inputs(case, &mut rng);
    let x = Tensor::from_vec(xh, (n, c), dev)?.to_dtype(dt)?;
    let w = Tensor::from_vec(wh, (v, c), dev)?.to_dtype(dt)?;
    let targets = Tensor::from_vec(th.clone(), n, dev)?;
    let weight: Vec<f32> = (0..n)
        .map(|i| match (case.masked, i % 7) {
            (false, _) => 1.0,
            (true, 6) => 0.0,
            (true, _) => (1.0 + 0.5 * rng.next()) as f32,
        })
        .collect();
    let counted: Vec<bool> = (0..n)
        .map(|i| th[i] != IGNORE && weight[i] != 0.0)
        .collect();
    let weight = Tensor::from_vec(weight, n, dev)?;

    // The logits as cuBLAS computes them for the chunk loop: f32 products and sums, one rounding.
    let logits = x
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?
        .to_dtype(dt)?;
    let lv = Var::from_tensor(&logits)?;
    let mask = case.masked.then_some(&weight);
    let loss = cross_entropy(lv.as_tensor(), &targets, mask, Some(IGNORE))?;
    let dlogits = grad(&loss.affine(G, 0.0)?.backward()?, &lv)?;
    // The op's scale, rounded as it rounds it: count in f32, g / count in f64, then f32.
    let wsum: f64 = weight
        .to_vec1::<f32>()?
        .iter()
        .zip(&counted)
        .filter(|(_, &k)| k)
        .map(|(&w, _)| w as f64)
        .sum();
    let count = wsum.max(1.0) as f32 as f64;
    let scale = Tensor::new(&[(G / count) as f32], dev)?;
    let (lse, nll) = row_stats(&logits, &th, &counted)?;

    let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
    let lce = linear_cross_entropy_chunked(
        xv.as_tensor(),
        wv.as_tensor(),
        &targets,
        Some(IGNORE),
        case.chunk,
    )?;
    let grads = lce.backward()?;
    let dx = grad(&grads, &xv)?;
    let dw = grad(&grads, &wv)?;
    let lce_count = th.iter().filter(|&&t| t != IGNORE).count().max(1);
    let lce_scale = Tensor::new(&[(1.0 / lce_count as f64) as f32], dev)?;

    Ok(vec![
        ("x", x),
        ("w", w),
        ("targets", targets),
        ("ignore_index", Tensor::new(&[IGNORE], dev)?),
        ("weight", weight),
        ("chunk", Tensor::new(&[case.chunk as u32], dev)?),
        ("logits", logits),
        ("scale", scale),
        ("lce_scale", lce_scale),
        ("loss", loss),
        ("dlogits", dlogits),
        ("lse", lse),
        ("nll", nll),
        ("lce_loss", lce),
        ("dx", dx),
        ("dw", dw),
    ])
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |c: &Case| format!("{}x{}x{}", c.n, c.c, c.v);
    write_each(
        dir,
        "cross_entropy",
        2300,
        &CASES,
        |_| ALL_DTYPES,
        label,
        vectors,
    )
}

// cross_entropy (triton/cross_entropy.py TOL, ERROR), the op `cross_entropy` on the vectors'
// logits: the loss is f32 for every dtype, its sums in other orders than the CPU's (the
// kernel's online max / sum over blocks of 4096 classes), 2e-6 elementwise; dlogits: f32 1e-6
// of the tensor's largest (exp of an lse a few ulp apart, plus ex2.approx's 3e-7 on the GPU),
// 16-bit one unit in the last place (2^-7, 2^-10) as both sides round nearly the same f32 once.
// Relative to the tensor's largest, not the row's: a row whose target takes nearly all the
// probability has entries of only coef (1 - p_t), whose error coef 2^-24 is the rounding of p_t.
const CROSS_ENTROPY: &[Check] = &[
    Check::new("loss", Mode::Elem, [2e-6; 3]),
    Check::new("dlogits", Mode::Tensor, [1e-6, ULP16[0], ULP16[1]]),
];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let logits = Var::from_tensor(&input(t, "logits", dev)?)?;
    let targets = input(t, "targets", dev)?;
    let ignore = input(t, "ignore_index", &Device::Cpu)?.to_vec1::<u32>()?[0];
    // the vectors give `weight` = ones where the op got no mask: that case runs without one
    let weight = input(t, "weight", &Device::Cpu)?;
    let masked = weight.to_vec1::<f32>()?.iter().any(|&w| w != 1.0);
    let mask = masked.then(|| weight.to_device(dev)).transpose()?;
    let loss = cross_entropy(logits.as_tensor(), &targets, mask.as_ref(), Some(ignore))?;
    let g = loss.affine(G, 0.0)?.backward()?;
    Ok(vec![("loss", loss), ("dlogits", grad(&g, &logits)?)])
}

// linear_cross_entropy (the same TOL, ERROR): the chunk loop end to end, `chunk` rows at a time
// as the vectors' CPU op ran it, cuBLAS for the GEMMs: the loss as above; dx = dl W and
// dW = Σ dlᵀ x sum in other orders than the CPU's GEMMs, with cancellation (Σ_j |dl_ij| <= 2
// coef): f32 5e-5 of the largest; 16-bit one rounding of the result plus gradients that may
// differ by a unit, 2^-6 (bf16) and 2^-9 (f16).
const LINEAR_CROSS_ENTROPY: &[Check] = &[
    Check::new("lce_loss", Mode::Elem, [2e-6; 3]),
    Check::new("dx", Mode::Tensor, [5e-5, 1.0 / 64.0, 1.0 / 512.0]),
    Check::new("dw", Mode::Tensor, [5e-5, 1.0 / 64.0, 1.0 / 512.0]),
];

fn run_linear(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let x = Var::from_tensor(&input(t, "x", dev)?)?;
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let targets = input(t, "targets", dev)?;
    let ignore = input(t, "ignore_index", &Device::Cpu)?.to_vec1::<u32>()?[0];
    let chunk = input(t, "chunk", &Device::Cpu)?.to_vec1::<u32>()?[0] as usize;
    let loss =
        linear_cross_entropy_chunked(x.as_tensor(), w.as_tensor(), &targets, Some(ignore), chunk)?;
    let g = loss.backward()?;
    Ok(vec![
        ("lce_loss", loss),
        ("dx", grad(&g, &x)?),
        ("dw", grad(&g, &w)?),
    ])
}

/// One `ce_fwd_bwd` per chunk of counted rows (the backward launches nothing: the gradients
/// come from the forward).
fn lce_chunks(t: &Tensors) -> Result<u64> {
    let ignore = input(t, "ignore_index", &Device::Cpu)?.to_vec1::<u32>()?[0];
    let chunk = input(t, "chunk", &Device::Cpu)?.to_vec1::<u32>()?[0] as usize;
    let targets = input(t, "targets", &Device::Cpu)?.to_vec1::<u32>()?;
    let counted = targets.iter().filter(|&&x| x != ignore).count();
    Ok(counted.div_ceil(chunk.max(1)) as u64)
}
