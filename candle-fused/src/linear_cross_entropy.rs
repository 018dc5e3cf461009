//! The language-model head and its loss in one op: mean softmax cross-entropy of the logits
//! `x Wᵀ` against the targets, without ever holding the `N x V` logits (Liger-Kernel's
//! `FusedLinearCrossEntropy`).
//!
//! With `x: [N, C]` (the final hidden states, any leading dims flattened), `W: [V, C]` (the
//! Hugging Face `lm_head.weight` / tied `embed_tokens.weight` layout) and targets `t`, the op
//! is exactly [`cross_entropy`](crate::cross_entropy::cross_entropy)`(x Wᵀ, t, None,
//! ignore_index)`:
//!
//! ```text
//! l_i   = x_i Wᵀ                       lse_i = log Σ_j exp l_ij
//! loss  = Σ_{i counted} (lse_i - l_i,t_i) / max(#counted, 1)
//! dl_i  = (softmax(l_i) - onehot(t_i)) g / max(#counted, 1)     (0 for an ignored row)
//! dx_i  = dl_i W                       dW = Σ_i dl_iᵀ x_i
//! ```
//!
//! (`g` the upstream gradient of the loss). A row is counted when its target is not
//! `ignore_index`; with no counted row the loss is 0 and both gradients are zero.
//!
//! **Chunks.** The counted rows are taken `chunk` at a time: the chunk's logits `[chunk, V]`
//! are computed, reduced to `lse` and the loss terms, turned in place into `dl`, and
//! multiplied into `dx` (its rows) and `dW` (accumulated over chunks in chunk order, in f32 /
//! f64), then the buffer is reused. Memory: `dx`, `dW` (f32 while it accumulates), one chunk
//! of logits and the GEMMs' packed copies of one vocabulary block (4096 classes) of `W` and of
//! `dl`; nothing of size `N x V`. The default chunk ([`default_chunk_rows`]) keeps the logits within
//! [`CHUNK_BYTES`] or half of `dW`, whichever is larger (why: see there). Ignored rows
//! are skipped entirely (no logits computed for them): they add exactly 0 to the loss and get
//! exactly zero gradient, and add nothing to `dW` even where their `x` is not finite (the
//! composite multiplies their zero logit gradients by `x` and gets NaN there), as
//! [`cross_entropy`](crate::cross_entropy::cross_entropy) skips such rows of its logits. A NaN
//! in a counted row (of `x`, or anywhere in `W`) makes the loss NaN.
//!
//! **Design: the gradients are computed in the forward** (Liger's choice), not in the
//! backward. When `x` or `W` tracks a gradient ([`Tensor::track_op`]), the forward runs the
//! three GEMMs (logits, `dl W`, `dlᵀ x`) per chunk and keeps `dx` and `dW` in the op; the
//! backward only scales them by `g` (in place on the CPU, nothing when `g` is 1, the usual
//! `loss.backward()`). The alternative, saving `lse` and recomputing each chunk's logits in the
//! backward, costs a fourth GEMM of the same size (about a third more time for the head) and
//! saves no memory: the loss is the graph's last node, so `dx` and `dW` would be allocated at
//! the start of the backward anyway, and nothing of size `N x V` is kept either way. The price:
//! Candle has no no-grad mode, so a loss computed from tracked tensors (an evaluation loop over
//! a model's `Var`s) pays for the gradients too; pass detached tensors (`x.detach()`,
//! `w.detach()`) there, and only the logits GEMM runs. A second backward through the same
//! graph (or one after the first has taken the gradients) recomputes them chunk by chunk.
//!
//! **Dtypes.** f32 and f64 compute everything in their own type. bf16 / f16 compute each
//! chunk's logits as the 16-bit matmul does (products summed in f32, rounded to the 16-bit
//! type once: what `lm_head(h)` in bf16 gives before transformers' `.float()`), then the
//! softmax in f32; the logit gradients are rounded to the 16-bit type before their two GEMMs
//! (as the cast in the composite rounds them), `dx` is rounded once per row, `dW` accumulates
//! over all chunks in f32 and is rounded once. The loss is f32 (f64 for f64 input). The GEMMs
//! read bf16 as it is on CPUs with AVX512-BF16; elsewhere, and for f16, `W` is widened to f32
//! once per call (a `V x C` f32 copy, as [`linear`](crate::linear::linear) does).
//!
//! **Determinism.** Every GEMM splits only over its output (never over the summed dimension),
//! rows of a chunk are independent, the loss terms are added in row order and `dW` in chunk
//! order, so the results are the same bits on any number of threads (for a given chunk size).
//!
//! On CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`; f32, bf16, f16) the
//! same chunk loop runs with Candle's matmuls (cuBLAS) for the three GEMMs and one Triton kernel
//! per chunk for the softmax and its gradient, in place over the chunk's logits
//! (`linear_cross_entropy/cuda.rs`). On other devices without a kernel (and inside
//! [`crate::with_composite_fallback`]) the chunk loop runs from plain Candle ops on detached
//! tensors, so a GPU holds one chunk of logits at a time either way.
//! [`linear_cross_entropy_composite`] is the unchunked reference.

#[cfg(feature = "cuda")]
mod cuda;
mod fallback;
mod kernel;
mod per_token;

pub use per_token::{
    linear_cross_entropy_per_token, linear_cross_entropy_per_token_chunked,
    linear_cross_entropy_per_token_composite,
};

use std::borrow::Cow;
use std::sync::Mutex;

use crate::cpu::{self, Elem};
use crate::cross_entropy::{check_targets, cross_entropy_composite};
use crate::cuda_kernels::triton_for;
use crate::host::Targets;
use crate::linear::strided;
use crate::op::{self, acc_dtype, cpu_of, Grads, In, Kernel};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp1, Layout, Result, Shape, Tensor};
use kernel::Pass;

/// The floor of the default chunk's f32 logits ([`default_chunk_rows`]): 8 MiB.
pub const CHUNK_BYTES: usize = 8 << 20;

/// The default rows per chunk for a vocabulary of `vocab` classes and inputs `width` wide:
/// `max(CHUNK_BYTES / (4 vocab), width / 2)`, at least 1. The chunk's f32 logits are then at most
/// [`CHUNK_BYTES`] or half of `dW` in f32 (`vocab x width`), whichever is larger. Why not
/// smaller: every chunk reads `W` twice and `dW` once more, and Candle's backward holds three
/// `dW`-sized buffers at once anyway (each gradient is added into a fresh zero tensor), so
/// chunks up to half of `dW` never raise the op's peak, while 8 MiB chunks (42 rows) made
/// SmolLM2's head's forward + backward 1.4-1.5x slower than the default 288 rows on 2 quiet
/// cores, 2x and more on loaded ones (`benches/ops.rs`).
///
/// ```
/// use candle_fused::linear_cross_entropy::default_chunk_rows;
/// assert_eq!(default_chunk_rows(49152, 576), 288); // SmolLM2: 54 MiB of logits, dW 108 MiB
/// assert_eq!(default_chunk_rows(8192, 64), 256); // 8 MiB
/// assert_eq!(default_chunk_rows(1 << 30, 1), 1);
/// ```
pub fn default_chunk_rows(vocab: usize, width: usize) -> usize {
    (CHUNK_BYTES / (4 * vocab.max(1))).max(width / 2).max(1)
}

/// Mean cross-entropy of the logits `x Wᵀ` (`x: [.., C]`, `w: [V, C]`: the Hugging Face
/// `lm_head` / tied-embedding layout, any 2-D view) against `targets` (`[..]` u32, the leading
/// dims of `x`), over the targets that are not `ignore_index`; the logits exist only
/// [`default_chunk_rows`]`(V, C)` rows at a time.
///
/// Returns a scalar in f32 (f64 for f64 input): exactly
/// [`cross_entropy`](crate::cross_entropy::cross_entropy)`(x Wᵀ, targets, None, ignore_index)`
/// (0 when every target is ignored). Differentiable in `x` and `w`; the gradients have their
/// dtypes. Targets `>= V` (other than `ignore_index`) are an error. See the
/// [module docs](self) for the memory, the dtypes and when the gradients are computed.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 8), &dev)?; // [B, T, C]
/// let w = Var::randn(0f32, 0.1, (50, 8), &dev)?; // [V, C]
/// let targets = Tensor::new(&[[1u32, 7, 49], [0, 2, 3]], &dev)?;
/// let loss = candle_fused::linear_cross_entropy::linear_cross_entropy(&x, &w, &targets, Some(0))?;
/// let reference = candle_fused::linear_cross_entropy::linear_cross_entropy_composite(
///     &x, &w, &targets, Some(0),
/// )?;
/// assert!((loss.to_scalar::<f32>()? - reference.to_scalar::<f32>()?).abs() < 1e-5);
/// let grads = loss.backward()?;
/// assert_eq!(grads.get(&w).unwrap().dims(), &[50, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy<'a>(
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    run(
        "linear_cross_entropy",
        x,
        w,
        targets,
        ignore_index,
        None,
        false,
    )
}

/// [`linear_cross_entropy`] with `chunk_rows` (at least 1) counted rows per chunk instead of
/// [`default_chunk_rows`]: the largest temporary is `chunk_rows x V` logits. Larger chunks
/// read `W` and `dW` fewer times (about once per chunk each); results for different chunk
/// sizes agree to rounding (the order of `dW`'s sums, and the GEMM's kernels for small
/// blocks, depend on it), and for one chunk size they are the same bits on any thread count.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::linear_cross_entropy::{linear_cross_entropy, linear_cross_entropy_chunked};
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f64, 1.0, (7, 4), &dev)?;
/// let w = Tensor::randn(0f64, 1.0, (11, 4), &dev)?;
/// let t = Tensor::new(&[0u32, 1, 2, 3, 4, 5, 10], &dev)?;
/// let a = linear_cross_entropy_chunked(&x, &w, &t, None, 2)?.to_scalar::<f64>()?;
/// let b = linear_cross_entropy(&x, &w, &t, None)?.to_scalar::<f64>()?;
/// assert!((a - b).abs() < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy_chunked<'a>(
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore_index: Option<u32>,
    chunk_rows: usize,
) -> Result<Tensor> {
    let op = "linear_cross_entropy_chunked";
    run(op, x, w, targets, ignore_index, Some(chunk_rows), false)
}

/// The reference: [`cross_entropy_composite`]`(x.matmul(wᵀ), targets, None, ignore_index)`
/// from plain differentiable Candle ops (the matmul in the input dtype, the loss in f32 for
/// 16-bit input). Holds the whole `[N, V]` logits, their log-softmax and, in the backward,
/// their gradient.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f64, 0.], [0., 1.]], &Device::Cpu)?;
/// let w = Tensor::new(&[[0f64, 0.], [0., 0.], [0., 0.]], &Device::Cpu)?; // 3 classes, logits 0
/// let t = Tensor::new(&[2u32, 0], &Device::Cpu)?;
/// let loss = candle_fused::linear_cross_entropy::linear_cross_entropy_composite(&x, &w, &t, None)?;
/// assert!((loss.to_scalar::<f64>()? - 3f64.ln()).abs() < 1e-15);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy_composite<'a>(
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    let targets = targets.into();
    let op = "linear_cross_entropy_composite";
    let (logits, host) = composite_logits(op, x, w, &targets, ignore_index)?;
    let targets = Targets::new(targets.tensor()).with_host(&host);
    let mut dims = targets.tensor().dims().to_vec();
    dims.push(logits.dim(1)?);
    cross_entropy_composite(&logits.reshape(dims)?, targets, None, ignore_index)
}

/// The checks of the composite forms, then the whole `[N, V]` logits `x wᵀ` (input dtype) and
/// the targets' host copy.
fn composite_logits<'a>(
    op: &str,
    x: &Tensor,
    w: &Tensor,
    targets: &Targets<'a>,
    ignore_index: Option<u32>,
) -> Result<(Tensor, Cow<'a, [u32]>)> {
    let (_, c, v) = check(op, x, w, targets.tensor())?;
    let host = targets.host(op)?;
    check_targets(op, &host, v, ignore_index)?;
    Ok((x.reshape(((), c))?.matmul(&w.t()?)?, host))
}

/// `(N, C, V)` after checking dtypes, shapes and devices.
fn check(op: &str, x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<(usize, usize, usize)> {
    op::check_float(op, "x", x)?;
    if w.dtype() != x.dtype() {
        bail!(
            "{op}: w dtype {:?} differs from x dtype {:?}",
            w.dtype(),
            x.dtype()
        )
    }
    let (lead, c) = op::split_last(op, ("x", "C"), x)?;
    let v = match w.dims() {
        &[v, wc] if v > 0 && wc == c => v,
        _ => bail!(
            "{op}: w must be [V, C] with V > 0 and C = {c} (the last dim of x {:?}), got shape {:?}",
            x.shape(),
            w.shape()
        ),
    };
    if targets.dtype() != DType::U32 {
        bail!("{op}: targets must be u32, got {:?}", targets.dtype())
    }
    if targets.dims() != lead {
        bail!(
            "{op}: targets must have the leading shape of x {lead:?}, got {:?}",
            targets.shape()
        )
    }
    for (name, t) in [("w", w), ("targets", targets)] {
        if !t.device().same_device(x.device()) {
            bail!("{op}: {name} and x are on different devices")
        }
    }
    Ok((lead.iter().product(), c, v))
}

/// The public forms' op: the loss of each row of `targets`' shape (`per_token`), else their
/// mean over the counted rows.
fn run<'a>(
    name: &str,
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore: Option<u32>,
    chunk: Option<usize>,
    per_token: bool,
) -> Result<Tensor> {
    let targets = targets.into();
    let (op, x) = LceOp::new(name, x, w, &targets, ignore, chunk, !per_token)?;
    if per_token {
        return per_token::run(op, x, w, targets.tensor().shape().clone());
    }
    let (n, c) = (op.n, op.c);
    if cpu::has_kernel(&x) {
        return op::apply(op, &[&x, w], None, None);
    }
    let (x2, wd) = (x.detach().reshape((n, c))?, w.detach());
    let out = op.device_pass(&x2, &wd, &op.pass(op.need, 1.0 / op.count), None)?;
    op.grads[0].set(out.dx.map(|d| d.reshape(op.x_shape.clone())).transpose()?);
    op.grads[1].set(out.dw);
    // (the Triton pass sums in f64, as the CPU kernel: the loss rounded to f32 once)
    let loss = out
        .nll_sum
        .affine(1.0 / op.count, 0.0)?
        .to_dtype(acc_dtype(x.dtype()))?;
    op::apply(op, &[&x, w], None, Some(loss))
}

impl LceOp {
    /// The op over `(x, w)` against `targets` after the checks every form makes (shapes,
    /// dtypes, targets in range; the targets' host copy, or one counted read of them), and `x` contiguous.
    /// `mean`: the loss is the mean over the counted rows (else their count is 1, no mean).
    fn new(
        name: &str,
        x: &Tensor,
        w: &Tensor,
        targets: &Targets<'_>,
        ignore: Option<u32>,
        chunk: Option<usize>,
        mean: bool,
    ) -> Result<(Self, Tensor)> {
        if chunk == Some(0) {
            bail!("{name}: chunk_rows must be at least 1")
        }
        let (n, c, v) = check(name, x, w, targets.tensor())?;
        let targets = targets.host(name)?.into_owned();
        check_targets(name, &targets, v, ignore)?;
        let rows: Vec<usize> = (0..n).filter(|&i| Some(targets[i]) != ignore).collect();
        let x = x.contiguous()?;
        // no counted row: no launch (the fallback's loop gives the zero loss and gradients)
        let triton = triton_for(&x) && !rows.is_empty();
        let op = LceOp {
            count: if mean { rows.len().max(1) as f64 } else { 1.0 },
            rows,
            targets,
            n,
            c,
            v,
            chunk: chunk.unwrap_or_else(|| default_chunk_rows(v, c)),
            need: [x.track_op(), w.track_op()],
            x_shape: x.shape().clone(),
            grads: [Slot::default(), Slot::default()],
            triton,
        };
        Ok((op, x))
    }
}

/// A gradient computed in the forward, until the backward takes it.
#[derive(Default)]
struct Slot(Mutex<Option<Tensor>>);

impl Slot {
    fn set(&self, t: Option<Tensor>) {
        if let Ok(mut g) = self.0.lock() {
            *g = t;
        }
    }

    fn take(&self) -> Result<Option<Tensor>> {
        Ok(self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-fused: poisoned lock".into()))?
            .take())
    }
}

/// The op on `(x, w)`; `x` contiguous.
struct LceOp {
    /// Flat indices of the counted rows.
    rows: Vec<usize>,
    /// Flat targets, on the host.
    targets: Vec<u32>,
    n: usize,
    c: usize,
    v: usize,
    chunk: usize,
    /// `max(#counted, 1)`.
    count: f64,
    /// Whether `x`, `w` tracked a gradient at the call: the gradients the forward computes.
    need: [bool; 2],
    x_shape: Shape,
    /// `dx`, `dW` from the forward (for an upstream gradient of 1).
    grads: [Slot; 2],
    /// The passes run the Triton chunk loop (CUDA, `linear_cross_entropy/cuda.rs`).
    triton: bool,
}

impl LceOp {
    fn pass(&self, need: [bool; 2], scale: f64) -> Pass<'_> {
        Pass {
            n: self.n,
            c: self.c,
            v: self.v,
            rows: &self.rows,
            targets: &self.targets,
            chunk: self.chunk,
            need,
            scale,
            row_scale: None,
            lse: None,
        }
    }

    /// The CPU kernel's pass over `x` (contiguous) and `w`: `(Σ nll, dx, dW)`.
    fn cpu_pass(
        &self,
        (sx, lx): In<'_>,
        (sw, lw): In<'_>,
        need: [bool; 2],
        scale: f64,
    ) -> Result<(f64, Option<Tensor>, Option<Tensor>)> {
        let p = self.pass(need, scale);
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let ws = strided::<T>(sw, lw)?;
            let out = kernel::run::<T>(xs, ws, &p);
            let dx = out.dx.map(|d| cpu::tensor(d, self.x_shape.clone())).transpose()?;
            let dw = out.dw.map(|d| cpu::tensor(d, (self.v, self.c))).transpose()?;
            Ok((out.nll_sum, dx, dw))
        })
    }

    /// The pass `p` on a device without a CPU kernel, over `x2 [n, c]` and `w`, both
    /// detached (`dx` is `[n, c]`), by the Triton chunk loop or the plain-op one; `rg`: the
    /// per-token form's recomputing backward.
    fn device_pass(
        &self,
        x2: &Tensor,
        w: &Tensor,
        p: &Pass<'_>,
        rg: Option<&fallback::RowGrad>,
    ) -> Result<fallback::DeviceOut> {
        op::triton_path!(self.triton, self.name(), cuda::run(x2, w, p, rg));
        fallback::run(x2, w, p, rg)
    }

    /// The gradients in `need` for the upstream gradient `g`, recomputed (a second backward).
    fn recompute(&self, x: &Tensor, w: &Tensor, need: [bool; 2], g: f64) -> Result<Grads> {
        let scale = g / self.count;
        let (dx, dw) = if cpu::has_kernel(x) && w.device().is_cpu() {
            let (sx, lx) = x.storage_and_layout();
            let (sw, lw) = w.storage_and_layout();
            let r = self.cpu_pass((cpu_of(&sx)?, lx), (cpu_of(&sw)?, lw), need, scale)?;
            (r.1, r.2)
        } else {
            let x2 = x.detach().reshape((self.n, self.c))?;
            let out = self.device_pass(&x2, &w.detach(), &self.pass(need, scale), None)?;
            let dx = out
                .dx
                .map(|d| d.reshape(self.x_shape.clone()))
                .transpose()?;
            (dx, out.dw)
        };
        Ok([dx, dw, None])
    }
}

impl Kernel for LceOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear-cross-entropy"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let (nll_sum, dx, dw) = self.cpu_pass(ins[0], ins[1], self.need, 1.0 / self.count)?;
        self.grads[0].set(dx);
        self.grads[1].set(dw);
        let loss = nll_sum / self.count;
        let out = match acc_dtype(ins[0].0.dtype()) {
            DType::F64 => CpuStorage::F64(vec![loss]),
            _ => CpuStorage::F32(vec![loss as f32]),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Grads> {
        // With the CPU kernel `g` is read (free, and `g = 1` skips the scaling); on a device
        // (and on the fallback path, which stands for it) it stays there and scales the saved
        // gradients there: reading it back would wait for the whole forward at the start of
        // every backward (a host sync in the step).
        let g = if cpu::has_kernel(ins[0]) && g.device().is_cpu() {
            Upstream::Host(g.to_dtype(DType::F64)?.to_scalar::<f64>()?)
        } else {
            Upstream::Device(g.clone())
        };
        let mut out: Grads = [None, None, None];
        let mut missing = [false; 2];
        for k in 0..2 {
            if !self.need[k] {
                continue;
            }
            match self.grads[k].take()? {
                Some(t) => out[k] = Some(g.scale(t)?),
                None => missing[k] = true,
            }
        }
        if missing.iter().any(|&m| m) {
            // on a device: recomputed for g = 1, then scaled there, as the saved ones are
            let r = self.recompute(ins[0], ins[1], missing, g.host().unwrap_or(1.0))?;
            for k in 0..2 {
                if missing[k] {
                    out[k] = match (&g, r[k].clone()) {
                        (Upstream::Device(_), Some(t)) => Some(g.scale(t)?),
                        (_, t) => t,
                    };
                }
            }
        }
        Ok(out)
    }
}

/// The upstream gradient of the loss: read on the host (CPU), or left on its device.
enum Upstream {
    Host(f64),
    Device(Tensor),
}

impl Upstream {
    /// The value, when on the host.
    fn host(&self) -> Option<f64> {
        match self {
            Upstream::Host(g) => Some(*g),
            Upstream::Device(_) => None,
        }
    }

    /// `t * g`, computed in f32 (f64 for f64) and rounded once, as the CPU's in-place scaling.
    fn scale(&self, t: Tensor) -> Result<Tensor> {
        match self {
            Upstream::Host(g) => scaled(t, *g),
            Upstream::Device(g) => {
                let (dt, acc) = (t.dtype(), acc_dtype(t.dtype()));
                t.to_dtype(acc)?
                    .broadcast_mul(&g.to_dtype(acc)?)?
                    .to_dtype(dt)
            }
        }
    }
}

/// `t * g`: `t` itself for `g = 1`, in place on the CPU (the op owns `t`), a new tensor
/// elsewhere.
fn scaled(t: Tensor, g: f64) -> Result<Tensor> {
    if g == 1.0 {
        return Ok(t);
    }
    if !t.device().is_cpu() {
        return t.affine(g, 0.0);
    }
    t.inplace_op1(&Scale(g))?;
    Ok(t)
}

/// Multiplies a contiguous CPU tensor by a constant in place (16-bit: in f32, rounded once).
struct Scale(f64);

impl Scale {
    fn apply<T: Elem>(&self, v: &mut [T]) {
        let s = <T::Acc as crate::cpu::Real>::c(self.0);
        cpu::for_rows(v, 4096, 4096, |_, r| {
            for e in r {
                *e = T::from_acc(e.acc() * s);
            }
        });
    }
}

impl InplaceOp1 for Scale {
    fn name(&self) -> &'static str {
        "candle-fused-linear-cross-entropy-scale"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let Some((a, b)) = l.contiguous_offsets() else {
            bail!("candle-fused: in-place scale of a strided tensor")
        };
        match s {
            CpuStorage::F32(v) => self.apply(&mut v[a..b]),
            CpuStorage::F64(v) => self.apply(&mut v[a..b]),
            CpuStorage::BF16(v) => self.apply(&mut v[a..b]),
            CpuStorage::F16(v) => self.apply(&mut v[a..b]),
            other => bail!("candle-fused: no in-place scale for {:?}", other.dtype()),
        }
        Ok(())
    }
}
