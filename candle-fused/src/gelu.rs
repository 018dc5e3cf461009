//! Bias add + tanh GELU (GPT-2's) in one differentiable op.
//!
//! `gelu(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))` of `z = x + b`, `b` broadcast
//! over the last dimension. The forward reads `x` once and writes the output; nothing is
//! saved: the backward recomputes `z` and `gelu'(z)` (`dx = dy * gelu'(z)`, `db` = the sum of
//! `dx` over rows as partial sums over fixed row blocks added in order, so it is the same on
//! any number of threads).
//!
//! The f32 / bf16 / f16 kernels use [`tanh_f32`], a branch-free tanh that LLVM vectorises
//! (std's `tanhf` is a libm call per element); the f64 kernel uses std's `tanh`.
//!
//! On CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`), forward and
//! backward run the Triton kernels (`gelu/cuda.rs`): the same `exp_f32` / `tanh_f32` and
//! formulas, so `y` and `dx` are the CPU's bits, and `db` from partial sums over fixed blocks
//! of 16 rows added in order. Otherwise CUDA computes [`bias_gelu_composite`]'s expression
//! inside the op.

#[cfg(feature = "cuda")]
mod cuda;

use crate::cpu::{self, Elem, Real};
use crate::cuda_kernels::{triton_flat, triton_input};
use crate::op::{self, acc_dtype, check_like, Grads, In, Kernel};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Result, Shape, Tensor};

/// `sqrt(2 / pi)`.
const K0: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of GPT-2's GELU.
const K1: f64 = 0.044_715;

/// `e^x` in f32, branch-free so that loops over it vectorise: Cody–Waite reduction
/// `x = n ln2 + r`, a degree-7 polynomial for `e^r` (Cephes' `expf` coefficients) and `2^n`
/// built from the exponent bits (in two factors, so subnormal results and the top of the range
/// are right). Max error < 1 ulp over the whole range (tested against f64 `exp`); `exp(x)` is
/// `inf` for `x > 88.72`, `0` (with subnormals down to `2^-149`) for `x < -103.9`, `NaN` for
/// `NaN`.
///
/// ```
/// let e = candle_fused::gelu::exp_f32(1.0);
/// assert!((e - std::f32::consts::E).abs() <= f32::EPSILON * 3.0);
/// assert_eq!(candle_fused::gelu::exp_f32(f32::NEG_INFINITY), 0.0);
/// ```
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    // `clamp` keeps a NaN.
    let x = x.clamp(-104.0, 89.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let r2 = r * r;
    let p = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * r2
        + r
        + 1.0;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let h = ni >> 1;
    let s1 = f32::from_bits(((h + 127) as u32) << 23);
    let s2 = f32::from_bits(((ni - h + 127) as u32) << 23);
    p * s1 * s2
}

/// `tanh(x)` in f32, branch-free so that loops over it vectorise. For `|x| < 0.625` the odd
/// polynomial of Cephes' `tanhf`, else `1 - 2 / (e^{2|x|} + 1)` with [`exp_f32`], then the sign
/// of `x`. Max error against f64 `tanh`: 1.32 ulp of the correctly rounded f32, near `|x| =
/// 0.63` where the two forms meet (measured on every 7th f32 in [4.6e-10, 20]; the tests check
/// <= 1.5 ulp on a 2M-point grid over [-12, 12] and every 61st f32 in [1e-30, 10], both signs).
/// Saturates to exactly `±1` from `|x| ≈ 9.01` (where the correctly rounded value becomes 1),
/// `±1` at `±inf`, `NaN` for `NaN`.
///
/// ```
/// use candle_fused::gelu::tanh_f32;
/// assert!((tanh_f32(0.5) - 0.5f32.tanh()).abs() <= f32::EPSILON);
/// assert_eq!(tanh_f32(20.0), 1.0);
/// assert!(tanh_f32(f32::NAN).is_nan());
/// ```
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let z = a * a;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328e-1)
            * z
            * a
            + a;
    let large = 1.0 - 2.0 / (exp_f32(a + a) + 1.0);
    let r = if a < 0.625 { small } else { large };
    r.copysign(x)
}

/// The exponential and tanh the kernels use: the vectorising approximations for f32, std's
/// for f64.
pub(crate) trait FastMath: Real {
    /// `e^x`.
    fn exp_fast(self) -> Self;
    /// `tanh x`.
    fn tanh_fast(self) -> Self;
}

impl FastMath for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh_fast(self) -> f32 {
        tanh_f32(self)
    }
}

impl FastMath for f64 {
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }
    #[inline(always)]
    fn tanh_fast(self) -> f64 {
        self.tanh()
    }
}

/// `gelu(z)`, the kernels' operation order.
#[inline(always)]
pub(crate) fn gelu_val<A: FastMath>(z: A) -> A {
    let u = A::c(K0) * (z + A::c(K1) * z * z * z);
    A::c(0.5) * z * (A::ONE + u.tanh_fast())
}

/// `gelu'(z)`, the kernels' operation order.
#[inline(always)]
pub(crate) fn gelu_grad<A: FastMath>(z: A) -> A {
    let z2 = z * z;
    let t = (A::c(K0) * (z + A::c(K1) * z2 * z)).tanh_fast();
    let half = A::c(0.5);
    half * (A::ONE + t) + half * z * (A::ONE - t * t) * A::c(K0) * (A::ONE + A::c(3.0 * K1) * z2)
}

/// Bias add + tanh GELU: `gelu(x + b)` with `b: [C]` broadcast over the last dim of `x: [.., C]`
/// (same dtype), or `gelu(x)` when `b` is `None`; GPT-2's `0.5 z (1 + tanh(sqrt(2/pi) (z +
/// 0.044715 z^3)))`.
///
/// Differentiable in `x` and `b`. On the CPU a one-pass kernel (16-bit inputs computed in f32
/// and rounded once, no statistics saved); on CUDA the Triton kernels when switched on (the
/// same bits); elsewhere [`bias_gelu_composite`]'s expression inside the same op.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[-1f32, 0., 1.], [2., 3., -4.]], &Device::Cpu)?;
/// let b = Tensor::new(&[0.5f32, 0., -0.5], &Device::Cpu)?;
/// let y = candle_fused::gelu::bias_gelu(&x, Some(&b))?;
/// let r = candle_fused::gelu::bias_gelu_composite(&x, Some(&b))?;
/// assert!((y - r)?.abs()?.sum_all()?.to_scalar::<f32>()? < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn bias_gelu(x: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let c = check("bias_gelu", x, b)?;
    if triton_flat(x.device(), x.dtype(), x.elem_count()) {
        // the Triton kernels (CUDA, on by default): nothing computed beforehand
        let op = GeluOp { c, triton: true };
        let x = triton_input(x)?;
        let b = b.map(triton_input).transpose()?;
        return op::apply(op, &[&x], b.as_ref(), None);
    }
    let op = GeluOp { c, triton: false };
    if cpu::has_kernel(x) && x.elem_count() > 0 {
        let x = x.contiguous()?;
        let b = b.map(Tensor::contiguous).transpose()?;
        return op::apply(op, &[&x], b.as_ref(), None);
    }
    let bd = b.map(Tensor::detach);
    let y = composite(&x.detach(), bd.as_ref())?;
    op::apply(op, &[x], b, Some(y))
}

/// Tanh GELU (GPT-2's): [`bias_gelu`] without a bias.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let y = candle_fused::gelu::gelu(&Tensor::new(&[0f64, 1.], &Device::Cpu)?)?.to_vec1::<f64>()?;
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 0.841_191_990_607_859_2).abs() < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    bias_gelu(x, None)
}

/// The reference bias + tanh GELU from plain differentiable Candle ops (`broadcast_add`, `sqr`,
/// `tanh`, `affine`; in f32 for 16-bit inputs, rounded once).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[1f64], &Device::Cpu)?;
/// let b = Tensor::new(&[-1f64], &Device::Cpu)?;
/// let y = candle_fused::gelu::bias_gelu_composite(&x, Some(&b))?.to_vec1::<f64>()?;
/// assert_eq!(y, [0.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn bias_gelu_composite(x: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    check("bias_gelu_composite", x, b)?;
    composite(x, b)
}

/// The reference tanh GELU from plain ops: [`bias_gelu_composite`] without a bias.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let y = candle_fused::gelu::gelu_composite(&Tensor::new(&[0f32], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [0.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu_composite(x: &Tensor) -> Result<Tensor> {
    bias_gelu_composite(x, None)
}

/// Checks the arguments; returns the row length of the kernel (the bias length, or a fixed
/// chunk of the flattened tensor without a bias).
fn check(op: &str, x: &Tensor, b: Option<&Tensor>) -> Result<usize> {
    op::check_float(op, "x", x)?;
    let Some(b) = b else {
        return Ok(CHUNK);
    };
    let c = match x.dims().last() {
        Some(&c) => c,
        None => bail!("{op}: x must have rank >= 1 to take a bias"),
    };
    if b.dims() != [c] {
        bail!(
            "{op}: b must have shape [{c}] (x's last dim), got {:?}",
            b.shape()
        )
    }
    check_like(op, ("b", b), ("x", x))?;
    Ok(c)
}

/// Elements per parallel work item without a bias.
const CHUNK: usize = 4096;

/// `gelu(x + b)` from plain ops, in f32 for 16-bit inputs.
fn composite(x: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let dt = x.dtype();
    let acc = acc_dtype(dt);
    let z = x.to_dtype(acc)?;
    let z = match b {
        Some(b) => z.broadcast_add(&b.to_dtype(acc)?)?,
        None => z,
    };
    // K0 (z + K1 z^3) = z (K0 + K0 K1 z^2), and 0.5 z (1 + t) = z (0.5 + 0.5 t): six ops.
    let inner = (z.sqr()?.affine(K0 * K1, K0)? * &z)?;
    let y = (inner.tanh()?.affine(0.5, 0.5)? * &z)?;
    y.to_dtype(dt)
}

/// `(x)` or `(x, b)`; `c` is the kernel's row length.
struct GeluOp {
    c: usize,
    /// Forward and backward run the Triton kernels (CUDA, `gelu/cuda.rs`).
    triton: bool,
}

impl Kernel for GeluOp {
    fn name(&self) -> &'static str {
        "candle-fused-bias-gelu"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sx, lx), b) = (ins[0], ins.get(1));
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let bs = b.map(|(s, l)| cpu::contiguous::<T>(s, l)).transpose()?;
            Ok((T::storage(fwd_kernel(xs, bs, self.c)), lx.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        match *ins {
            [x] => cuda::fwd(x),
            [x, b] => cuda::bias_fwd(x, b),
            _ => bail!("{}: takes x and an optional bias", self.name()),
        }
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (x, b) = (ins[0], ins.get(1).copied());
        let need_x = x.track_op();
        let need_b = b.is_some_and(Tensor::track_op);
        op::triton_path!(
            self.triton,
            self.name(),
            cuda::bwd(x, b, dy, [need_x, need_b])
        );
        if !(cpu::has_kernel(x) && dy.device().is_cpu()) {
            let (dx, db) = composite_bwd(x, b, dy, need_x, need_b)?;
            return Ok([dx, db, None]);
        }
        let x = x.contiguous()?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let b = b.map(Tensor::contiguous).transpose()?;
        let c = self.c;
        cpu::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&x, |xs| {
                cpu::with_slice::<T, _>(&dy, |dys| {
                    let (dx, db) = match &b {
                        Some(b) => cpu::with_slice::<T, _>(b, |bs| {
                            Ok(bwd_kernel(xs, Some(bs), dys, c, need_b))
                        })?,
                        None => bwd_kernel(xs, None, dys, c, false),
                    };
                    let dx = need_x.then(|| cpu::tensor(dx, x.shape())).transpose()?;
                    let db = db.map(|v| cpu::tensor(v, c)).transpose()?;
                    Ok([dx, db, None])
                })
            })
        })
    }
}

/// The gradients from composite ops on detached tensors (devices without a kernel).
fn composite_bwd(
    x: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    need_x: bool,
    need_b: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let dt = x.dtype();
    let acc = acc_dtype(dt);
    let z = x.detach().to_dtype(acc)?;
    let z = match b {
        Some(b) => z.broadcast_add(&b.detach().to_dtype(acc)?)?,
        None => z,
    };
    let dz = (dy.detach().to_dtype(acc)? * gelu_grad_composite(&z)?)?;
    let db = match b {
        Some(b) if need_b => {
            let c = b.elem_count();
            Some(dz.reshape(((), c))?.sum(0)?.to_dtype(dt)?)
        }
        _ => None,
    };
    let dx = if need_x { Some(dz.to_dtype(dt)?) } else { None };
    Ok((dx, db))
}

/// `gelu'(z)` from plain ops (`z` detached, any float dtype).
pub(crate) fn gelu_grad_composite(z: &Tensor) -> Result<Tensor> {
    let z2 = z.sqr()?;
    let t = ((&z2 * z)?.affine(K1, 0.0)? + z)?.affine(K0, 0.0)?.tanh()?;
    // 0.5 (1 + t) + 0.5 z (1 - t^2) K0 (1 + 3 K1 z^2)
    let left = t.affine(0.5, 0.5)?;
    let right = ((t.sqr()?.affine(-1.0, 1.0)? * z)? * z2.affine(3.0 * K1, 1.0)?)?;
    left + right.affine(0.5 * K0, 0.0)?
}

pub(crate) fn fwd_kernel<T: Elem>(x: &[T], b: Option<&[T]>, c: usize) -> Vec<T>
where
    T::Acc: FastMath,
{
    let mut y = vec![T::from_acc(T::Acc::ZERO); x.len()];
    match b {
        Some(b) => {
            let ba: Vec<T::Acc> = b.iter().map(|v| v.acc()).collect();
            cpu::for_rows(&mut y, c, 8 * c, |i, yr| {
                let xr = &x[i * c..i * c + yr.len()];
                for ((yo, xv), bv) in yr.iter_mut().zip(xr).zip(&ba) {
                    *yo = T::from_acc(gelu_val(xv.acc() + *bv));
                }
            });
        }
        None => cpu::for_rows(&mut y, c, 8 * c, |i, yr| {
            let xr = &x[i * c..i * c + yr.len()];
            for (yo, xv) in yr.iter_mut().zip(xr) {
                *yo = T::from_acc(gelu_val(xv.acc()));
            }
        }),
    }
    y
}

/// `(dx, db)`; `db` (when `need_b`) sums the unrounded `dx` over fixed row blocks, in order.
pub(crate) fn bwd_kernel<T: Elem>(
    x: &[T],
    b: Option<&[T]>,
    dy: &[T],
    c: usize,
    need_b: bool,
) -> (Vec<T>, Option<Vec<T>>)
where
    T::Acc: FastMath,
{
    let zero = T::Acc::ZERO;
    let mut dx = vec![T::from_acc(zero); x.len()];
    let Some(b) = b else {
        cpu::for_rows(&mut dx, c, 10 * c, |i, dr| {
            let (xr, dyr) = (&x[i * c..i * c + dr.len()], &dy[i * c..i * c + dr.len()]);
            for ((d, xv), dv) in dr.iter_mut().zip(xr).zip(dyr) {
                *d = T::from_acc(dv.acc() * gelu_grad(xv.acc()));
            }
        });
        return (dx, None);
    };
    let ba: Vec<T::Acc> = b.iter().map(|v| v.acc()).collect();
    let parts = cpu::for_row_blocks(&mut dx, c, 10 * c, |r0, dxb| {
        let mut db = if need_b { vec![zero; c] } else { Vec::new() };
        for (k, dr) in dxb.chunks_mut(c).enumerate() {
            let i = r0 + k;
            let (xr, dyr) = (&x[i * c..(i + 1) * c], &dy[i * c..(i + 1) * c]);
            if need_b {
                for ((((d, a), xv), dv), bv) in
                    dr.iter_mut().zip(db.iter_mut()).zip(xr).zip(dyr).zip(&ba)
                {
                    let g = dv.acc() * gelu_grad(xv.acc() + *bv);
                    *a += g;
                    *d = T::from_acc(g);
                }
            } else {
                for (((d, xv), dv), bv) in dr.iter_mut().zip(xr).zip(dyr).zip(&ba) {
                    *d = T::from_acc(dv.acc() * gelu_grad(xv.acc() + *bv));
                }
            }
        }
        db
    });
    let db = need_b.then(|| {
        let mut s = vec![zero; c];
        for p in &parts {
            for (a, v) in s.iter_mut().zip(p) {
                *a += *v;
            }
        }
        s.into_iter().map(T::from_acc).collect()
    });
    (dx, db)
}
