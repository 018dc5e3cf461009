//! Fused in-place AdamW and the global gradient norm with one host sync.
//!
//! [`adamw_update`] follows PyTorch's `torch.optim.AdamW` (decoupled weight decay, bias
//! correction) and updates the parameter and both moments **in place**, through Candle's
//! in-place custom ops: on the CPU one step allocates nothing (when the gradient is
//! contiguous) and makes three passes over memory:
//!
//! 1. `exp_avg    <- b1 m + (1 - b1) g'`            (reads g, m; writes m)
//! 2. `exp_avg_sq <- b2 v + (1 - b2) g'^2`          (reads g, v; writes v)
//! 3. `param      <- p (1 - lr wd) - (lr / bc1) m / (sqrt(v / bc2) + eps)` (reads m, v, p)
//!
//! with `g' = grad_scale * g`, `bc1 = 1 - b1^step`, `bc2 = 1 - b2^step`. A single pass would
//! need one op writing three tensors; Candle's in-place ops (`inplace_op2/3`) lock and write
//! exactly one destination, and writing through the read guard of a source would be unsound,
//! so three passes (9 streams of memory traffic instead of 7) is the least that stays sound.
//!
//! Every pass computes in f32 with the same operations, in the same order, as the composite
//! [`adamw_composite`] (Candle's `affine` and binary ops), so on the CPU the two agree to the
//! last bit in practice; the tests allow f32 rounding (~1e-6 relative). The kernels run in
//! parallel chunks for large tensors; every element is computed independently, so the result
//! is the same for any thread count.
//!
//! A NaN (or infinity) in the gradient poisons exactly its own element: `exp_avg`,
//! `exp_avg_sq` and the parameter become NaN at that index and nowhere else. Check
//! [`global_norm`] for finiteness before stepping to skip such steps (as a loss scaler does).
//!
//! On CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`; an f32, bf16 or f16
//! gradient, 16-byte aligned state), the step is one in-place kernel over all four tensors and
//! [`sum_of_squares`] two small kernels with an f64 sum (`adamw/cuda.rs`), the same bits as the
//! CPU for the step. Otherwise (Metal, or CUDA with Triton off) the step computes
//! [`adamw_composite`] with Candle ops (temporaries of the parameter's size) and writes the
//! results back with `Var::set` and `Tensor::slice_set`, which keep the tensors' storages (so
//! other handles to them see the update).
//!
//! [`adamw_update_multi`] and [`sum_of_squares_multi`] take a whole group of parameters per
//! call, with the bits of the per-tensor functions (`adamw/multi.rs`); on CUDA with the Triton
//! kernels that is one update launch per 64 parameters of a gradient dtype and two launches for
//! the group's sum of squares, instead of one and three per parameter.

#[cfg(feature = "cuda")]
mod cuda;
mod kernel;
mod multi;

pub use multi::{adamw_update_multi, sum_of_squares_multi, sum_of_squares_multi_composite};

use crate::cpu;
use crate::cuda_kernels::{self, triton_flat};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp2, InplaceOp3, Layout, Result, Tensor, Var};
use kernel::{dst_f32, moment, sumsq, Coeffs, CHUNK};

/// One AdamW step's hyper-parameters (PyTorch's names and defaults, see [`Default`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Decay of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator (>= 0).
    pub eps: f64,
    /// Decoupled weight decay (>= 0): the parameter is multiplied by `1 - lr * weight_decay`.
    pub weight_decay: f64,
    /// The step number, 1-based, for bias correction.
    pub step: usize,
    /// Multiplies the gradient first: clip coefficient and/or inverse loss scale (1 for none).
    pub grad_scale: f64,
}

impl Default for AdamWStep {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2; step 1,
    /// grad scale 1.
    fn default() -> Self {
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            step: 1,
            grad_scale: 1.0,
        }
    }
}

/// The f64 constants of a step (shared by the kernel and the composite).
struct Consts {
    decay: f64,
    step_size: f64,
    bc2: f64,
}

impl AdamWStep {
    fn check(&self) -> Result<Consts> {
        let s = self;
        if s.step == 0 {
            candle_core::bail!("candle-fused adamw: step is 1-based, got 0")
        }
        if !(0.0..1.0).contains(&s.beta1) || !(0.0..1.0).contains(&s.beta2) {
            candle_core::bail!(
                "candle-fused adamw: betas must be in [0, 1), got ({}, {})",
                s.beta1,
                s.beta2
            )
        }
        // Also rejects NaN (not >= 0).
        let nonneg = |x: f64| x >= 0.0;
        if !(nonneg(s.lr) && nonneg(s.eps) && nonneg(s.weight_decay)) {
            candle_core::bail!(
                "candle-fused adamw: lr, eps and weight_decay must be >= 0, got {}, {}, {}",
                s.lr,
                s.eps,
                s.weight_decay
            )
        }
        let bc1 = 1.0 - s.beta1.powf(s.step as f64);
        let bc2 = 1.0 - s.beta2.powf(s.step as f64);
        Ok(Consts {
            decay: 1.0 - s.lr * s.weight_decay,
            step_size: s.lr / bc1,
            bc2,
        })
    }

    /// The f32 constants the in-place kernel applies to every element, rounded as here (for a
    /// device kernel, `cuda_kernels::adamw::scalars`): grad scale, b1, 1 - b1, b2, 1 - b2,
    /// `1 - lr wd`, `lr / bc1`, `1 / bc2`, eps.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA launcher
    pub(crate) fn kernel_scalars(&self) -> Result<[f32; 9]> {
        let c = self.coeffs(&self.check()?);
        Ok([
            c.gs,
            c.b1,
            c.one_m_b1,
            c.b2,
            c.one_m_b2,
            c.decay,
            c.step_size,
            c.inv_bc2,
            c.eps,
        ])
    }

    fn coeffs(&self, c: &Consts) -> Coeffs {
        Coeffs {
            gs: self.grad_scale as f32,
            b1: self.beta1 as f32,
            one_m_b1: (1.0 - self.beta1) as f32,
            b2: self.beta2 as f32,
            one_m_b2: (1.0 - self.beta2) as f32,
            decay: c.decay as f32,
            step_size: c.step_size as f32,
            // Candle's `t / x` is `affine(1 / x, 0)`.
            inv_bc2: (1.0 / c.bc2) as f32,
            eps: self.eps as f32,
        }
    }
}

/// One parameter of a multi-tensor AdamW step ([`adamw_update_multi`]): the tensors
/// [`adamw_update`] takes, and whether the step's weight decay applies to it.
#[derive(Clone, Copy, Debug)]
pub struct AdamWParam<'a> {
    /// The parameter (f32, contiguous), updated in place.
    pub param: &'a Var,
    /// Its gradient (f32, bf16, f16 or f64; the parameter's shape).
    pub grad: &'a Tensor,
    /// The first moment (f32, contiguous), updated in place.
    pub exp_avg: &'a Tensor,
    /// The second moment (f32, contiguous), updated in place.
    pub exp_avg_sq: &'a Tensor,
    /// Whether [`AdamWStep::weight_decay`] applies (`false`: none, as for biases and norms).
    pub decay: bool,
}

impl AdamWParam<'_> {
    /// The step of this parameter: `s` without weight decay unless [`decay`](Self::decay).
    pub(super) fn step(&self, s: &AdamWStep) -> AdamWStep {
        AdamWStep {
            weight_decay: if self.decay { s.weight_decay } else { 0.0 },
            ..*s
        }
    }
}

/// Whether the Triton update takes a step of these tensors (already checked by
/// [`check_args`]): a gradient dtype and size its kernels cover, on a CUDA device with them on,
/// and the state, which the kernel updates in place, starting on a 16-byte boundary (it is f32
/// and contiguous).
fn on_triton(param: &Tensor, grad: &Tensor, exp_avg: &Tensor, exp_avg_sq: &Tensor) -> bool {
    let aligned = |t: &Tensor| {
        (t.layout().start_offset() * 4).is_multiple_of(cuda_kernels::POINTER_ALIGNMENT)
    };
    triton_flat(grad.device(), grad.dtype(), grad.elem_count())
        && [param, exp_avg, exp_avg_sq].into_iter().all(aligned)
}

fn check_args(param: &Tensor, grad: &Tensor, exp_avg: &Tensor, exp_avg_sq: &Tensor) -> Result<()> {
    for (name, t) in [
        ("param", param),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ] {
        if t.dtype() != DType::F32 {
            candle_core::bail!(
                "candle-fused adamw: {name} must be f32, got {:?}",
                t.dtype()
            )
        }
        if !t.is_contiguous() {
            candle_core::bail!(
                "candle-fused adamw: {name} must be contiguous (it is updated in place)"
            )
        }
    }
    if !matches!(
        grad.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) {
        candle_core::bail!(
            "candle-fused adamw: grad must be a float tensor, got {:?}",
            grad.dtype()
        )
    }
    for (name, t) in [
        ("grad", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ] {
        if t.shape() != param.shape() {
            candle_core::bail!(
                "candle-fused adamw: {name} has shape {:?}, param has {:?}",
                t.shape(),
                param.shape()
            )
        }
        if !t.device().same_device(param.device()) {
            candle_core::bail!("candle-fused adamw: {name} is on another device than param")
        }
    }
    // Checked up front so that a bad call fails before anything is written (the in-place ops
    // would reject aliased operands too, but only after the earlier passes ran).
    let ids = [param, grad, exp_avg, exp_avg_sq].map(storage_addr);
    for i in 0..4 {
        for j in i + 1..4 {
            if ids[i] == ids[j] {
                candle_core::bail!(
                    "candle-fused adamw: param, grad, exp_avg and exp_avg_sq must not share storage"
                )
            }
        }
    }
    Ok(())
}

/// The address of a tensor's storage (one read lock at a time, released at once).
fn storage_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    &*s as *const candle_core::Storage as usize
}

/// The composite reference step with plain Candle ops in f32: returns the new
/// `(param, exp_avg, exp_avg_sq)` without touching the inputs (gradient cast to f32 first).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::adamw::{adamw_composite, AdamWStep};
/// let p = Tensor::new(&[1f32, -2.], &Device::Cpu)?;
/// let g = Tensor::new(&[0.5f32, 0.5], &Device::Cpu)?;
/// let z = p.zeros_like()?;
/// let s = AdamWStep { lr: 0.1, weight_decay: 0.0, ..Default::default() };
/// let (p2, _, _) = adamw_composite(&p, &g, &z, &z, &s)?;
/// // The first step moves each weight by ~lr against the gradient's sign.
/// let p2 = p2.to_vec1::<f32>()?;
/// assert!((p2[0] - 0.9).abs() < 1e-5 && (p2[1] + 2.1).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn adamw_composite(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    s: &AdamWStep,
) -> Result<(Tensor, Tensor, Tensor)> {
    let c = s.check()?;
    let g = grad.to_dtype(DType::F32)?.affine(s.grad_scale, 0.0)?;
    let m = (exp_avg.affine(s.beta1, 0.0)? + g.affine(1.0 - s.beta1, 0.0)?)?;
    let v = (exp_avg_sq.affine(s.beta2, 0.0)? + g.sqr()?.affine(1.0 - s.beta2, 0.0)?)?;
    let denom = ((&v / c.bc2)?.sqrt()? + s.eps)?;
    let p = (param.affine(c.decay, 0.0)? - (m.affine(c.step_size, 0.0)? / denom)?)?;
    Ok((p, m, v))
}

/// Writes `src` into `dst`'s storage (same shape, both contiguous).
fn assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    dst.flatten_all()?
        .slice_set(&src.contiguous()?.flatten_all()?, 0, 0)
}

/// One fused AdamW step, in place: updates `param`, `exp_avg` and `exp_avg_sq` (all f32,
/// contiguous, same shape) from `grad` (any float dtype, same shape; read in its dtype,
/// widened to f32):
///
/// `g' = grad_scale g; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;`
/// `p = p (1 - lr wd) - (lr / bc1) m / (sqrt(v / bc2) + eps)`, `bc_i = 1 - b_i^step`.
///
/// On the CPU this allocates nothing (a strided `grad` is first copied). A NaN/inf gradient
/// element makes only its own parameter and moment elements NaN. Other devices: see the module
/// documentation.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::adamw::{adamw_update, AdamWStep};
/// let p = Var::new(&[1f32, -2.], &Device::Cpu)?;
/// let (m, v) = (p.zeros_like()?, p.zeros_like()?);
/// let g = Tensor::new(&[0.5f32, -0.5], &Device::Cpu)?;
/// let s = AdamWStep { lr: 0.1, weight_decay: 0.0, ..Default::default() };
/// adamw_update(&p, &g, &m, &v, &s)?;
/// let p = p.to_vec1::<f32>()?;
/// assert!((p[0] - 0.9).abs() < 1e-5 && (p[1] + 1.9).abs() < 1e-5);
/// assert!((m.to_vec1::<f32>()?[0] - 0.05).abs() < 1e-7); // (1 - 0.9) * 0.5
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn adamw_update(
    param: &Var,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    s: &AdamWStep,
) -> Result<()> {
    let p = param.as_tensor();
    check_args(p, grad, exp_avg, exp_avg_sq)?;
    let consts = s.check()?;
    if on_triton(p, grad, exp_avg, exp_avg_sq) {
        #[cfg(feature = "cuda")]
        return cuda::update(
            p,
            grad,
            exp_avg,
            exp_avg_sq,
            &cuda_kernels::adamw::scalars(s)?,
        );
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("candle-fused adamw: Triton kernels need the `cuda` feature");
    }
    if cpu::has_kernel(p) {
        let c = s.coeffs(&consts);
        let grad = grad.contiguous()?;
        exp_avg.inplace_op2(&grad, &Moment { c, second: false })?;
        exp_avg_sq.inplace_op2(&grad, &Moment { c, second: true })?;
        p.inplace_op3(exp_avg, exp_avg_sq, &ParamUpdate { c })
    } else {
        let (p2, m2, v2) = adamw_composite(
            &p.detach(),
            &grad.detach(),
            &exp_avg.detach(),
            &exp_avg_sq.detach(),
            s,
        )?;
        assign(exp_avg, &m2)?;
        assign(exp_avg_sq, &v2)?;
        param.set(&p2)
    }
}

/// Updates one moment from the gradient: `m = b m + (1-b) g'` or `v = b v + (1-b) g'^2`.
struct Moment {
    c: Coeffs,
    second: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "candle-fused-adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let d = dst_f32(s1, l1)?;
        cpu::dispatch!(s2.dtype(), T => {
            let g = cpu::contiguous::<T>(s2, l2)?;
            if g.len() != d.len() {
                candle_core::bail!("candle-fused adamw: grad/state size mismatch")
            }
            moment(d, g, &self.c, self.second);
        });
        Ok(())
    }
}

/// Updates the parameter from the updated moments.
struct ParamUpdate {
    c: Coeffs,
}

impl InplaceOp3 for ParamUpdate {
    fn name(&self) -> &'static str {
        "candle-fused-adamw-param"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let p = dst_f32(s1, l1)?;
        let m = cpu::contiguous::<f32>(s2, l2)?;
        let v = cpu::contiguous::<f32>(s3, l3)?;
        if m.len() != p.len() || v.len() != p.len() {
            candle_core::bail!("candle-fused adamw: param/state size mismatch")
        }
        let c = self.c;
        cpu::for_rows(p, CHUNK, CHUNK * 2, |i, p| {
            let r = i * CHUNK..i * CHUNK + p.len();
            for ((p, m), v) in p.iter_mut().zip(&m[r.clone()]).zip(&v[r]) {
                let denom = (*v * c.inv_bc2).sqrt() + c.eps;
                *p = *p * c.decay - (*m * c.step_size) / denom;
            }
        });
        Ok(())
    }
}

/// `sum(t^2)` as a scalar f32 tensor on `t`'s device (not differentiable: meant for
/// gradients). The CPU kernel reads `t` once in its dtype and accumulates in f64 over fixed
/// blocks (deterministic for any thread count); so do the Triton kernels on CUDA when switched
/// on (f32, bf16, f16; the f64 sums in another fixed order, so the f32 result can differ from
/// the CPU's by one rounding); other devices compute `sum(t^2)` with Candle ops (in f32, f64
/// for f64 inputs). NaN/inf anywhere gives a non-finite result; a sum above
/// `f32::MAX` (a norm above ~1.8e19) becomes `inf`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let t = Tensor::new(&[3f32, -4.], &Device::Cpu)?;
/// assert_eq!(candle_fused::adamw::sum_of_squares(&t)?.to_scalar::<f32>()?, 25.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sum_of_squares(t: &Tensor) -> Result<Tensor> {
    if triton_flat(t.device(), t.dtype(), t.elem_count()) {
        #[cfg(feature = "cuda")]
        return cuda::sum_of_squares(t);
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("candle-fused sum_of_squares: Triton kernels need the `cuda` feature");
    }
    if !cpu::has_kernel(t) {
        return sum_of_squares_composite(&t.detach());
    }
    let t = t.contiguous()?;
    let s = cpu::dispatch!(t.dtype(), T => cpu::with_slice::<T, _>(&t, |x| Ok(sumsq(x)))?);
    Tensor::new(s as f32, &Device::Cpu)
}

/// The composite reference of [`sum_of_squares`]: `sum(t^2)` with Candle ops, in f32 (f64 for
/// f64 inputs, then rounded to f32), as a scalar f32 tensor.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let t = Tensor::new(&[3f32, -4.], &Device::Cpu)?;
/// let s = candle_fused::adamw::sum_of_squares_composite(&t)?;
/// assert_eq!(s.to_scalar::<f32>()?, 25.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sum_of_squares_composite(t: &Tensor) -> Result<Tensor> {
    match t.dtype() {
        DType::F64 => t.sqr()?.sum_all()?.to_dtype(DType::F32),
        _ => t.to_dtype(DType::F32)?.sqr()?.sum_all(),
    }
}

/// The global L2 norm of all `grads`, `sqrt(sum_i sum(g_i^2))`, with exactly one host sync:
/// their [`sum_of_squares_multi`] (the per-tensor [`sum_of_squares`] added on the device in
/// order) is read back once. All
/// tensors must be on one device. A NaN or infinity anywhere gives a non-finite norm (0 for
/// no tensors).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let a = Tensor::new(&[3f32], &Device::Cpu)?;
/// let b = Tensor::new(&[[4f32]], &Device::Cpu)?;
/// assert_eq!(candle_fused::adamw::global_norm(&[&a, &b])?, 5.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn global_norm(grads: &[&Tensor]) -> Result<f32> {
    match sum_of_squares_multi(grads)? {
        None => Ok(0.0),
        Some(t) => Ok(t.to_scalar::<f32>()?.sqrt()),
    }
}

/// The composite reference of [`global_norm`]: the per-tensor sums from
/// [`sum_of_squares_composite`], added on the device, one host sync.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let a = Tensor::new(&[3f32], &Device::Cpu)?;
/// let b = Tensor::new(&[[4f32]], &Device::Cpu)?;
/// assert_eq!(candle_fused::adamw::global_norm_composite(&[&a, &b])?, 5.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn global_norm_composite(grads: &[&Tensor]) -> Result<f32> {
    norm_of_sums(grads, sum_of_squares_composite)
}

/// `sqrt` of the sum of `sumsq(g)` over `grads`, added on the device, read back once.
fn norm_of_sums(grads: &[&Tensor], sumsq: fn(&Tensor) -> Result<Tensor>) -> Result<f32> {
    match sum_in_order(grads, sumsq)? {
        None => Ok(0.0),
        Some(t) => Ok(crate::host::read_scalar::<f32>(&t)?.sqrt()),
    }
}

/// The sum of `sumsq(t)` over `ts`, added on the device in order (`None` for no tensor).
fn sum_in_order(ts: &[&Tensor], sumsq: fn(&Tensor) -> Result<Tensor>) -> Result<Option<Tensor>> {
    let mut total: Option<Tensor> = None;
    for t in ts {
        let s = sumsq(t)?;
        total = Some(match total {
            None => s,
            Some(acc) => (acc + s)?,
        });
    }
    Ok(total)
}

/// The gradient-clipping coefficient of PyTorch's `clip_grad_norm_`:
/// `min(1, max_norm / (norm + 1e-6))`; `max_norm <= 0` means no clipping (1.0). Pass it as
/// [`AdamWStep::grad_scale`] (times an inverse loss scale, if any).
///
/// As in PyTorch, a NaN norm gives a NaN coefficient (which would poison every parameter) and
/// an infinite norm gives 0: check `norm.is_finite()` and skip the step instead.
///
/// ```
/// use candle_fused::adamw::clip_coefficient;
/// assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
/// assert!((clip_coefficient(4.0, 1.0) - 0.25).abs() < 1e-6);
/// assert_eq!(clip_coefficient(4.0, 0.0), 1.0);
/// ```
pub fn clip_coefficient(norm: f32, max_norm: f32) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let c = max_norm as f64 / (norm as f64 + 1e-6);
    if c.is_nan() {
        f64::NAN
    } else {
        c.min(1.0)
    }
}
