//! Rotary position embeddings (RoPE) in transformers' convention, differentiable, fused with
//! the `[B, T, H, D] -> [B, H, T, D]` transpose attention needs.
//!
//! **Convention**: split halves (`rotate_half`), as transformers' Llama / Qwen / Mistral and
//! Candle's `rotary_emb::rope` (not the interleaved pairs of Meta's original checkpoints).
//! With `d = D / 2` and the tables `cos`, `sin` of each row's position (`[B, T, d]`), for every
//! `(b, t, h)` and `i < d`:
//!
//! ```text
//! forward:   y[i]     = x[i] cos[i] - x[i + d] sin[i]
//!            y[i + d] = x[i + d] cos[i] + x[i] sin[i]
//! backward:  dx[i]     = dy[i] cos[i] + dy[i + d] sin[i]
//!            dx[i + d] = dy[i + d] cos[i] - dy[i] sin[i]
//! ```
//!
//! which is transformers' `q * cos + rotate_half(q) * sin` with `cos = cat(cos, cos)`,
//! `rotate_half(q) = cat(-q[d:], q[:d])`. Each pair `(i, i + d)` is rotated by the angle
//! `pos * inv_freq[i]`; the backward rotates the upstream gradient back by the same angle (a
//! rotation's transpose is its inverse), so it needs neither `x` nor `y`: nothing is saved but
//! the tables. The tables are constants (no gradient).
//!
//! **Layout**: [`rope`] reads `x` `[B, T, H, D]` through its strides (e.g. q as a view of a
//! packed projection, `qkv.reshape((B, T, 3H, D))?.narrow(2, 0, H)?`) and writes `[B, H, T, D]`
//! contiguous, already transposed for attention: the rotation is the only copy. The backward
//! writes `dx` in `x`'s `[B, T, H, D]` shape (contiguous).
//!
//! **Precision**: the tables are f32, as transformers computes them ([`rope_tables`]). For
//! f32 and 16-bit `x` the products and sums run in f32 with those tables and are rounded once
//! to `x`'s dtype; f64 `x` widens the tables to f64. transformers in bf16 / f16 instead casts
//! `cos` / `sin` to the activation dtype first and rounds after each of its three ops, so bf16
//! outputs differ from it by about a bf16 rounding unit; the f32 tables here are exact, and
//! this op is what transformers computes in f32, rounded once. To reproduce transformers' table
//! rounding, pass tables cast to bf16 (any float dtype is accepted and widened exactly).
//!
//! The kernel and [`rope_composite`] compute every output with the same products and the same
//! add or subtract, so they agree bit for bit (values and gradients, every dtype; the tests
//! check it). Each output row is written by one piece of work: the same bits on any number of
//! threads.
//!
//! **CUDA**: with the Triton kernels switched on (`cuda_kernels::set_triton`; f32, bf16, f16)
//! the forward and backward are `rope_fwd` / `rope_bwd` (`triton/rope.py`, `rope/cuda.rs`): the
//! same formulas (no FMA), so the same bits as the CPU kernel; a strided `x` is made contiguous
//! first (the kernels read it contiguous). Otherwise CUDA runs the composite inside the op.

#[cfg(feature = "cuda")]
mod cuda;
mod kernel;

use crate::cpu::{self, Elem};
use crate::cuda_kernels::{triton_for, triton_input};
use crate::op::{self, acc_dtype, Grads, In, Kernel};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor, D};
use kernel::Geom;

/// Rotary embedding of `x` `[B, T, H, D]` (any strides) by the tables `cos`, `sin`
/// (`[B, T, D/2]`, each row's own positions, f32 from [`rope_tables`]; or `[T, D/2]` /
/// `[1, T, D/2]`, the same positions for every row), returned as `[B, H, T, D]` contiguous in
/// `x`'s dtype (transposed for attention). transformers' split-halves convention: `y[i] = x[i]
/// cos[i] - x[i + d] sin[i]`, `y[i + d] = x[i + d] cos[i] + x[i] sin[i]`, `d = D / 2` (see the
/// [module docs](self)).
///
/// Differentiable in `x`; the tables are constants and must not track a graph (an error, not
/// a silently dropped gradient). On the CPU one pass of a kernel (16-bit `x` computed in f32,
/// rounded once); on CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`;
/// f32, bf16, f16) the same computation in one kernel each way; elsewhere [`rope_composite`]'s
/// expression inside the same op.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::rope::{rope, rope_composite, rope_tables};
/// let dev = Device::Cpu;
/// let (b, t, h, d) = (2, 5, 3, 8);
/// let pos = Tensor::arange(0u32, (b * t) as u32, &dev)?.reshape((b, t))?;
/// let inv_freq = Tensor::new(&[1f32, 0.1, 0.01, 0.001], &dev)?;
/// let (cos, sin) = rope_tables(&pos, &inv_freq)?;
/// let x = Var::randn(0f32, 1.0, (b, t, h, d), &dev)?;
/// let y = rope(&x, &cos, &sin)?;
/// assert_eq!(y.dims(), &[b, h, t, d]);
/// let r = rope_composite(&x, &cos, &sin)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, r.flatten_all()?.to_vec1::<f32>()?);
/// let g = y.sqr()?.sum_all()?.backward()?;
/// assert_eq!(g.get(&x).unwrap().dims(), &[b, t, h, d]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let g = check("rope", x, cos, sin)?;
    for (name, tab) in [("cos", cos), ("sin", sin)] {
        if tab.track_op() {
            bail!("rope: {name} tracks a gradient, but the tables are constants here; detach it")
        }
    }
    let acc = acc_dtype(x.dtype());
    let mut op = RopeOp {
        g,
        cos: cos.detach().to_dtype(acc)?.contiguous()?,
        sin: sin.detach().to_dtype(acc)?.contiguous()?,
        triton: false,
    };
    if triton_for(x) {
        // the Triton kernels (CUDA, on by default): x contiguous, the tables `[TB, T, D/2]` f32 with
        // TB = 1 when shared by the batch (`[T, D/2]` or `[1, T, D/2]`), else B
        let tb = if g.table_sb == 0 { 1 } else { g.b };
        let tables = (tb, g.t, g.half);
        op.cos = triton_input(&op.cos.reshape(tables)?)?;
        op.sin = triton_input(&op.sin.reshape(tables)?)?;
        op.triton = true;
        return op::apply(op, &[&triton_input(x)?], None, None);
    }
    if cpu::has_kernel(x) && x.elem_count() > 0 {
        // The kernel reads any strides but wants the features of a head side by side.
        let x = if x.stride()[3] == 1 {
            x.clone()
        } else {
            x.contiguous()?
        };
        return op::apply(op, &[&x], None, None);
    }
    let y = composite(&x.detach(), &op.cos, &op.sin)?;
    op::apply(op, &[x], None, Some(y))
}

/// The reference of [`rope`] from plain differentiable Candle ops, transformers' expression:
/// `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)` with `rotate_half(x) = cat(-x[.., d:],
/// x[.., :d])` (`transpose(1, 2)`, `narrow`, `neg`, `cat`, `broadcast_mul`, `contiguous`), in f32
/// for 16-bit `x` (f64 for f64), rounded once to `x`'s dtype. Same arguments and result as
/// [`rope`]; gradients flow to `x` (and to the tables, should they track a graph).
///
/// ```
/// use candle_core::{Device, Tensor};
/// // Position 0 (cos 1, sin 0) leaves x as it is, transposed to [B, H, T, D].
/// let x = Tensor::new(&[1f64, 2., 3., 4.], &Device::Cpu)?.reshape((1, 1, 1, 4))?;
/// let (cos, sin) = (Tensor::ones((1, 2), candle_core::DType::F32, &Device::Cpu)?,
///                   Tensor::zeros((1, 2), candle_core::DType::F32, &Device::Cpu)?);
/// let y = candle_fused::rope::rope_composite(&x, &cos, &sin)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f64>()?, [1., 2., 3., 4.]);
/// // A quarter turn of every pair: (x[i], x[i + d]) -> (-x[i + d], x[i]).
/// let (cos, sin) = (sin, cos);
/// let y = candle_fused::rope::rope_composite(&x, &cos, &sin)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f64>()?, [-3., -4., 1., 2.]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    check("rope_composite", x, cos, sin)?;
    composite(x, cos, sin)
}

/// transformers' RoPE tables for `positions` (`[B, T]` or `[T]`; u32, i32 or i64) and
/// `inv_freq` (`[D/2]`, f32): `(cos, sin)`, each `[B, T, D/2]` (or `[T, D/2]`) f32, with
/// `freqs[b, t, i] = (positions[b, t] as f32) * inv_freq[i]`, `cos = freqs.cos()`,
/// `sin = freqs.sin()`.
///
/// That is transformers' `inv_freq[None, :, None] @ position_ids[:, None, :].float()` (a
/// matmul with k = 1: one f32 product, exactly) followed by `.cos()` / `.sin()` in f32 (with
/// `attention_scaling` 1, the default and llama3 rope types). On the CPU `cos` / `sin` are
/// Rust's `f32::cos` / `f32::sin` (libm, correctly rounded or within 1 ulp); PyTorch's
/// vectorised `cos` / `sin` may differ from them by about 1 ulp. Positions above 2^24 round to
/// f32 as `.float()` rounds them. Not differentiable (constants: the inputs are detached).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let pos = Tensor::new(&[[0u32, 1, 2]], &Device::Cpu)?;
/// let inv_freq = Tensor::new(&[1f32, 0.5], &Device::Cpu)?;
/// let (cos, sin) = candle_fused::rope::rope_tables(&pos, &inv_freq)?;
/// assert_eq!(cos.dims(), &[1, 3, 2]);
/// assert_eq!(cos.to_vec3::<f32>()?[0][2], [2f32.cos(), 1f32.cos()]);
/// assert_eq!(sin.to_vec3::<f32>()?[0][0], [0.0, 0.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_tables(positions: &Tensor, inv_freq: &Tensor) -> Result<(Tensor, Tensor)> {
    if !matches!(positions.dtype(), DType::U32 | DType::I32 | DType::I64) {
        bail!(
            "rope_tables: positions must be u32, i32 or i64, got {:?}",
            positions.dtype()
        )
    }
    if !matches!(positions.rank(), 1 | 2) {
        bail!(
            "rope_tables: positions must be [B, T] or [T], got shape {:?}",
            positions.shape()
        )
    }
    if inv_freq.dtype() != DType::F32 || inv_freq.rank() != 1 {
        bail!(
            "rope_tables: inv_freq must be a [D/2] f32 tensor, got {:?} {:?}",
            inv_freq.shape(),
            inv_freq.dtype()
        )
    }
    if !inv_freq.device().same_device(positions.device()) {
        bail!("rope_tables: positions and inv_freq are on different devices")
    }
    let p = positions
        .detach()
        .to_dtype(DType::F32)?
        .unsqueeze(D::Minus1)?;
    let freqs = p.broadcast_mul(&inv_freq.detach())?;
    Ok((freqs.cos()?, freqs.sin()?))
}

/// Checks the arguments; returns the sizes (the tables' batch stride in elements, 0 when
/// shared by the batch).
fn check(op: &str, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Geom> {
    op::check_float(op, "x", x)?;
    let &[b, t, h, dd] = x.dims() else {
        bail!("{op}: x must be [B, T, H, D], got shape {:?}", x.shape())
    };
    if dd == 0 || dd % 2 != 0 {
        bail!(
            "{op}: the head dim D must be even and positive, got x shape {:?}",
            x.shape()
        )
    }
    let half = dd / 2;
    if cos.dims() != sin.dims() {
        bail!(
            "{op}: cos and sin shapes differ: {:?} vs {:?}",
            cos.shape(),
            sin.shape()
        )
    }
    let table_sb = match *cos.dims() {
        [tb, tt, th] if tb == b && tt == t && th == half => t * half,
        [1, tt, th] | [tt, th] if tt == t && th == half => 0,
        _ => bail!(
            "{op}: cos / sin must be [B, T, D/2] = [{b}, {t}, {half}] (or [T, D/2] = [{t}, {half}] \
             for every row), got {:?} for x of shape {:?}",
            cos.shape(),
            x.shape()
        ),
    };
    for (name, tab) in [("cos", cos), ("sin", sin)] {
        op::check_float(op, name, tab)?;
        if !tab.device().same_device(x.device()) {
            bail!("{op}: {name} and x are on different devices")
        }
    }
    Ok(Geom {
        b,
        t,
        h,
        half,
        table_sb,
    })
}

/// A table `[B, T, d]`, `[1, T, d]` or `[T, d]` as `cat(tab, tab)` of shape `[B | 1, 1, T, 2d]`
/// in `dt`, to broadcast over `[B, H, T, D]`.
fn full_table(tab: &Tensor, dt: DType) -> Result<Tensor> {
    let tab = tab.to_dtype(dt)?;
    let tab = if tab.rank() == 2 {
        tab.unsqueeze(0)?
    } else {
        tab
    };
    Tensor::cat(&[&tab, &tab], 2)?.unsqueeze(1)
}

/// `cat(-x[.., d:], x[.., :d])` over the last dim of `x [.., 2d]`.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)? / 2;
    Tensor::cat(
        &[
            &x.narrow(D::Minus1, d, d)?.neg()?,
            &x.narrow(D::Minus1, 0, d)?,
        ],
        D::Minus1,
    )
}

/// `[B, H, T, D]` from `x [B, T, H, D]`: transformers' expression, in f32 (f64 for f64).
fn composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dt = x.dtype();
    let acc = acc_dtype(dt);
    let (c, s) = (full_table(cos, acc)?, full_table(sin, acc)?);
    let x = x.to_dtype(acc)?.transpose(1, 2)?;
    let y = (x.broadcast_mul(&c)? + rotate_half(&x)?.broadcast_mul(&s)?)?;
    y.contiguous()?.to_dtype(dt)
}

/// `dx [B, T, H, D]` from `dy [B, H, T, D]` by composite ops on detached tensors (devices
/// without a kernel): `dy * cos - rotate_half(dy) * sin`, transposed back.
fn composite_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor, dt: DType) -> Result<Tensor> {
    let acc = acc_dtype(dt);
    let (c, s) = (full_table(cos, acc)?, full_table(sin, acc)?);
    let dy = dy.detach().to_dtype(acc)?;
    let dx = (dy.broadcast_mul(&c)? - rotate_half(&dy)?.broadcast_mul(&s)?)?;
    dx.transpose(1, 2)?.contiguous()?.to_dtype(dt)
}

/// Row starts of the kernel's input `x` `[B, T, H, D]` from its layout.
fn x_view(l: &Layout) -> Result<cpu::View> {
    match l.stride() {
        &[sb, st, sh, 1] => Ok(cpu::View {
            off: l.start_offset(),
            sb,
            st,
            sh,
        }),
        s => bail!("candle-fused: rope kernel input needs a unit last stride, got strides {s:?}"),
    }
}

/// The op on `x`; the tables (detached, contiguous, in the accumulation dtype) are its
/// constants.
struct RopeOp {
    g: Geom,
    cos: Tensor,
    sin: Tensor,
    /// Forward and backward run the Triton kernels (CUDA, `rope/cuda.rs`; the tables are then
    /// `[TB, T, D/2]` f32, aligned).
    triton: bool,
}

impl Kernel for RopeOp {
    fn name(&self) -> &'static str {
        "candle-fused-rope"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let (s, l) = ins[0];
        let (g, xv) = (&self.g, x_view(l)?);
        let y = cpu::dispatch!(s.dtype(), T => {
            let x = T::slice(s)?;
            cpu::with_slice::<<T as Elem>::Acc, _>(&self.cos, |c| {
                cpu::with_slice::<<T as Elem>::Acc, _>(&self.sin, |sn| {
                    Ok(T::storage(kernel::forward::<T>(g, &xv, x, c, sn)))
                })
            })?
        });
        Ok((y, Shape::from((g.b, g.h, g.t, 2 * g.half))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        cuda::fwd(ins[0], &self.g, &self.cos, &self.sin)
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let x = ins[0];
        let g = &self.g;
        // the tables are constants and x the op's only input: its gradient is all there is
        op::triton_path!(
            self.triton,
            self.name(),
            Ok([
                Some(cuda::bwd(dy, g, &self.cos, &self.sin, x.dtype())?),
                None,
                None,
            ])
        );
        if !(cpu::has_kernel(x) && dy.device().is_cpu()) {
            return Ok([
                Some(composite_bwd(dy, &self.cos, &self.sin, x.dtype())?),
                None,
                None,
            ]);
        }
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let dx = cpu::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&dy, |dys| {
                cpu::with_slice::<<T as Elem>::Acc, _>(&self.cos, |c| {
                    cpu::with_slice::<<T as Elem>::Acc, _>(&self.sin, |sn| {
                        cpu::tensor(kernel::backward::<T>(g, dys, c, sn), x.shape())
                    })
                })
            })?
        });
        Ok([Some(dx), None, None])
    }
}
