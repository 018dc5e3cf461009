//! Scaled dot-product self-attention for training, flash-style.
//!
//! [`attention_qkv`] takes GPT-2's fused projection `[B, T, 3C]` and reads q, k, v in place
//! (no transposes, no copies); [`attention`] takes `[B, H, T, D]` tensors. Both run one CPU
//! kernel written over strides:
//!
//! * **forward**: per `(batch, head)` and block of 32 query rows, a loop over blocks of 64 keys
//!   with the *online softmax* (running max `m_i`, running sum `l_i`, rescaled accumulator), so
//!   no `T x T` tensor ever exists (a thread holds at most a query-block x key-block tile);
//!   causal key blocks above the diagonal are skipped. It saves the output and the per-row
//!   log-sum-exp `L_i = m_i + ln l_i` (f32, or f64 for f64 inputs).
//! * **backward** (FlashAttention-2): `D_i = <dO_i, O_i>`, `P_ij = exp(s_ij - L_i)` recomputed
//!   block by block, `dV_j += P_ij Z_ij dO_i`, `dS_ij = P_ij (Z_ij <dO_i, v_j> - D_i)`,
//!   `dQ_i += scale dS_ij k_j`, `dK_j += scale dS_ij q_i`; one task per `(batch, head)`, which
//!   owns its gradient rows: deterministic for any thread count.
//!
//! **Memory**: between forward and backward the graph keeps the input (`qkv`, or `q`, `k`,
//! `v`), the output and `B * H * T` floats of log-sum-exp; nothing of size `T x T`.
//!
//! **Options** ([`AttentionConfig`]): causal masking (query `i` sees keys `0 ..= i + Tk - Tq`),
//! a scale (default `1 / sqrt(D)`), an additive `[Tq, Tk]` mask broadcast over batch and heads
//! (not differentiated) and dropout on the probabilities: element `((b * H + h) * Tq + i) * Tk
//! + j` of the `[B, H, Tq, Tk]` probability tensor is dropped iff `key.uniform(index) < p`,
//! kept ones are scaled by `1 / (1 - p)` (the softmax normaliser counts every weight).
//!
//! **Rows that see no key** (a mask row of only `-inf`, or causal with `Tq > Tk`): the fused
//! op (kernel and fallback) gives output 0, log-sum-exp `-inf` and zero gradients through the
//! row. The plain-softmax [`attention_composite`] gives NaN there (`-inf - -inf`). NaN in the
//! inputs propagates (the running max propagates NaN).
//!
//! On devices without a kernel (or inside [`crate::with_composite_fallback`]) the op computes the
//! same output and log-sum-exp with composite Candle ops on detached inputs and its backward
//! recomputes `P` from the log-sum-exp with composite ops (the `T x T` tensors exist only
//! transiently inside forward and backward).

mod composite;
mod kernel;

pub use composite::{attention_composite, attention_qkv_composite};
use composite::{fallback_backward, fallback_forward, merge_heads, split_heads};

use crate::cpu::{self, Elem};
use crate::gelu::FastMath;
use crate::op::{self, Grads, In, Kernel, Saved};
use crate::RngKey;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use kernel::{BwdInputs, Geom, Params, Ptr, View};

/// Options of [`attention`] / [`attention_qkv`].
#[derive(Clone, Debug)]
pub struct AttentionConfig {
    /// Query `i` sees keys `0 ..= i + Tk - Tq` only.
    pub causal: bool,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Additive mask `[Tq, Tk]` (any float dtype; `-inf` masks out), broadcast over batch and
    /// heads; not differentiated.
    pub mask: Option<Tensor>,
    /// Dropout probability on the attention probabilities, in `[0, 1)`.
    pub dropout: f32,
    /// Where the dropout mask comes from.
    pub key: RngKey,
}

impl AttentionConfig {
    /// Causal attention, default scale, no mask, no dropout.
    pub fn causal() -> Self {
        AttentionConfig {
            causal: true,
            scale: None,
            mask: None,
            dropout: 0.0,
            key: RngKey::new(0, 0),
        }
    }

    /// Non-causal (full) attention, default scale, no mask, no dropout.
    pub fn full() -> Self {
        AttentionConfig {
            causal: false,
            ..Self::causal()
        }
    }

    /// Sets causal masking on or off.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Dropout with probability `p` on the probabilities, drawn from `key`.
    pub fn with_dropout(mut self, p: f32, key: RngKey) -> Self {
        self.dropout = p;
        self.key = key;
        self
    }

    /// An additive `[Tq, Tk]` mask.
    pub fn with_mask(mut self, mask: Tensor) -> Self {
        self.mask = Some(mask);
        self
    }

    /// The score scale (instead of `1 / sqrt(head_dim)`).
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
}

/// The configuration checked against the shapes: scale resolved, mask detached, `[Tq, Tk]`,
/// contiguous, on the inputs' device, in the accumulation dtype.
#[derive(Clone, Debug)]
struct Resolved {
    causal: bool,
    scale: f64,
    mask: Option<Tensor>,
    dropout: f32,
    key: RngKey,
}

fn acc_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn resolve(cfg: &AttentionConfig, d: usize, tq: usize, tk: usize, x: &Tensor) -> Result<Resolved> {
    if !matches!(
        x.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) {
        bail!("attention: expected a float dtype, got {:?}", x.dtype())
    }
    if d == 0 {
        bail!("attention: head dimension must be positive")
    }
    let p = cfg.dropout;
    if !(0.0..1.0).contains(&p) {
        bail!("attention: dropout must be in [0, 1), got {p}")
    }
    let scale = cfg.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mask = match &cfg.mask {
        None => None,
        Some(m) => {
            let dims = m.dims();
            let n = dims.len();
            if n < 2
                || dims[n - 2] != tq
                || dims[n - 1] != tk
                || dims[..n - 2].iter().any(|&x| x != 1)
            {
                bail!(
                    "attention: mask must be [Tq, Tk] = [{tq}, {tk}], got {:?}",
                    m.shape()
                )
            }
            let m = m.detach().reshape((tq, tk))?.to_device(x.device())?;
            Some(m.to_dtype(acc_dtype(x.dtype()))?.contiguous()?)
        }
    };
    Ok(Resolved {
        causal: cfg.causal,
        scale,
        mask,
        dropout: p,
        key: cfg.key,
    })
}

/// `(B, H, Tq, Tk, D, Dv)` of `[B, H, Tq, D]`, `[B, H, Tk, D]`, `[B, H, Tk, Dv]`.
fn check_bhtd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let (b, h, tq, d) = q.dims4()?;
    let (bk, hk, tk, dk) = k.dims4()?;
    let (bv, hv, tv, dv) = v.dims4()?;
    if (bk, hk, dk) != (b, h, d) || (bv, hv, tv) != (b, h, tk) {
        bail!(
            "attention: expected q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv], got {:?}, {:?}, {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        )
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "attention: q, k, v dtypes differ: {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )
    }
    if !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        bail!("attention: q, k, v must be on the same device")
    }
    Ok((b, h, tq, tk, d, dv))
}

/// `(B, T, C, D)` of a `[B, T, 3C]` fused projection with `n_head` heads.
fn check_qkv(qkv: &Tensor, n_head: usize) -> Result<(usize, usize, usize, usize)> {
    let (b, t, c3) = qkv.dims3()?;
    if n_head == 0 || c3 % 3 != 0 || (c3 / 3) % n_head != 0 {
        bail!("attention_qkv: last dim {c3} must be 3 * n_head * head_dim with n_head = {n_head}")
    }
    Ok((b, t, c3 / 3, c3 / 3 / n_head))
}

/// The contiguous slice of a CPU storage guard.
fn slice<'a, T: Elem>(s: &'a Storage, l: &Layout) -> Result<&'a [T]> {
    match s {
        Storage::Cpu(c) => cpu::contiguous::<T>(c, l),
        _ => bail!("candle-fused: expected a CPU tensor"),
    }
}

fn params<'a, A: cpu::Real>(r: &Resolved, mask: Option<&'a [A]>) -> Params<'a, A> {
    Params {
        scale: A::c(r.scale),
        causal: r.causal,
        mask,
        dropout: r.dropout,
        key: r.key,
    }
}

/// Runs the forward kernel, stores the log-sum-exp in `saved`, returns the output storage.
fn kernel_fwd<T>(
    g: &Geom,
    r: &Resolved,
    (q, k, v): (&[T], &[T], &[T]),
    saved: &Saved,
) -> Result<CpuStorage>
where
    T: Elem,
    T::Acc: Elem + WithDType + FastMath,
{
    let len = g.b * g.h * g.tq * g.dv;
    let (out, lse) = match &r.mask {
        Some(m) => cpu::with_slice::<T::Acc, _>(m, |m| {
            Ok(kernel::forward::<T>(g, &params(r, Some(m)), q, k, v, len))
        })?,
        None => kernel::forward::<T>(g, &params(r, None), q, k, v, len),
    };
    saved.set(Tensor::from_vec(lse, (g.b, g.h, g.tq), &Device::Cpu)?);
    Ok(T::storage(out))
}

/// Runs the backward kernel. `ins` are the input tensors (one for qkv, three otherwise); the
/// gradients come back in one buffer per input, in the inputs' (contiguous) layouts.
fn kernel_bwd<T>(
    g: &Geom,
    r: &Resolved,
    ins: &[&Tensor],
    o: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
) -> Result<Vec<Vec<T>>>
where
    T: Elem,
    T::Acc: Elem + WithDType + FastMath,
{
    let dout = dout.contiguous()?;
    let lse = lse.to_dtype(<T::Acc as Elem>::DTYPE)?.contiguous()?;
    let guards: Vec<_> = ins.iter().map(|t| t.storage_and_layout()).collect();
    let sl: Vec<&[T]> = guards
        .iter()
        .map(|(s, l)| slice::<T>(s, l))
        .collect::<Result<_>>()?;
    let (og, ol) = o.storage_and_layout();
    let (dg, dl) = dout.storage_and_layout();
    let (lg, ll) = lse.storage_and_layout();
    let (q, k, v) = if sl.len() == 1 {
        (sl[0], sl[0], sl[0])
    } else {
        (sl[0], sl[1], sl[2])
    };
    let x = BwdInputs {
        q,
        k,
        v,
        o: slice::<T>(&og, ol)?,
        dout: slice::<T>(&dg, dl)?,
        lse: slice::<T::Acc>(&lg, ll)?,
    };
    if x.o.len() != g.b * g.h * g.tq * g.dv
        || x.dout.len() != x.o.len()
        || x.lse.len() != g.b * g.h * g.tq
    {
        bail!("candle-fused: attention backward got inconsistent shapes")
    }
    let mut grads: Vec<Vec<T>> = sl
        .iter()
        .map(|s| vec![T::from_acc(<T::Acc as cpu::Real>::ZERO); s.len()])
        .collect();
    let ptrs: Vec<Ptr<T>> = grads.iter_mut().map(|gr| Ptr::new(gr)).collect();
    let (pq, pk, pv) = if ptrs.len() == 1 {
        (ptrs[0], ptrs[0], ptrs[0])
    } else {
        (ptrs[0], ptrs[1], ptrs[2])
    };
    match &r.mask {
        Some(m) => cpu::with_slice::<T::Acc, _>(m, |m| {
            kernel::backward::<T>(g, &params(r, Some(m)), &x, pq, pk, pv);
            Ok(())
        })?,
        None => kernel::backward::<T>(g, &params(r, None), &x, pq, pk, pv),
    }
    Ok(grads)
}

/// Whether `bwd` can run the kernel on these tensors.
fn bwd_kernel(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| cpu::has_kernel(t))
}

/// The fused op on a `[B, T, 3C]` projection.
struct QkvOp {
    g: Geom,
    r: Resolved,
    saved: Saved,
}

impl Kernel for QkvOp {
    fn name(&self) -> &'static str {
        "candle-fused-attention-qkv"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let (s, l) = ins[0];
        let g = &self.g;
        let out = cpu::dispatch!(s.dtype(), T => {
            let x = cpu::contiguous::<T>(s, l)?;
            kernel_fwd::<T>(g, &self.r, (x, x, x), &self.saved)?
        });
        Ok((out, Shape::from((g.b, g.tq, g.h * g.dv))))
    }

    fn bwd(&self, ins: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Grads> {
        let qkv = ins[0];
        let lse = self.saved.get()?;
        let g = &self.g;
        if bwd_kernel(&[qkv, res, grad]) {
            let qkv = qkv.contiguous()?;
            let dqkv = cpu::dispatch!(qkv.dtype(), T => {
                let mut gs = kernel_bwd::<T>(g, &self.r, &[&qkv], res, grad, &lse)?;
                cpu::tensor(gs.remove(0), qkv.shape())?
            });
            return Ok([Some(dqkv), None, None]);
        }
        let (q, k, v) = split_heads(qkv, g.h)?;
        let split = |t: &Tensor| t.reshape((g.b, g.tq, g.h, g.dv))?.transpose(1, 2);
        let (dq, dk, dv) =
            fallback_backward((&q, &k, &v), &split(res)?, &split(grad)?, &lse, &self.r)?;
        let dqkv = Tensor::cat(
            &[merge_heads(&dq)?, merge_heads(&dk)?, merge_heads(&dv)?],
            2,
        )?;
        Ok([Some(dqkv), None, None])
    }
}

/// The fused op on `[B, H, T, D]` tensors.
struct BhtdOp {
    g: Geom,
    r: Resolved,
    saved: Saved,
}

impl Kernel for BhtdOp {
    fn name(&self) -> &'static str {
        "candle-fused-attention"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sq, lq), (sk, lk), (sv, lv)) = (ins[0], ins[1], ins[2]);
        let g = &self.g;
        let out = cpu::dispatch!(sq.dtype(), T => {
            let q = cpu::contiguous::<T>(sq, lq)?;
            let k = cpu::contiguous::<T>(sk, lk)?;
            let v = cpu::contiguous::<T>(sv, lv)?;
            kernel_fwd::<T>(g, &self.r, (q, k, v), &self.saved)?
        });
        Ok((out, Shape::from((g.b, g.h, g.tq, g.dv))))
    }

    fn bwd(&self, ins: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Grads> {
        let (q, k, v) = (ins[0], ins[1], ins[2]);
        let lse = self.saved.get()?;
        if bwd_kernel(&[q, k, v, res, grad]) {
            let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
            let (dq, dk, dv) = cpu::dispatch!(q.dtype(), T => {
                let ins = [&q, &k, &v];
                let mut gs = kernel_bwd::<T>(&self.g, &self.r, &ins, res, grad, &lse)?.into_iter();
                let mut next = |t: &Tensor| match gs.next() {
                    Some(gr) => cpu::tensor(gr, t.shape()),
                    None => bail!("candle-fused: missing attention gradient"),
                };
                (next(&q)?, next(&k)?, next(&v)?)
            });
            return Ok([Some(dq), Some(dk), Some(dv)]);
        }
        let (dq, dk, dv) = fallback_backward((q, k, v), res, grad, &lse, &self.r)?;
        Ok([Some(dq), Some(dk), Some(dv)])
    }
}

/// Fused causal self-attention on GPT-2's fused projection `qkv` `[B, T, 3C]` (q | k | v along
/// the last dim, head `h` of q at columns `h * D .. (h + 1) * D`, `D = C / n_head`); returns
/// `[B, T, C]` with the heads interleaved back (what `y.transpose(1, 2).reshape((B, T, C))`
/// gives). The kernel reads q, k, v in place and the backward returns `dqkv` in one buffer.
/// The graph keeps `qkv`, the output and `B * n_head * T` floats of log-sum-exp.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::attention::{attention_qkv, AttentionConfig};
/// let qkv = Var::from_tensor(&Tensor::randn(0f32, 1., (2, 7, 3 * 16), &Device::Cpu)?)?;
/// let cfg = AttentionConfig::causal().with_dropout(0.1, candle_fused::RngKey::new(1, 0));
/// let y = attention_qkv(qkv.as_tensor(), 4, &cfg)?;
/// assert_eq!(y.dims(), &[2, 7, 16]);
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&qkv).unwrap().dims(), &[2, 7, 48]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_qkv(qkv: &Tensor, n_head: usize, cfg: &AttentionConfig) -> Result<Tensor> {
    let (b, t, c, d) = check_qkv(qkv, n_head)?;
    let r = resolve(cfg, d, t, t, qkv)?;
    let g = Geom {
        b,
        h: n_head,
        tq: t,
        tk: t,
        d,
        dv: d,
        q: View::interleaved(0, t, 3 * c, d),
        k: View::interleaved(c, t, 3 * c, d),
        v: View::interleaved(2 * c, t, 3 * c, d),
        o: View::interleaved(0, t, c, d),
    };
    let op = QkvOp {
        g,
        r,
        saved: Saved::default(),
    };
    if cpu::has_kernel(qkv) {
        return op::apply(op, &[&qkv.contiguous()?], None, None);
    }
    let (q, k, v) = split_heads(&qkv.detach(), n_head)?;
    let (out, lse) = fallback_forward(&q, &k, &v, &op.r)?;
    op.saved.set(lse);
    op::apply(op, &[qkv], None, Some(merge_heads(&out)?))
}

/// Fused scaled dot-product attention on `q` `[B, H, Tq, D]`, `k` `[B, H, Tk, D]`, `v`
/// `[B, H, Tk, Dv]` -> `[B, H, Tq, Dv]` (causal: query `i` sees keys `0 ..= i + Tk - Tq`).
/// Same kernel as [`attention_qkv`]; the graph keeps `q`, `k`, `v`, the output and
/// `B * H * Tq` floats of log-sum-exp.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::attention::{attention, AttentionConfig};
/// let q = Tensor::randn(0f32, 1., (1, 2, 3, 8), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1., (1, 2, 5, 8), &Device::Cpu)?;
/// let v = Tensor::randn(0f32, 1., (1, 2, 5, 4), &Device::Cpu)?;
/// let y = attention(&q, &k, &v, &AttentionConfig::full().with_scale(0.5))?;
/// assert_eq!(y.dims(), &[1, 2, 3, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &AttentionConfig) -> Result<Tensor> {
    let (b, h, tq, tk, d, dv) = check_bhtd(q, k, v)?;
    let r = resolve(cfg, d, tq, tk, q)?;
    let g = Geom {
        b,
        h,
        tq,
        tk,
        d,
        dv,
        q: View::bhtd(h, tq, d),
        k: View::bhtd(h, tk, d),
        v: View::bhtd(h, tk, dv),
        o: View::bhtd(h, tq, dv),
    };
    let op = BhtdOp {
        g,
        r,
        saved: Saved::default(),
    };
    if cpu::has_kernel(q) && cpu::has_kernel(k) && cpu::has_kernel(v) {
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        return op::apply(op, &[&q, &k, &v], None, None);
    }
    let (out, lse) = fallback_forward(q, k, v, &op.r)?;
    op.saved.set(lse);
    op::apply(op, &[q, k, v], None, Some(out))
}
