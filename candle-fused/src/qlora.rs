//! QLoRA: the LoRA linear over a frozen 4-bit ([`nf4`](crate::nf4)) base weight,
//! `y = x Wᵀ + bias + scale · (dropout(x) Aᵀ) Bᵀ` with `W` dequantized a tile at a time.
//!
//! # The frozen 4-bit base
//!
//! [`nf4_linear`] computes `x Wᵀ + bias` for an [`Nf4Weight`] `W [out, in]` as one op whose
//! only graph input is `x`: the weight and the bias get no gradient. Forward and backward walk
//! the weight in tiles of rows (at most [`TILE_ELEMS`] values): each tile is dequantized into a
//! small buffer (`NF4 value · absmax` in f32, rounded to the compute dtype as bitsandbytes'
//! `dequantize_4bit(..).to(dtype)` rounds it), multiplied, and dropped before the next one, so
//! the full-precision weight never exists. With `dy` the upstream gradient:
//!
//! ```text
//! forward:  y[:, tile]  = x W_tileᵀ (+ bias[tile])      each output column from one tile
//! backward: dx          = Σ_tiles dy[:, tile] W_tile     summed over the tiles in order
//! ```
//!
//! bf16 and f16 compute in f32 (the dequantized tile, rounded to the dtype, is widened exactly)
//! and round `y` and `dx` once; f32 and f64 compute in their own type. On the CPU a tile is
//! dequantized on the host straight into the compute dtype, split over the threads our GEMM
//! runs on (Candle's pool, `crate::pool`), into one buffer reused for every tile; a tile holds
//! as many rows as [`TILE_ELEMS`] allows in whole multiples of 512 (the GEMM's sums over `k`),
//! so `dx` sums over the tiles in the chunks one GEMM over the whole weight would use. On CUDA
//! a tile is dequantized by the Triton kernel `nf4_dequant` (or
//! `nf4_dequant_nested`) when the kernels are on, otherwise by Candle ops on the device (the
//! same f32 products either way, so the same bits).
//!
//! # The adapter
//!
//! [`qlora_linear`] adds the adapter path of PEFT's `Linear4bit`,
//! `scale · B(A(dropout(x)))`, with the same dropout mask as
//! [`lora_linear`](crate::lora::lora_linear) (the fused [`dropout`](crate::dropout::dropout)
//! with the same key), gradients to `x`, `A` and `B`. On the CPU it is
//! [`lora_linear`](crate::lora::lora_linear)'s op with the 4-bit base in place of the dense
//! one, so it holds what that op holds: the output in one buffer (each tile's columns the bias
//! plus `x W_tileᵀ`, as the dense op sums them, the adapter added, rounded once), `h = u Aᵀ`
//! (`[N, r]`) saved for the backward, `dx` summed in one buffer (the adapter's part, then each
//! tile's `dy[:, tile] W_tile`); the products are our GEMMs (bf16 tiles on the bf16 kernel
//! where the CPU has AVX512-BF16, as there). On other devices it is composed from
//! differentiable ops over [`nf4_linear`].

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Result, Tensor};

use crate::cpu::{self, Elem, Real};
use crate::dropout;
use crate::linear::gemm::{narrow, operand};
use crate::lora;
use crate::nf4::Nf4Weight;
use crate::op::{self, acc_dtype, Grads, In, Kernel};
use crate::philox::RngKey;

pub(crate) mod tiled;
pub use tiled::TILE_ELEMS;
use tiled::{add_dx_host, dx_composite, fwd_acc_host, tiles};

/// `x [.., in] · Wᵀ + bias [out]` → `[.., out]` for the frozen 4-bit `w [out, in]` (see the
/// [module docs](self)): gradients to `x` only, in `x`'s dtype (a float type), the bias in
/// the same dtype.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_fused::{nf4::Nf4Weight, qlora::nf4_linear};
/// let dev = Device::Cpu;
/// let w = Nf4Weight::quantize(&Tensor::randn(0f32, 0.1, (5, 64), &dev)?, false)?;
/// let x = Var::randn(0f32, 1.0, (2, 3, 64), &dev)?;
/// let y = nf4_linear(&x, &w, None)?;
/// assert_eq!(y.dims(), &[2, 3, 5]);
/// let reference = x.matmul(&w.dequantize(DType::F32)?.t()?.unsqueeze(0)?.broadcast_as((2, 64, 5))?)?;
/// assert!((&y - reference)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&x).unwrap().dims(), &[2, 3, 64]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn nf4_linear(x: &Tensor, w: &Nf4Weight, bias: Option<&Tensor>) -> Result<Tensor> {
    let (n_in, n_out) = check(x, w, bias)?;
    let x = x.contiguous()?;
    let kernel = cpu::has_kernel(&x) && x.elem_count() > 0 && n_out > 0;
    let op = Nf4LinearOp {
        w: w.clone(),
        n_in,
        n_out,
        bias: bias.map(|b| b.detach().contiguous()).transpose()?,
    };
    if kernel {
        return op::apply(op, &[&x], None, None);
    }
    let y = op.forward(&x.detach(), bias.map(Tensor::detach).as_ref())?;
    op::apply(op, &[&x], None, Some(y))
}

/// The LoRA linear over a frozen 4-bit base: [`nf4_linear`]`(x, w, bias) + scale ·
/// (dropout(x) aᵀ) bᵀ`, with `a [r, in]` and `b [out, r]` in PEFT's layout (`lora_A.weight`,
/// `lora_B.weight`) and `dropout` as for [`lora_linear`](crate::lora::lora_linear) (`None` or
/// `p == 0`: none). Gradients to `x`, `a` and `b`; none to `w` or `bias`.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_fused::{nf4::Nf4Weight, qlora::qlora_linear, RngKey};
/// let dev = Device::Cpu;
/// let w = Nf4Weight::quantize(&Tensor::randn(0f32, 0.1, (5, 64), &dev)?, true)?;
/// let x = Var::randn(0f32, 1.0, (3, 64), &dev)?;
/// let a = Var::randn(0f32, 0.1, (4, 64), &dev)?;
/// let b = Var::randn(0f32, 0.1, (5, 4), &dev)?;
/// let y = qlora_linear(&x, &w, None, &a, &b, 2.0, Some((0.1, RngKey::new(7, 3))))?;
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&a).unwrap().dims(), &[4, 64]);
/// assert_eq!(g.get(&b).unwrap().dims(), &[5, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn qlora_linear(
    x: &Tensor,
    w: &Nf4Weight,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<(f32, RngKey)>,
) -> Result<Tensor> {
    let (n_in, n_out) = check(x, w, bias)?;
    let r = lora::check_adapter("qlora_linear", x, a, b, n_in, n_out)?;
    if let Some((p, _)) = dropout {
        dropout::check_p(p)?;
    }
    let x = &x.contiguous()?;
    let dims = lora::Dims { n_in, n_out, r };
    if lora::has_kernel(x, dims) {
        let drop = dropout.filter(|&(p, _)| p > 0.0);
        let base = lora::Base::Nf4(w.clone());
        return lora::apply_kernel(x, base, bias, (a, b), scale, drop, dims);
    }
    let base = nf4_linear(x, w, bias)?;
    let u = match dropout.filter(|&(p, _)| p > 0.0) {
        Some((p, key)) => dropout::dropout(x, p, key)?,
        None => x.clone(),
    };
    let h = u.reshape(((), n_in))?.matmul(&a.t()?)?;
    let delta = h
        .matmul(&b.t()?)?
        .affine(scale, 0.0)?
        .reshape(base.shape())?;
    base + delta
}

/// The composite reference of [`qlora_linear`]: the whole weight dequantized
/// ([`Nf4Weight::dequantize`] to `x`'s dtype) and
/// [`lora_linear_composite`](crate::lora::lora_linear_composite) over it.
pub fn qlora_linear_composite(
    x: &Tensor,
    w: &Nf4Weight,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<(f32, RngKey)>,
) -> Result<Tensor> {
    check(x, w, bias)?;
    let wd = w.dequantize(x.dtype())?.to_device(x.device())?;
    crate::lora::lora_linear_composite(x, &wd.t()?, bias, a, b, scale, dropout)
}

/// `(in, out)` of the call, checked.
fn check(x: &Tensor, w: &Nf4Weight, bias: Option<&Tensor>) -> Result<(usize, usize)> {
    let (n_out, n_in) = match w.shape() {
        [o, i] => (*o, *i),
        d => bail!("candle-fused nf4_linear: the 4-bit weight must be 2-D [out, in], got {d:?}"),
    };
    if !x.dtype().is_float() {
        bail!(
            "candle-fused nf4_linear: input dtype {:?} is not a float type",
            x.dtype()
        );
    }
    if x.rank() == 0 || x.dim(x.rank() - 1)? != n_in {
        bail!(
            "candle-fused nf4_linear: input {:?} does not end in the weight's in-features {n_in}",
            x.dims()
        );
    }
    if !w.device().same_device(x.device()) {
        bail!("candle-fused nf4_linear: the 4-bit weight and the input are on different devices");
    }
    if let Some(b) = bias {
        if b.dims() != [n_out] || b.dtype() != x.dtype() {
            bail!(
                "candle-fused nf4_linear: bias {:?} {:?} must be [{n_out}] in the input's {:?}",
                b.dims(),
                b.dtype(),
                x.dtype()
            );
        }
    }
    Ok((n_in, n_out))
}

/// The op on `x`; holds the frozen 4-bit weight and bias.
struct Nf4LinearOp {
    w: Nf4Weight,
    n_in: usize,
    n_out: usize,
    bias: Option<Tensor>,
}

impl Nf4LinearOp {
    /// Calls `f(first row, tile [rows, in] in the accumulation type)` for each tile in order.
    fn for_tiles(
        &self,
        dtype: DType,
        mut f: impl FnMut(usize, Tensor) -> Result<()>,
    ) -> Result<()> {
        tiles(&self.w, dtype, |r0, tile| {
            f(r0, tile.to_dtype(acc_dtype(dtype))?)
        })
    }

    /// `x Wᵀ + bias` on detached tensors.
    fn forward(&self, x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let dtype = x.dtype();
        let acc = acc_dtype(dtype);
        let x2 = x.reshape(((), self.n_in))?.to_dtype(acc)?;
        let mut parts = Vec::new();
        self.for_tiles(dtype, |_, tile| {
            parts.push(x2.matmul(&tile.t()?)?);
            Ok(())
        })?;
        let mut y = match parts.len() {
            0 => Tensor::zeros((x2.dim(0)?, 0), acc, x.device())?,
            1 => parts.remove(0),
            _ => Tensor::cat(&parts, 1)?,
        };
        if let Some(b) = bias {
            y = y.broadcast_add(&b.to_dtype(acc)?)?;
        }
        let mut dims = x.dims().to_vec();
        if let Some(l) = dims.last_mut() {
            *l = self.n_out;
        }
        y.to_dtype(dtype)?.reshape(dims)
    }
}

impl Kernel for Nf4LinearOp {
    fn name(&self) -> &'static str {
        "candle-fused-nf4-linear"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (sx, lx) = ins[0];
        let shape = crate::linear::out_shape(lx, self.n_out);
        let bias = self.bias.as_ref().map(Tensor::storage_and_layout);
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let bs = match &bias {
                Some((s, l)) => Some(cpu::contiguous::<T>(op::cpu_of(s)?, l)?),
                None => None,
            };
            let y = fwd_acc_host(xs, &self.w, bs)?;
            Ok((T::storage(narrow::<T>(y)), shape))
        })
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let x = ins[0];
        if !x.track_op() {
            return Ok([None, None, None]);
        }
        let g = dy.detach().to_dtype(x.dtype())?.reshape(((), self.n_out))?;
        if !(cpu::has_kernel(x) && g.device().is_cpu() && g.elem_count() > 0) {
            let dx = dx_composite(&self.w, &g)?;
            return Ok([Some(dx.reshape(x.shape())?), None, None]);
        }
        let g = g.contiguous()?;
        cpu::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&g, |gs| {
                let mut dx = vec![<<T as Elem>::Acc as Real>::ZERO; x.elem_count()];
                add_dx_host::<T>(&mut dx, &operand(gs), &self.w)?;
                Ok([Some(cpu::tensor(narrow::<T>(dx), x.shape())?), None, None])
            })
        })
    }
}
