//! A LoRA linear layer, `y = x W + bias + scale · (dropout(x) Aᵀ) Bᵀ`, as one differentiable
//! op that trains the adapter (`A`, `B`) and passes gradients to `x`, with the base weight
//! **frozen**.
//!
//! # The base weight and bias are frozen
//!
//! `w` and `bias` are **not inputs of the op**: the op holds them (cheap handles on the same
//! storage) and **never computes their gradients**. Passing a [`Var`](candle_core::Var) as `w`
//! or `bias` gives it **no gradient** (`grads.get(&w)` is `None`), silently: that is the point
//! (LoRA fine-tuning), and it saves the `xᵀ dy` GEMM of `dW` and the `[in, out]` gradient
//! buffer. To train the base weight too, use [`linear`](crate::linear::linear) plus an adapter
//! of plain ops. The op's graph inputs are `x`, `a` and `b`; the backward computes only the
//! gradients whose input records a graph (`x` may be an untracked input, e.g. token embeddings
//! of a frozen model).
//!
//! # Computation
//!
//! With `u = dropout(x)` (`[N, in]`, `N` the rows of `x`), `h = u Aᵀ` (`[N, r]`) and `dy` the
//! upstream gradient:
//!
//! ```text
//! forward:  y  = x W + bias + (scale h) Bᵀ           one [N, out] buffer: bias rows, += x W, += (scale h) Bᵀ
//! backward: t  = scale · dy B                        [N, r]
//!           dx = dy Wᵀ + dropout_bwd(t A)            one [N, in] buffer: masked t A, += dy Wᵀ
//!           dA = tᵀ u                                u regenerated from the key
//!           dB = scale · dyᵀ h                       h saved by the forward
//! ```
//!
//! Every product is a GEMM of [`linear`]'s (split over the output, never over the
//! summed dimension: the same bits on any thread count). The forward saves only `h` (`[N, r]`,
//! small); the dropout mask is never stored: the backward regenerates it from the key, as
//! [`dropout`](crate::dropout::dropout) does.
//!
//! **Dropout** applies to the adapter's input only, as in PEFT (`base(x) + B(A(dropout(x))) ·
//! scale`): element `i` of `x` (flat row-major index) is dropped iff `key.uniform(i) < p`,
//! exactly the mask of [`dropout`](crate::dropout::dropout)`(x, p, key)`, kept elements scaled
//! by `1 / (1 - p)` rounded to the dtype; `u` is rounded to the dtype as that op rounds it.
//!
//! **Precision**: f32 and f64 compute in their own type. bf16 and f16 accumulate in f32: the
//! forward keeps `x W + bias` and `h` in f32 and rounds `y` once; `h` is saved in f32 (for
//! `dB`: `[N, r]`, small); `t` stays in f32, `dx` is summed in one f32 buffer and rounded once,
//! `dA` and `dB` are rounded once. What is rounded to the dtype: the inputs, `u` (as the
//! dropout op rounds it) and the upstream gradient. The bf16 GEMMs over the big operands (`x W`, `dy Wᵀ`, `u Aᵀ`)
//! run on bf16 directly where the CPU has AVX512-BF16, as in `linear`.
//!
//! On devices without a kernel (and under [`with_composite_fallback`](crate::with_composite_fallback))
//! the output is [`lora_linear_composite`]'s expression on detached inputs, attached through the
//! same op (which saves `h` the same way), and the backward the same formulas from plain ops.

use std::borrow::Cow;

use crate::cpu::{self, Elem, Real};
use crate::dropout;
use crate::linear::gemm::{gemm_new, gemm_raw, narrow, operand, widen, Operand};
use crate::linear::{self, strided, Strided};
use crate::op::{self, cpu_of, Grads, In, Kernel, Saved};
use crate::philox::RngKey;
use crate::pool;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Result, Shape, Tensor};

mod base;
use base::{rows_of, tr, BaseRef};
pub(crate) use base::{Base, Dims};

/// LoRA linear: `x [.., in] · w [in, out] + bias [out] + scale · (dropout(x) · aᵀ) · bᵀ`,
/// `[.., out]`, with `a [r, in]` and `b [out, r]` in PEFT's layout (`lora_A.weight`,
/// `lora_B.weight`) and `scale` typically `lora_alpha / r`.
///
/// **`w` and `bias` are frozen: they get no gradient, even when they are `Var`s** (see the
/// [module docs](self)). Gradients flow to `x`, `a` and `b` (those that record a graph).
///
/// `w` may be any 2-D view, read in place through its strides (pass `w_out_in.t()` for a
/// candle-nn `[out, in]` weight), as for [`linear`](crate::linear::linear). `a` and `b` may be
/// strided too. All tensors share one float dtype and device.
///
/// `dropout`: `Some((p, key))` drops elements of the adapter's input (not of the base path)
/// with probability `p` in `[0, 1)`, keyed like [`dropout`](crate::dropout::dropout)`(x, p,
/// key)`; `None` or `p == 0` means no dropout.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_fused::{lora::lora_linear, RngKey};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 8), &dev)?;
/// let w = Var::randn(0f32, 1.0, (5, 8), &dev)?; // frozen base weight, [out, in]
/// let a = Var::randn(0f32, 0.1, (4, 8), &dev)?; // lora_A.weight [r, in]
/// let b = Var::zeros((5, 4), DType::F32, &dev)?; // lora_B.weight [out, r]
/// let y = lora_linear(&x, &w.t()?, None, &a, &b, 2.0, Some((0.1, RngKey::new(7, 3))))?;
/// assert_eq!(y.dims(), &[2, 3, 5]);
/// let g = y.sum_all()?.backward()?;
/// assert!(g.get(&w).is_none()); // frozen
/// assert_eq!(g.get(&a).unwrap().dims(), &[4, 8]);
/// assert_eq!(g.get(&b).unwrap().dims(), &[5, 4]);
/// assert_eq!(g.get(&x).unwrap().dims(), &[2, 3, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<(f32, RngKey)>,
) -> Result<Tensor> {
    let dims = check(x, w, bias, a, b, dropout)?;
    let x = x.contiguous()?;
    let drop = dropout.filter(|&(p, _)| p > 0.0);
    if has_kernel(&x, dims) {
        return apply_kernel(&x, Base::Dense(w.detach()), bias, (a, b), scale, drop, dims);
    }
    let op = LoraOp {
        dims,
        scale,
        drop,
        kernel: false,
        base: Base::Dense(w.detach()),
        bias: bias.map(|t| t.detach().contiguous()).transpose()?,
        h: Saved::default(),
    };
    {
        let (y, h) = composite(
            &x.detach(),
            &w.detach(),
            bias.map(Tensor::detach).as_ref(),
            &a.detach(),
            &b.detach(),
            scale,
            drop,
        )?;
        op.h.set(h);
        op::apply(op, &[&x, a, b], None, Some(y))
    }
}

/// Whether the CPU kernel takes a call: `x` (contiguous) on the CPU in a kernel dtype, with
/// something to compute.
pub(crate) fn has_kernel(x: &Tensor, dims: Dims) -> bool {
    cpu::has_kernel(x) && x.elem_count() > 0 && dims.n_out > 0
}

/// The op over `base` run by the CPU kernel ([`has_kernel`] holds for the contiguous `x`):
/// the base product and the adapter in one output buffer, `h` saved.
pub(crate) fn apply_kernel(
    x: &Tensor,
    base: Base,
    bias: Option<&Tensor>,
    (a, b): (&Tensor, &Tensor),
    scale: f64,
    drop: Option<(f32, RngKey)>,
    dims: Dims,
) -> Result<Tensor> {
    let op = LoraOp {
        dims,
        scale,
        drop,
        kernel: true,
        base,
        bias: bias.map(|t| t.detach().contiguous()).transpose()?,
        h: Saved::default(),
    };
    op::apply(op, &[x, a, b], None, None)
}

/// The composite reference of [`lora_linear`], from plain differentiable Candle ops:
/// `linear_composite(x, w, bias) + scale · dropout_composite(x, p, key).matmul(aᵀ).matmul(bᵀ)`
/// (`x` flattened to 2-D). The same dropout mask as the fused op, bit for bit.
///
/// Unlike [`lora_linear`], this is an ordinary Candle expression: a `Var` passed as `w` or
/// `bias` **does** get a gradient here (detach them to freeze them).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::{lora::{lora_linear, lora_linear_composite}, RngKey};
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f64, 1.0, (3, 6), &dev)?;
/// let w = Tensor::randn(0f64, 1.0, (6, 5), &dev)?;
/// let (a, b) = (Tensor::randn(0f64, 1.0, (2, 6), &dev)?, Tensor::randn(0f64, 1.0, (5, 2), &dev)?);
/// let drop = Some((0.3, RngKey::new(1, 2)));
/// let y = lora_linear(&x, &w, None, &a, &b, 0.5, drop)?;
/// let r = lora_linear_composite(&x, &w, None, &a, &b, 0.5, drop)?;
/// assert!((y - r)?.abs()?.max_all()?.to_scalar::<f64>()? < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn lora_linear_composite(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<(f32, RngKey)>,
) -> Result<Tensor> {
    check(x, w, bias, a, b, dropout)?;
    let drop = dropout.filter(|&(p, _)| p > 0.0);
    Ok(composite(x, w, bias, a, b, scale, drop)?.0)
}

fn check(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    dropout: Option<(f32, RngKey)>,
) -> Result<Dims> {
    let (n_in, n_out) = linear::check(x, w, bias)?;
    let r = check_adapter("lora_linear", x, a, b, n_in, n_out)?;
    if let Some(bias) = bias {
        if !bias.device().same_device(x.device()) {
            bail!("candle-fused lora_linear: bias and input are on different devices");
        }
    }
    if let Some((p, _)) = dropout {
        dropout::check_p(p)?;
    }
    Ok(Dims { n_in, n_out, r })
}

/// Checks the adapter pair of `op` (`lora_linear`, `qlora_linear`) over a base of `n_in -> n_out`:
/// `a` (`lora_A`) `[r, n_in]` with `r >= 1`, `b` (`lora_B`) `[n_out, r]`, both of `x`'s dtype and
/// on its device. Returns the rank `r`.
pub(crate) fn check_adapter(
    op: &str,
    x: &Tensor,
    a: &Tensor,
    b: &Tensor,
    n_in: usize,
    n_out: usize,
) -> Result<usize> {
    let r = match a.dims() {
        [r, i] if *i == n_in && *r > 0 => *r,
        d => bail!("candle-fused {op}: a (lora_A) must be [r, in] = [r >= 1, {n_in}], got {d:?}"),
    };
    if b.dims() != [n_out, r] {
        bail!(
            "candle-fused {op}: b (lora_B) must be [out, r] = [{n_out}, {r}], got {:?}",
            b.dims()
        );
    }
    for (name, t) in [("a (lora_A)", a), ("b (lora_B)", b)] {
        linear::check_input_dtype(op, name, t, x)?;
        if !t.device().same_device(x.device()) {
            bail!("candle-fused {op}: {name} and input are on different devices");
        }
    }
    Ok(r)
}

/// The composite expression: `(y, h)` with `h = dropout(x) aᵀ` (`[N, r]`).
fn composite(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    drop: Option<(f32, RngKey)>,
) -> Result<(Tensor, Tensor)> {
    let base = linear::linear_composite(x, w, bias)?;
    let u = match drop {
        Some((p, key)) => dropout::dropout_composite(x, p, key)?,
        None => x.clone(),
    };
    let h = u.reshape(((), a.dim(1)?))?.matmul(&a.t()?)?;
    let adapter = h.matmul(&b.t()?)?.affine(scale, 0.0)?;
    let adapter = adapter.reshape(base.shape())?;
    let y = (base + adapter)?;
    Ok((y, h))
}

/// The op on `(x, a, b)`; holds the frozen `w` and `bias`, and `h` between forward and
/// backward.
struct LoraOp {
    dims: Dims,
    scale: f64,
    /// `(p, key)` with `p > 0`, or none.
    drop: Option<(f32, RngKey)>,
    /// Whether the forward ran the CPU kernel (else the composite, and the backward follows).
    kernel: bool,
    base: Base,
    bias: Option<Tensor>,
    /// `h = dropout(x) aᵀ`, `[N, r]`: in the accumulation type (f32 for 16-bit inputs) from
    /// the kernel, in the input dtype from the fallback.
    h: Saved,
}

impl Kernel for LoraOp {
    fn name(&self) -> &'static str {
        "candle-fused-lora-linear"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sx, lx), (sa, la), (sb, lb)) = (ins[0], ins[1], ins[2]);
        let Dims { n_in, n_out, r } = self.dims;
        let shape = linear::out_shape(lx, n_out);
        let guard = self.base.dense().map(Tensor::storage_and_layout);
        let bias = self.bias.as_ref().map(Tensor::storage_and_layout);
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let bs = match &bias {
                Some((s, l)) => Some(cpu::contiguous::<T>(cpu_of(s)?, l)?),
                None => None,
            };
            let y = self.base.host::<T, _>(&guard)?.fwd_acc(xs, bs, self.dims)?;
            let a = strided::<T>(sa, la)?;
            let b = strided::<T>(sb, lb)?;
            let rows = xs.len() / n_in;
            let (y, h) = fwd_kernel(xs, y, a, b, self.scale, self.drop, self.dims);
            self.h.set(Tensor::from_vec(h, (rows, r), &candle_core::Device::Cpu)?);
            Ok((T::storage(y), shape))
        })
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (x, a, b) = (ins[0], ins[1], ins[2]);
        let need = [x.track_op(), a.track_op(), b.track_op()];
        let h = self.h.get()?;
        if !(self.kernel && cpu::has_kernel(x) && dy.device().is_cpu()) {
            return self.composite_bwd(x, a, b, &h, dy, need);
        }
        let x = x.contiguous()?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let h = h.contiguous()?;
        let Dims { n_in, n_out, r } = self.dims;
        let guard = self.base.dense().map(Tensor::storage_and_layout);
        let (sa, la) = a.storage_and_layout();
        let (sb, lb) = b.storage_and_layout();
        cpu::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&x, |xs| {
                cpu::with_slice::<T, _>(&dy, |dys| {
                    cpu::with_slice::<<T as Elem>::Acc, _>(&h, |hs| {
                        let ops = Operands {
                            w: self.base.host::<T, _>(&guard)?,
                            a: strided::<T>(cpu_of(&sa)?, la)?,
                            b: strided::<T>(cpu_of(&sb)?, lb)?,
                        };
                        let [dx, da, db] =
                            bwd_kernel(xs, hs, dys, ops, self.scale, self.drop, self.dims, need)?;
                        Ok([
                            dx.map(|v| cpu::tensor(v, x.shape())).transpose()?,
                            da.map(|v| cpu::tensor(v, (r, n_in))).transpose()?,
                            db.map(|v| cpu::tensor(v, (n_out, r))).transpose()?,
                        ])
                    })
                })
            })
        })
    }
}

impl LoraOp {
    /// The gradients from plain ops on detached tensors (devices without a kernel).
    fn composite_bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        h: &Tensor,
        dy: &Tensor,
        need: [bool; 3],
    ) -> Result<Grads> {
        let Dims { n_in, n_out, .. } = self.dims;
        let (a, b) = (a.detach(), b.detach());
        let g = dy.detach().to_dtype(x.dtype())?.reshape(((), n_out))?;
        let t = if need[0] || need[1] {
            Some(g.matmul(&b)?.affine(self.scale, 0.0)?)
        } else {
            None
        };
        let mut grads: Grads = [None, None, None];
        if let (true, Some(t)) = (need[0], &t) {
            let adapter = t.matmul(&a)?;
            let adapter = match self.drop {
                // The mask of the element's flat index in x, as in the forward.
                Some((p, key)) => dropout::dropout_composite(&adapter, p, key)?,
                None => adapter,
            };
            grads[0] = Some((self.base.dx_composite(&g)? + adapter)?.reshape(x.shape())?);
        }
        if let (true, Some(t)) = (need[1], &t) {
            let x2 = x.detach().reshape(((), n_in))?;
            let u = match self.drop {
                Some((p, key)) => dropout::dropout_composite(&x2, p, key)?,
                None => x2,
            };
            grads[1] = Some(t.t()?.matmul(&u)?);
        }
        if need[2] {
            let h = h.detach().to_dtype(g.dtype())?;
            grads[2] = Some(g.t()?.matmul(&h)?.affine(self.scale, 0.0)?);
        }
        Ok(grads)
    }
}

/// `v` times `s`, in place.
fn scale_in_place<A: Real>(v: &mut [A], s: f64) {
    let s = A::c(s);
    for x in v {
        *x *= s;
    }
}

/// The forward over the base product `y = x W (+ bias)` (in the accumulation type): `(y, h)`,
/// `y [N, out]` rounded once from the accumulation type and `h [N, r]` in the accumulation
/// type (saved for the backward).
fn fwd_kernel<T: Elem>(
    x: &[T],
    mut y: Vec<T::Acc>,
    (a, sa): (&[T], Strided),
    (b, sb): (&[T], Strided),
    scale: f64,
    dp: Option<(f32, RngKey)>,
    Dims { n_in, n_out, r }: Dims,
) -> (Vec<T>, Vec<T::Acc>) {
    let rows = x.len() / n_in;
    let threads = pool::parts();
    // h = u aᵀ, u = dropout(x) (rounded to T, as the dropout op rounds it).
    // (The masked copy of x lives only for this GEMM.)
    let h = {
        let u: Cow<'_, [T]> = match dp {
            Some((p, key)) => Cow::Owned(dropout::masked(x, p, key)),
            None => Cow::Borrowed(x),
        };
        let (ua, aa) = (operand(&u), operand(a));
        gemm_new(rows, r, n_in, (&ua, rows_of(n_in)), (&aa, tr(sa)), threads)
    };
    // y += (scale h) bᵀ, in the accumulation type (r is small: widening b costs nothing).
    let mut hs = h.clone();
    scale_in_place(&mut hs, scale);
    let (hs, bw) = (Operand::Acc(Cow::Owned(hs)), Operand::Acc(widen(b)));
    assert_eq!(y.len(), rows * n_out);
    // SAFETY: `y` holds rows x n_out initialised elements, exclusively borrowed.
    unsafe {
        gemm_raw(
            rows,
            n_out,
            r,
            y.as_mut_ptr(),
            true,
            (&hs, rows_of(r)),
            (&bw, tr(sb)),
            threads,
        )
    };
    (narrow(y), h)
}

/// The frozen base and the strided adapter matrices of the backward.
struct Operands<'a, T> {
    w: BaseRef<'a, T>,
    a: (&'a [T], Strided),
    b: (&'a [T], Strided),
}

/// The backward: `[dx, da, db]`, each computed only where `need` says.
#[allow(clippy::too_many_arguments)]
fn bwd_kernel<T: Elem>(
    x: &[T],
    h: &[T::Acc],
    dy: &[T],
    Operands {
        w,
        a: (a, sa),
        b: (b, sb),
    }: Operands<'_, T>,
    scale: f64,
    dp: Option<(f32, RngKey)>,
    dims: Dims,
    need: [bool; 3],
) -> Result<[Option<Vec<T>>; 3]> {
    let Dims { n_in, n_out, r } = dims;
    let rows = dy.len() / n_out;
    let threads = pool::parts();
    let g = operand(dy);
    // t = scale · dy b, [N, r], kept in the accumulation type.
    let t = (need[0] || need[1]).then(|| {
        let ba = operand(b);
        let mut t = gemm_new(rows, r, n_out, (&g, rows_of(n_out)), (&ba, sb), threads);
        scale_in_place(&mut t, scale);
        Operand::Acc(Cow::Owned(t))
    });
    let dx = match (&t, need[0]) {
        (Some(t), true) => {
            // dx = dropout_bwd(t a) + dy Wᵀ, in one buffer of the accumulation type.
            let aa = Operand::Acc(widen(a));
            let mut dx = gemm_new(rows, n_in, r, (t, rows_of(r)), (&aa, sa), threads);
            if let Some((p, key)) = dp {
                dropout::apply_mask_acc::<T>(&mut dx, p, key);
            }
            w.add_dx(&mut dx, &g, dims)?;
            Some(narrow(dx))
        }
        _ => None,
    };
    let da = match (&t, need[1]) {
        (Some(t), true) => {
            // da = tᵀ u, u = dropout(x) regenerated from the key (rounded to T as forward).
            let u: Cow<'_, [T]> = match dp {
                Some((p, key)) => Cow::Owned(dropout::masked(x, p, key)),
                None => Cow::Borrowed(x),
            };
            let ua = Operand::Acc(widen(&u));
            let tt = Strided { rs: 1, cs: r };
            Some(narrow(gemm_new(
                r,
                n_in,
                rows,
                (t, tt),
                (&ua, rows_of(n_in)),
                threads,
            )))
        }
        _ => None,
    };
    let db = need[2].then(|| {
        // db = scale · dyᵀ h, h in the accumulation type (dy widened for 16-bit types).
        let (g, ha) = (Operand::Acc(widen(dy)), Operand::Acc(Cow::Borrowed(h)));
        let gt = Strided { rs: 1, cs: n_out };
        let mut db = gemm_new(n_out, r, rows, (&g, gt), (&ha, rows_of(r)), threads);
        scale_in_place(&mut db, scale);
        narrow(db)
    });
    Ok([dx, da, db])
}
