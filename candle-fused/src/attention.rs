//! Scaled dot-product attention for training, flash-style.
//!
//! [`attention_qkv`] takes GPT-2's fused projection `[B, T, 3C]` and reads q, k, v in place
//! (no transposes, no copies); [`attention`] takes `q` `[B, H, Tq, D]`, `k` `[B, KV, Tk, D]`,
//! `v` `[B, KV, Tk, Dv]` (grouped-query attention when `KV < H`), and [`attention_merged`] the
//! same, returning the heads merged, `[B, Tq, H * Dv]` (what the output projection reads). All
//! run one CPU kernel written over strides:
//!
//! * **forward**: per `(batch, head)` and block of 32 query rows, a loop over blocks of up to
//!   256 keys with the *online softmax* (running max `m_i`, running sum `l_i`, rescaled
//!   accumulator), so no `T x T` tensor ever exists (a thread holds at most a query-block x
//!   key-block tile); key blocks no row of the query block sees (above the causal diagonal,
//!   before the sliding window, outside the rows' documents) are skipped. It saves the output
//!   and the per-row log-sum-exp `L_i = m_i + ln l_i` (f32, or f64 for f64 inputs).
//! * **backward** (FlashAttention-2): `D_i = <dO_i, O_i>`, `P_ij = exp(s_ij - L_i)` recomputed
//!   block by block, `dV_j += P_ij Z_ij dO_i`, `dS_ij = P_ij (Z_ij <dO_i, v_j> - D_i)`,
//!   `dQ_i += scale dS_ij k_j`, `dK_j += scale dS_ij q_i`; one task per `(batch, kv head)`,
//!   which owns its gradient rows: deterministic for any thread count.
//!
//! **Grouped-query attention** (Llama, Mistral, Qwen: `KV` kv heads, `H` a multiple): query
//! head `h` reads kv head `h / (H / KV)`, so kv head `c` serves the consecutive query heads
//! `c * H / KV .. (c + 1) * H / KV` (transformers' `repeat_kv`, a repeat-interleave). The
//! repeated K / V never exist: the kernel indexes the shared head. In the backward the `dK_j`,
//! `dV_j` of a kv head are the sums of the above over its query heads, which its task runs one
//! after the other in head order.
//!
//! **Memory**: between forward and backward the graph keeps the input (`qkv`, or `q`, `k`,
//! `v`), the output and `B * H * Tq` floats of log-sum-exp; nothing of size `T x T`.
//!
//! **Options** ([`AttentionConfig`]). Query `i` has absolute position `i_abs = i + Tk - Tq`
//! (the queries are the last `Tq` positions, as when decoding with a KV cache) and sees key `j`
//! iff every option lets it: causal masking (`j <= i_abs`), a sliding window `w` (with causal:
//! `i_abs - j < w`, Mistral's `j > i - sliding_window`), document ids (`doc_ids[b, i_abs] ==
//! doc_ids[b, j]`: packed examples attend within themselves). Then a scale (default
//! `1 / sqrt(D)`), an additive `[Tq, Tk]` mask broadcast over batch and heads (not
//! differentiated) and dropout on the probabilities: element `((b * H + h) * Tq + i) * Tk + j`
//! of the `[B, H, Tq, Tk]` probability tensor is dropped iff `key.uniform(index) < p`, kept
//! ones are scaled by `1 / (1 - p)` (the softmax normaliser counts every weight). The window
//! and the documents cost only the key blocks they keep: `O(T w)` for a window `w`.
//!
//! **Rows that see no key** (a mask row of only `-inf`, or causal with `Tq > Tk`; never with
//! only the window and document ids, since a query sees its own position): the fused op
//! (kernel and fallback) gives output 0, log-sum-exp `-inf` and zero gradients through the
//! row. The plain-softmax [`attention_composite`] gives NaN there (`-inf - -inf`). NaN in the
//! inputs propagates to the rows that see it (the running max propagates NaN); a key a row
//! does not see gets weight exactly 0 in it.
//!
//! **CUDA**: with the Triton kernels switched on (`cuda_kernels::set_triton`), the op runs them
//! (`attention/cuda.rs`) when the call fits them (`triton_fits`: self-attention `Tq == Tk`,
//! `D == Dv <= 128`, no additive mask); otherwise, and with them off, the fallback below.
//! The kernels take each `[B, H, T, D]` tensor with its own strides: [`attention_qkv`] reads
//! q, k, v in place from the packed projection and writes dq, dk, dv into one packed gradient,
//! [`attention_merged`] writes `[B, T, H * D]` rows, and a transposed `[B, T, KV, D]` input is
//! read as it is (no copy around the kernels; `attention/cuda.rs`). The CPU kernel reads the
//! same layouts in place (`attention/layout.rs`).
//!
//! On devices without a kernel (or inside [`crate::with_composite_fallback`]) the op computes the
//! same output and log-sum-exp with composite Candle ops on detached inputs and its backward
//! recomputes `P` from the log-sum-exp with composite ops (the `T x T` tensors exist only
//! transiently inside forward and backward; grouped heads are handled by reshaping the query
//! heads of a kv head into one matrix, so K / V are not repeated there either).

mod composite;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod kernel;
mod layout;

pub use composite::{attention_composite, attention_merged_composite, attention_qkv_composite};
use composite::{fallback_backward, fallback_forward, merge_heads, split_heads};
pub use config::AttentionConfig;
use config::{check_bhtd, check_qkv, resolve, Resolved};

use crate::cpu::{self, Elem};
use crate::cuda_kernels::{self, triton_for};
use crate::gelu::FastMath;
use crate::op::{self, Grads, In, Kernel, Saved};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Device, Layout, Result, Shape, Storage, Tensor, WithDType};
use kernel::backward::{backward, BwdInputs};
use kernel::{Docs, Geom, Params, Ptr, View};

/// The contiguous slice of a CPU storage guard.
fn slice<'a, T: Elem>(s: &'a Storage, l: &Layout) -> Result<&'a [T]> {
    match s {
        Storage::Cpu(c) => cpu::contiguous::<T>(c, l),
        _ => bail!("candle-fused: expected a CPU tensor"),
    }
}

fn params<'a, A: cpu::Real>(r: &'a Resolved, mask: Option<&'a [A]>) -> Result<Params<'a, A>> {
    let docs = match (&r.doc_ids, &r.host_docs) {
        (None, _) => None,
        (Some(_), Some(h)) => Some(Docs {
            ids: &h.ids,
            first: &h.first,
            last: &h.last,
            runs: &h.runs,
        }),
        (Some(_), None) => bail!("candle-fused: attention document ids missing on the host"),
    };
    Ok(Params {
        scale: A::c(r.scale),
        causal: r.causal,
        mask,
        dropout: r.dropout,
        key: r.key,
        window: r.window,
        docs,
    })
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
            Ok(kernel::forward::<T>(g, &params(r, Some(m))?, q, k, v, len))
        })?,
        None => kernel::forward::<T>(g, &params(r, None)?, q, k, v, len),
    };
    saved.set(Tensor::from_vec(lse, (g.b, g.h, g.tq), &Device::Cpu)?);
    Ok(T::storage(out))
}

/// Runs the backward kernel. `ins` are the input tensors (one for qkv, three otherwise, each
/// read in place: [`layout::in_place`]); the gradients come back in one buffer per input, laid
/// out as the input is ([`layout::grad_as`]).
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
        .map(|(s, l)| match &**s {
            Storage::Cpu(c) => layout::span(T::slice(c)?, l),
            _ => bail!("candle-fused: expected a CPU tensor"),
        })
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
            backward::<T>(g, &params(r, Some(m))?, &x, pq, pk, pv);
            Ok(())
        })?,
        None => backward::<T>(g, &params(r, None)?, &x, pq, pk, pv),
    }
    Ok(grads)
}

/// Whether the Triton kernels take this call (`x`: the main input): switched on for its CUDA
/// device and dtype ([`triton_for`]), and the kernels' contract: self-attention (`Tq == Tk`:
/// they take one `T`), `Dv == D <= BLOCK_D` (one tile per head), no additive mask (not
/// implemented there; the trainer sets none), `B * H` programs within CUDA's grid height, and
/// `B * T` in i32 (the kernels index the document ids in i32), and the kernels allowed to run
/// (not held back as unproven: [`cuda_kernels::UNPROVEN`]).
fn triton_fits(x: &Tensor, g: &Geom, r: &Resolved) -> bool {
    const GRID_Y: usize = 65535;
    triton_for(x)
        && g.tq == g.tk
        && g.dv == g.d
        && g.d <= cuda_kernels::attention::BLOCK_D
        && r.mask.is_none()
        && g.b * g.h <= GRID_Y
        && g.b * g.tk <= i32::MAX as usize
        // the generic build, the last of every list, may run (`cuda_kernels::UNPROVEN`)
        && cuda_kernels::may_launch("attn_fwd")
}

/// `t` as the kernels read it: unchanged when its last stride is 1, its strides fit an i32
/// and it starts 16-byte aligned (any view of a fresh buffer whose rows are multiples of 8
/// bytes), else a contiguous copy.
fn rows_input(t: &Tensor) -> Result<Tensor> {
    let l = t.layout();
    let unit = l.dims().last().is_none_or(|&d| d <= 1) || l.stride().last() == Some(&1);
    let fits = l.stride().iter().all(|&s| s <= i32::MAX as usize);
    let aligned = (l.start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    if unit && fits && aligned {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
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
    /// Forward and backward run the Triton kernels (CUDA, `attention/cuda.rs`).
    triton: bool,
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        match ins {
            &[x] if self.triton => cuda::qkv_fwd(x, &self.g, &self.r, &self.saved),
            _ => bail!("{}: no CUDA kernel for this call", self.name()),
        }
    }

    fn bwd(&self, ins: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Grads> {
        let qkv = ins[0];
        let lse = self.saved.get()?;
        let g = &self.g;
        op::triton_path!(
            self.triton,
            self.name(),
            cuda::qkv_bwd(g, &self.r, qkv, res, grad, &lse)
        );
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

/// The fused op on `[B, H, Tq, D]`, `[B, KV, Tk, D]`, `[B, KV, Tk, Dv]` tensors, with the
/// output `[B, H, Tq, Dv]` or, `merged`, `[B, Tq, H * Dv]`.
struct BhtdOp {
    g: Geom,
    r: Resolved,
    merged: bool,
    saved: Saved,
    /// Forward and backward run the Triton kernels (CUDA, `attention/cuda.rs`).
    triton: bool,
}

impl Kernel for BhtdOp {
    fn name(&self) -> &'static str {
        if self.merged {
            "candle-fused-attention-merged"
        } else {
            "candle-fused-attention"
        }
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sq, lq), (sk, lk), (sv, lv)) = (ins[0], ins[1], ins[2]);
        let g = &self.g;
        let out = cpu::dispatch!(sq.dtype(), T => {
            let q = layout::span(T::slice(sq)?, lq)?;
            let k = layout::span(T::slice(sk)?, lk)?;
            let v = layout::span(T::slice(sv)?, lv)?;
            kernel_fwd::<T>(g, &self.r, (q, k, v), &self.saved)?
        });
        let shape = if self.merged {
            Shape::from((g.b, g.tq, g.h * g.dv))
        } else {
            Shape::from((g.b, g.h, g.tq, g.dv))
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        match ins {
            &[q, k, v] if self.triton => {
                cuda::bhtd_fwd([q, k, v], &self.g, &self.r, self.merged, &self.saved)
            }
            _ => bail!("{}: no CUDA kernel for this call", self.name()),
        }
    }

    fn bwd(&self, ins: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Grads> {
        let (q, k, v) = (ins[0], ins[1], ins[2]);
        let lse = self.saved.get()?;
        op::triton_path!(
            self.triton,
            self.name(),
            cuda::bhtd_bwd(&self.g, &self.r, [q, k, v], (res, grad), &lse)
        );
        if bwd_kernel(&[q, k, v, res, grad]) {
            // the tensors the forward read in place (see `bhtd`)
            let (dq, dk, dv) = cpu::dispatch!(q.dtype(), T => {
                let ins = [q, k, v];
                let mut gs = kernel_bwd::<T>(&self.g, &self.r, &ins, res, grad, &lse)?.into_iter();
                let mut next = |t: &Tensor| match gs.next() {
                    Some(gr) => layout::grad_as(t, gr),
                    None => bail!("candle-fused: missing attention gradient"),
                };
                (next(q)?, next(k)?, next(v)?)
            });
            return Ok([Some(dq), Some(dk), Some(dv)]);
        }
        let g = &self.g;
        let split = |t: &Tensor| t.reshape((g.b, g.tq, g.h, g.dv))?.transpose(1, 2);
        let (res, grad) = if self.merged {
            (split(res)?, split(grad)?)
        } else {
            (res.clone(), grad.clone())
        };
        let (dq, dk, dv) = fallback_backward((q, k, v), &res, &grad, &lse, &self.r)?;
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
    let r = resolve("attention_qkv", cfg, (b, d, t, t), qkv)?;
    let g = Geom {
        b,
        h: n_head,
        kvh: n_head,
        tq: t,
        tk: t,
        d,
        dv: d,
        q: View::interleaved(0, t, 3 * c, d),
        k: View::interleaved(c, t, 3 * c, d),
        v: View::interleaved(2 * c, t, 3 * c, d),
        o: View::interleaved(0, t, c, d),
    };
    let mut op = QkvOp {
        g,
        r,
        saved: Saved::default(),
        triton: false,
    };
    if triton_fits(qkv, &op.g, &op.r) {
        // CUDA: the Triton kernels, nothing computed beforehand
        op.triton = true;
        return op::apply(op, &[&rows_input(qkv)?], None, None);
    }
    if cpu::has_kernel(qkv) {
        return op::apply(op, &[&qkv.contiguous()?], None, None);
    }
    let (q, k, v) = split_heads(&qkv.detach(), n_head)?;
    let (out, lse) = fallback_forward(&q, &k, &v, &op.r)?;
    op.saved.set(lse);
    op::apply(op, &[qkv], None, Some(merge_heads(&out)?))
}

/// Fused scaled dot-product attention on `q` `[B, H, Tq, D]`, `k` `[B, KV, Tk, D]`, `v`
/// `[B, KV, Tk, Dv]` -> `[B, H, Tq, Dv]` (`H` a multiple of `KV`: query head `h` reads kv
/// head `h / (H / KV)`; causal: query `i` sees keys `0 ..= i + Tk - Tq`; see
/// [`AttentionConfig`] for the window and document ids). Same kernel as [`attention_qkv`]; the
/// graph keeps `q`, `k`, `v`, the output and `B * H * Tq` floats of log-sum-exp.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::attention::{attention, AttentionConfig};
/// let q = Tensor::randn(0f32, 1., (1, 2, 3, 8), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1., (1, 2, 5, 8), &Device::Cpu)?;
/// let v = Tensor::randn(0f32, 1., (1, 2, 5, 4), &Device::Cpu)?;
/// let y = attention(&q, &k, &v, &AttentionConfig::full().with_scale(0.5))?;
/// assert_eq!(y.dims(), &[1, 2, 3, 4]);
/// // Grouped-query: 6 query heads over 2 kv heads, a sliding window of 2 keys.
/// let q = Tensor::randn(0f32, 1., (1, 6, 5, 8), &Device::Cpu)?;
/// let y = attention(&q, &k, &v, &AttentionConfig::causal().with_window(2))?;
/// assert_eq!(y.dims(), &[1, 6, 5, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &AttentionConfig) -> Result<Tensor> {
    bhtd("attention", q, k, v, cfg, false)
}

/// [`attention`] with the heads merged in the output: `[B, Tq, H * Dv]`, head `h` at columns
/// `h * Dv .. (h + 1) * Dv` (what `attention(..).transpose(1, 2).reshape((B, Tq, H * Dv))`
/// gives). The kernel writes those rows directly, so the output projection reads them without
/// a transpose or copy; same backward.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::attention::{attention_merged, AttentionConfig};
/// let q = Var::from_tensor(&Tensor::randn(0f32, 1., (2, 4, 7, 8), &Device::Cpu)?)?;
/// let kv = Tensor::randn(0f32, 1., (2, 2, 7, 8), &Device::Cpu)?;
/// let y = attention_merged(q.as_tensor(), &kv, &kv, &AttentionConfig::causal())?;
/// assert_eq!(y.dims(), &[2, 7, 32]);
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&q).unwrap().dims(), &[2, 4, 7, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_merged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &AttentionConfig,
) -> Result<Tensor> {
    bhtd("attention_merged", q, k, v, cfg, true)
}

fn bhtd(
    name: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &AttentionConfig,
    merged: bool,
) -> Result<Tensor> {
    let s = check_bhtd(name, q, k, v)?;
    let r = resolve(name, cfg, (s.b, s.d, s.tq, s.tk), q)?;
    let g = Geom {
        b: s.b,
        h: s.h,
        kvh: s.kv,
        tq: s.tq,
        tk: s.tk,
        d: s.d,
        dv: s.dv,
        q: View::bhtd(s.h, s.tq, s.d),
        k: View::bhtd(s.kv, s.tk, s.d),
        v: View::bhtd(s.kv, s.tk, s.dv),
        o: if merged {
            View::interleaved(0, s.tq, s.h * s.dv, s.dv)
        } else {
            View::bhtd(s.h, s.tq, s.dv)
        },
    };
    let mut op = BhtdOp {
        g,
        r,
        merged,
        saved: Saved::default(),
        triton: false,
    };
    if triton_fits(q, &op.g, &op.r) {
        // CUDA: the Triton kernels, nothing computed beforehand
        op.triton = true;
        // read as they come (strided views included): no copy unless a row is not unit-stride
        let (q, k, v) = (rows_input(q)?, rows_input(k)?, rows_input(v)?);
        return op::apply(op, &[&q, &k, &v], None, None);
    }
    if cpu::has_kernel(q) && cpu::has_kernel(k) && cpu::has_kernel(v) {
        // read in place when a permutation of a dense buffer (Llama's transposed v), else copied
        let prep = |x: &Tensor| {
            if layout::in_place(x.layout()) {
                Ok(x.clone())
            } else {
                x.contiguous()
            }
        };
        let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
        (op.g.q, op.g.k, op.g.v) = (
            layout::view(q.layout()),
            layout::view(k.layout()),
            layout::view(v.layout()),
        );
        return op::apply(op, &[&q, &k, &v], None, None);
    }
    let (out, lse) = fallback_forward(q, k, v, &op.r)?;
    op.saved.set(lse);
    let out = if merged { merge_heads(&out)? } else { out };
    op::apply(op, &[q, k, v], None, Some(out))
}
