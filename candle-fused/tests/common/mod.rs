//! Helpers shared by the integration tests (each file under `tests/` is its own crate and
//! includes this module with `mod common;`): seeded random data, element extraction, NaN-aware
//! comparisons, gradients and finite differences, and the attention tests' masks and
//! comparisons.
#![allow(dead_code)]

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
pub use test_support::compare::{self, values};
pub use test_support::grad::{self, value_and_grads, TensorFn};

// ---- seeded random data ----

/// One step of the 64-bit LCG (Knuth's MMIX constants); returns the new state.
fn lcg_step(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *state
}

/// A seeded LCG with uniform `f64` outputs (no global RNG state, reproducible).
pub struct Lcg(pub u64);

impl Lcg {
    /// Uniform in [-1, 1) (the top 53 bits of the state).
    pub fn next(&mut self) -> f64 {
        ((lcg_step(&mut self.0) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    /// Uniform in 0..n (0 for n = 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next() + 1.0) * 0.5 * n as f64) as usize % n.max(1)
    }
}

/// The same generator with 31-bit integer outputs (the top 31 bits of the state), and
/// approximately normal values built from them.
pub struct Lcg31(pub u64);

impl Lcg31 {
    /// Uniform in 0..2^31.
    pub fn next(&mut self) -> u64 {
        lcg_step(&mut self.0) >> 33
    }

    /// Uniform in 0..n (up to the modulo bias).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` values of mean 0 and standard deviation `std` (the sum of 12 uniforms, minus 6).
    pub fn normal_vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let s: f64 = (0..12)
                    .map(|_| self.next() as f64 / (1u64 << 31) as f64)
                    .sum();
                (s - 6.0) as f32 * std
            })
            .collect()
    }
}

/// The two tests of a fused op against its composite at every precision, through the test
/// file's `compare(dtype, tolerance, rng)`: `matches_composite_f64_f32` (f64 within 1e-12, then
/// f32 within 1e-5, one generator seeded 1) and `half_precision_close_to_f32` (bf16 within
/// 2e-2, then f16 within 4e-3, seeded 2).
#[allow(unused_macros)] // used by some of the test crates that include this module
macro_rules! composite_precision_tests {
    ($compare:ident) => {
        #[test]
        fn matches_composite_f64_f32() -> anyhow::Result<()> {
            let mut rng = $crate::common::Lcg(1);
            $compare(candle_core::DType::F64, 1e-12, &mut rng)?;
            $compare(candle_core::DType::F32, 1e-5, &mut rng)
        }

        #[test]
        fn half_precision_close_to_f32() -> anyhow::Result<()> {
            let mut rng = $crate::common::Lcg(2);
            $compare(candle_core::DType::BF16, 2e-2, &mut rng)?;
            $compare(candle_core::DType::F16, 4e-3, &mut rng)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use composite_precision_tests;

/// A tensor of `dt` with values uniform in [-1, 1) times `scale`, plus `shift`.
pub fn rand(shape: &[usize], dt: DType, rng: &mut Lcg, scale: f64, shift: f64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.next() * scale + shift).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dt)?)
}

/// [`rand`] from a fresh generator seeded with `seed`, values in [-1, 1) times `amp`.
pub fn rand_seeded(seed: u64, shape: &[usize], amp: f64, dt: DType) -> Result<Tensor> {
    rand(shape, dt, &mut Lcg(seed), amp, 0.0)
}

/// A tensor of `dt` with approximately normal values of standard deviation `std` (drawn in f32).
pub fn randn(shape: &[usize], dt: DType, rng: &mut Lcg31, std: f32) -> Result<Tensor> {
    let n = shape.iter().product();
    Ok(Tensor::from_vec(rng.normal_vec(n, std), shape, &Device::Cpu)?.to_dtype(dt)?)
}

/// f32 inputs of a linear layer, `x [rows, n_in]` with a NaN at a random index `idx` (not 0),
/// `w [n_in, n_out]` and `b [n_out]`, uniform in [-1, 1): `(x, idx, w, b)`.
pub fn linear_inputs_with_nan(
    rng: &mut Lcg,
    rows: usize,
    n_in: usize,
    n_out: usize,
) -> Result<(Tensor, usize, Tensor, Tensor)> {
    let mut xv = values(&rand(&[rows, n_in], DType::F32, rng, 1.0, 0.0)?);
    let idx = 1 + rng.below(rows * n_in - 1);
    xv[idx] = f64::NAN;
    let x = Tensor::from_vec(xv, (rows, n_in), &Device::Cpu)?.to_dtype(DType::F32)?;
    let w = rand(&[n_in, n_out], DType::F32, rng, 1.0, 0.0)?;
    let b = rand(&[n_out], DType::F32, rng, 1.0, 0.0)?;
    Ok((x, idx, w, b))
}

// ---- elements ----

/// All elements as f32.
pub fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// The bits of every element widened to f64.
pub fn bits(t: &Tensor) -> Vec<u64> {
    values(t).iter().map(|v| v.to_bits()).collect()
}

/// The number of NaNs.
pub fn nan_count(t: &Tensor) -> usize {
    values(t).iter().filter(|v| v.is_nan()).count()
}

/// Positions of the NaNs.
pub fn nans(t: &Tensor) -> Vec<bool> {
    values(t).iter().map(|x| x.is_nan()).collect()
}

// ---- comparisons ----

/// Max |a - b| / max(max |b|, 1e-3) <= `tol` ([`compare::diff`]: a NaN or a non-finite
/// mismatch fails). The floor: with one column, RMSNorm's dx is O(eps) and comes out of a
/// cancellation `g (1 - xhat^2)` that no f32 formula computes to more than a few digits;
/// relative to O(1) gradients it is exact.
pub fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) -> Result<()> {
    if a.dims() != b.dims() {
        bail!("{what}: shapes {:?} vs {:?}", a.dims(), b.dims())
    }
    let d = compare::diff(&values(a), &values(b)).map_err(|e| anyhow!("{what}: {e}"))?;
    let worst = d.max_abs / d.max_ref.max(1e-3);
    if worst > tol {
        bail!("{what}: max relative error {worst:e} > {tol:e} ({d})")
    }
    Ok(())
}

/// Asserts bit-identical values (NaN equal to NaN) and the same shape.
pub fn same_bits(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    let (va, vb) = (values(a), values(b));
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

// ---- gradients ----

/// `f(inputs)` and the gradients of `sum(f(inputs) * g)` for a random `g` (of the output's
/// shape and dtype, [`rand_seeded`] with seed `gseed`) with respect to every input.
pub fn grads(f: TensorFn<'_>, inputs: &[Tensor], gseed: u64) -> Result<(Tensor, Vec<Tensor>)> {
    let y = f(inputs)?;
    let probe = rand_seeded(gseed, y.dims(), 1.0, y.dtype())?;
    Ok(value_and_grads(f, inputs, &probe)?)
}

/// Asserts that the fallback path (forced on this thread) gives `f`'s value and gradients
/// ([`value_and_grads`] with `probe`), and the value for untracked inputs (which take the
/// composite directly), within `tol` ([`assert_close`]).
pub fn assert_fallback_matches(
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    probe: &Tensor,
    tol: f64,
    what: &str,
) -> Result<()> {
    let (y, g) = value_and_grads(f, inputs, probe)?;
    let (fb, plain) = with_fallback(|| (value_and_grads(f, inputs, probe), f(inputs)));
    let ((yf, gf), plain) = (fb?, plain?);
    assert_close(&yf, &y, tol, &format!("{what} y"))?;
    assert_close(&plain, &y, tol, &format!("{what} y (untracked)"))?;
    for (k, (a, b)) in gf.iter().zip(&g).enumerate() {
        assert_close(a, b, tol, &format!("{what} grad {k}"))?;
    }
    Ok(())
}

/// `f` against `reference` on `inputs`, values and gradients ([`value_and_grads`] with
/// `probe`): `f`'s keep the inputs' dtype; the reference runs in f32 for 16-bit inputs (its
/// results cast back), in the inputs' dtype otherwise; values within `vtol`, gradients within
/// `gtol` ([`assert_close`]).
pub fn assert_matches_reference(
    f: TensorFn<'_>,
    reference: TensorFn<'_>,
    inputs: &[Tensor],
    probe: &Tensor,
    (vtol, gtol): (f64, f64),
    what: &str,
) -> Result<()> {
    let dt = probe.dtype();
    let (y, g) = value_and_grads(f, inputs, probe)?;
    let (yr, gr) = if matches!(dt, DType::BF16 | DType::F16) {
        let wide = inputs
            .iter()
            .map(|t| t.to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        value_and_grads(reference, &wide, &probe.to_dtype(DType::F32)?)?
    } else {
        value_and_grads(reference, inputs, probe)?
    };
    assert_eq!(y.dtype(), dt, "{what} y");
    assert_close(&y, &yr.to_dtype(dt)?, vtol, &format!("{what} y"))?;
    for (k, (a, b)) in g.iter().zip(&gr).enumerate() {
        assert_eq!(a.dtype(), dt, "{what} grad {k}");
        assert_close(a, &b.to_dtype(dt)?, gtol, &format!("{what} grad {k}"))?;
    }
    Ok(())
}

/// Asserts that `f` returns the same result run in a pool of 1, 2 and 3 threads (compare bits,
/// e.g. with [`bits`], so that NaNs compare equal).
pub fn assert_same_on_thread_counts<R: PartialEq + Send>(
    what: &str,
    f: impl Fn() -> Result<R> + Sync,
) -> Result<()> {
    let mut runs = Vec::new();
    for n in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build()?;
        runs.push(pool.install(&f)?);
    }
    assert!(
        runs[0] == runs[1] && runs[1] == runs[2],
        "{what}: results depend on the thread count"
    );
    Ok(())
}

/// Asserts that `f`'s value and gradients ([`value_and_grads`] with `probe`) have the same bits
/// on 1, 2 and 3 threads.
pub fn assert_same_bits_on_thread_counts(
    f: &(dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Sync),
    inputs: &[Tensor],
    probe: &Tensor,
    what: &str,
) -> Result<()> {
    assert_same_on_thread_counts(what, || -> Result<Vec<Vec<u64>>> {
        let (y, g) = value_and_grads(f, inputs, probe)?;
        Ok(std::iter::once(&y).chain(&g).map(bits).collect())
    })
}

/// [`grad::check_fd`] (h = 1e-5, tolerance 1e-6 of the largest gradient magnitude, at least 1)
/// of `sum(f(inputs) * probe)` (f64, a random probe from `seed`).
pub fn check_fd(f: TensorFn<'_>, inputs: &[Tensor], seed: u64) -> Result<()> {
    let mut rng = Lcg(seed);
    let y0 = f(inputs)?;
    let probe = rand(y0.dims(), DType::F64, &mut rng, 1.0, 0.0)?;
    Ok(grad::check_fd(f, inputs, &probe, 1e-5, 1e-6)?)
}

// ---- attention ----

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

/// Runs `f` with the composite fallback forced on this thread.
pub fn with_fallback<R>(f: impl FnOnce() -> R) -> R {
    candle_fused::with_composite_fallback(f)
}

/// Runs `f`, with the composite fallback forced on this thread when `on`.
pub fn fallback_if<R>(on: bool, f: impl FnOnce() -> R) -> R {
    if on {
        with_fallback(f)
    } else {
        f()
    }
}

/// `candle_fused`'s parallel threshold (work in elements below which a kernel runs on the
/// calling thread; a unit test in its `cpu` module checks this copy): tests of the parallel
/// paths size their inputs above it.
pub const PAR_MIN_WORK: usize = 1 << 18;
