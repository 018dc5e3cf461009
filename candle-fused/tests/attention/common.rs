//! Helpers of the attention tests: seeded data, NaN-aware comparisons, gradients.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};

/// A seeded LCG (Knuth's MMIX constants).
pub struct Lcg(pub u64);

impl Lcg {
    /// Uniform in [-1, 1).
    pub fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next() + 1.0) * 0.5 * n as f64) as usize % n
    }
}

/// A random tensor (values in [-1, 1) times `amp`) of `dt`.
pub fn rand(seed: u64, shape: &[usize], amp: f64, dt: DType) -> Result<Tensor> {
    let mut rng = Lcg(seed);
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.next() * amp).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dt)?)
}

/// An additive `[tq, tk]` mask: random finite values plus `-inf` at ~20% of the entries, but
/// never at the causal diagonal `j = i + tk - tq` (so no row is fully masked).
pub fn mask(seed: u64, tq: usize, tk: usize, dt: DType) -> Result<Tensor> {
    let mut rng = Lcg(seed);
    let mut v = vec![0f64; tq * tk];
    for i in 0..tq {
        let diag = (i + tk).saturating_sub(tq).min(tk - 1);
        for j in 0..tk {
            let x = rng.next();
            v[i * tk + j] = if j != diag && rng.next() < -0.6 {
                f64::NEG_INFINITY
            } else {
                x
            };
        }
    }
    Ok(Tensor::from_vec(v, (tq, tk), &Device::Cpu)?.to_dtype(dt)?)
}

/// All elements as f64.
pub fn vals(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Positions of the NaNs.
pub fn nans(t: &Tensor) -> Result<Vec<bool>> {
    Ok(vals(t)?.iter().map(|x| x.is_nan()).collect())
}

/// Asserts `a` and `b` have the same shape, NaNs at the same places and
/// `max |a - b| <= tol * max(|b|)` over the rest (infinities must match exactly).
pub fn close(a: &Tensor, b: &Tensor, tol: f64, what: &str) -> Result<()> {
    if a.dims() != b.dims() {
        bail!("{what}: shapes {:?} vs {:?}", a.dims(), b.dims())
    }
    let (va, vb) = (vals(a)?, vals(b)?);
    let mut scale = 0f64;
    let mut err = 0f64;
    for (i, (&x, &y)) in va.iter().zip(&vb).enumerate() {
        if x.is_nan() != y.is_nan() {
            bail!("{what}: NaN mismatch at {i}: {x} vs {y}")
        }
        if x.is_infinite() || y.is_infinite() {
            if x != y {
                bail!("{what}: {x} vs {y} at {i}")
            }
            continue;
        }
        if !x.is_nan() {
            scale = scale.max(y.abs());
            err = err.max((x - y).abs());
        }
    }
    if err > tol * scale.max(1e-30) {
        bail!("{what}: max abs err {err:e} > {tol:e} * {scale:e}")
    }
    Ok(())
}

/// Asserts bit-identical values (NaN equal to NaN).
pub fn same_bits(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    let (va, vb) = (vals(a)?, vals(b)?);
    if a.dims() != b.dims() {
        bail!("{what}: shapes {:?} vs {:?}", a.dims(), b.dims())
    }
    for (i, (x, y)) in va.iter().zip(&vb).enumerate() {
        if x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()) {
            bail!("{what}: differs at {i}: {x} vs {y}")
        }
    }
    Ok(())
}

/// `f(inputs)` and the gradients of `sum(f(inputs) * g)` for a random `g` (seed `gseed`) with
/// respect to every input.
pub fn grads(
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    gseed: u64,
) -> Result<(Tensor, Vec<Tensor>)> {
    grads_g(f, inputs, &|dims, dt| rand(gseed, dims, 1.0, dt))
}

/// `f(inputs)` and the gradients of `sum(f(inputs) * g)` with `g = make_g(dims, dtype)`.
pub fn grads_g(
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    make_g: &dyn Fn(&[usize], DType) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let g = make_g(y.dims(), y.dtype())?;
    let store = y.mul(&g)?.sum_all()?.backward()?;
    let mut gs = Vec::new();
    for v in &vars {
        match store.get(v) {
            Some(t) => gs.push(t.detach()),
            None => bail!("no gradient for an input"),
        }
    }
    Ok((y.detach(), gs))
}

/// Runs `f` with the composite fallback forced on this thread.
pub fn with_fallback<R>(f: impl FnOnce() -> R) -> R {
    let prev = candle_fused::cpu::force_fallback(true);
    let r = f();
    candle_fused::cpu::force_fallback(prev);
    r
}
