//! The per-token form of [`super::linear_cross_entropy`]: the loss of every row, `[N]`, for
//! objectives that weigh tokens themselves (per-token log-probabilities, sequence sums,
//! preference pairs).
//!
//! ```text
//! nll_i = lse_i - l_i,t_i                  (0 for an ignored row)
//! dx_i  = g_i (softmax(l_i) - onehot(t_i)) W           dW = Σ_i g_i (softmax(l_i) - onehot(t_i))ᵀ x_i
//! ```
//!
//! with `g` the upstream gradient, one value per row. The forward is the mean form's pass with
//! the coefficient 1: when `x` tracks a gradient it computes `dx` for `g = 1` (as the mean form
//! does for `g = 1 / count`), and the backward scales its rows by `g_i` after the fact (in f32,
//! f64 for f64, rounded once more for 16-bit). `dW` cannot be scaled after the fact (it sums
//! over rows), so the forward keeps each counted row's `lse` (when `W` tracks a gradient) and
//! the backward recomputes each chunk's logits, turns them into `g_i (softmax - onehot)` from
//! the saved `lse` (one coefficient per row) and accumulates `dW` as the mean form does (f32 /
//! f64, chunks in order: the same determinism). A frozen head (`W` not tracked) costs the
//! forward's pass only. Ignored rows get exactly zero gradient whatever their `g`.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Result, Shape, Tensor, D};

use super::fallback::RowGrad;
use super::{composite_logits, kernel, LceOp};
use crate::cpu;
use crate::host::Targets;
use crate::linear::strided;
use crate::op::{self, acc_dtype, cpu_of, Grads, In, Kernel};

/// The loss of each row of `x Wᵀ` against `targets` (shapes and layout as
/// [`linear_cross_entropy`](super::linear_cross_entropy)): a tensor of the targets' shape in
/// f32 (f64 for f64 input), `lse_i - l_i,t_i` where the target counts and 0 where it is
/// `ignore_index`; the logits exist only [`default_chunk_rows`](super::default_chunk_rows)`(V, C)` rows at a time.
///
/// Differentiable in `x` and `w` for any upstream gradient (one value per row). Its sum over
/// the counted rows divided by their count is the mean form's loss up to the order of the sum.
/// The backward: `dx` is computed in the forward for an upstream gradient of 1 (when `x`
/// tracks one) and its rows scaled by `g_i` after the fact (rounded once more for 16-bit);
/// `dW` (when `w` tracks one) by a second pass over the chunks that recomputes their logits,
/// turns them into `g_i (softmax - onehot)` from each row's `lse` saved in the forward and
/// accumulates `dW` in f32 / f64 in chunk order (the same bits on any thread count). A frozen
/// `w` costs the forward's pass only; ignored rows get exactly zero gradient whatever `g`.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::linear_cross_entropy::{
///     linear_cross_entropy_per_token, linear_cross_entropy_per_token_composite,
/// };
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 8), &dev)?; // [B, T, C]
/// let w = Var::randn(0f32, 0.1, (50, 8), &dev)?; // [V, C]
/// let t = Tensor::new(&[[1u32, 7, 49], [0, 2, 3]], &dev)?;
/// let nll = linear_cross_entropy_per_token(&x, &w, &t, Some(0))?; // [2, 3], 0 at [1, 0]
/// let reference = linear_cross_entropy_per_token_composite(&x, &w, &t, Some(0))?;
/// assert!((nll - reference)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
/// // per-token weights: the backward takes one upstream gradient per row
/// let weights = Tensor::new(&[[1f32, 0.5, 0.], [2., -1., 1.]], &dev)?;
/// let seq = (linear_cross_entropy_per_token(&x, &w, &t, Some(0))? * weights)?.sum_all()?;
/// let grads = seq.backward()?;
/// assert_eq!(grads.get(&w).unwrap().dims(), &[50, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy_per_token<'a>(
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    let op = "linear_cross_entropy_per_token";
    super::run(op, x, w, targets, ignore_index, None, true)
}

/// [`linear_cross_entropy_per_token`] with `chunk_rows` (at least 1) counted rows per chunk
/// (see [`linear_cross_entropy_chunked`](super::linear_cross_entropy_chunked)).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::linear_cross_entropy::linear_cross_entropy_per_token_chunked as per_token;
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f64, 1.0, (7, 4), &dev)?;
/// let w = Tensor::randn(0f64, 1.0, (11, 4), &dev)?;
/// let t = Tensor::new(&[0u32, 1, 2, 3, 4, 5, 10], &dev)?;
/// let a = per_token(&x, &w, &t, None, 2)?;
/// let b = per_token(&x, &w, &t, None, 7)?;
/// assert!((a - b)?.abs()?.max_all()?.to_scalar::<f64>()? < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy_per_token_chunked<'a>(
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore_index: Option<u32>,
    chunk_rows: usize,
) -> Result<Tensor> {
    let op = "linear_cross_entropy_per_token_chunked";
    super::run(op, x, w, targets, ignore_index, Some(chunk_rows), true)
}

/// The reference of [`linear_cross_entropy_per_token`] from plain differentiable Candle ops:
/// the whole `[N, V]` logits `x.matmul(wᵀ)` (in the input dtype, then widened), their
/// log-softmax, minus the target's entry, times the counted mask (0 / 1).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::linear_cross_entropy::linear_cross_entropy_per_token_composite;
/// let x = Tensor::new(&[[1f64, 0.], [0., 1.]], &Device::Cpu)?;
/// let w = Tensor::zeros((3, 2), candle_core::DType::F64, &Device::Cpu)?; // logits 0
/// let t = Tensor::new(&[2u32, 9], &Device::Cpu)?;
/// let nll = linear_cross_entropy_per_token_composite(&x, &w, &t, Some(9))?.to_vec1::<f64>()?;
/// assert!((nll[0] - 3f64.ln()).abs() < 1e-15 && nll[1] == 0.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy_per_token_composite<'a>(
    x: &Tensor,
    w: &Tensor,
    targets: impl Into<Targets<'a>>,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    let targets = targets.into();
    let op = "linear_cross_entropy_per_token_composite";
    let acc = acc_dtype(x.dtype());
    let logits = composite_logits(op, x, w, &targets, ignore_index)?
        .0
        .to_dtype(acc)?;
    let targets = targets.tensor();
    let t = targets.flatten_all()?;
    let (t, keep) = match ignore_index {
        Some(ig) => {
            let keep = t.ne(ig)?;
            (keep.where_cond(&t, &t.zeros_like()?)?, Some(keep))
        }
        None => (t, None),
    };
    let ls = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let nll = ls.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
    let nll = match keep {
        Some(k) => (nll * k.to_dtype(acc)?)?,
        None => nll,
    };
    nll.reshape(targets.shape())
}

/// The per-token op for `base` (built without the mean) over `x` (contiguous) and `w`: the
/// losses in `out_shape` (the targets').
pub(super) fn run(base: LceOp, x: Tensor, w: &Tensor, out_shape: Shape) -> Result<Tensor> {
    let (n, c) = (base.n, base.c);
    let op = TokensOp {
        base,
        out_shape,
        lse: Mutex::new(None),
    };
    if cpu::has_kernel(&x) {
        return op::apply(op, &[&x, w], None, None);
    }
    let b = &op.base;
    let (x2, wd) = (x.detach().reshape((n, c))?, w.detach());
    let out = b.device_pass(&x2, &wd, &op.forward_pass(), None)?;
    b.grads[0].set(out.dx.map(|d| d.reshape(b.x_shape.clone())).transpose()?);
    if b.need[1] {
        op.save_lse(SavedLse::Device(out.lse));
    }
    let acc = acc_dtype(x.dtype());
    let nll = out.nll.to_dtype(acc)?;
    let losses = if b.rows.len() == b.n {
        nll
    } else if b.rows.is_empty() {
        Tensor::zeros(n, acc, x.device())?
    } else {
        Tensor::zeros(n, acc, x.device())?.index_add(&op.rows_on(x.device())?, &nll, 0)?
    };
    let losses = losses.reshape(op.out_shape.clone())?;
    op::apply(op, &[&x, w], None, Some(losses))
}

/// The counted rows' `lse` from the forward (kept for the recomputing backward of `dW`).
enum SavedLse {
    Host(Vec<f64>),
    Device(Tensor),
}

/// The per-token op on `(x, w)`; `x` contiguous. `base.count` is 1 (no mean).
struct TokensOp {
    base: LceOp,
    out_shape: Shape,
    lse: Mutex<Option<SavedLse>>,
}

impl TokensOp {
    /// The forward's pass: `dx` for an upstream gradient of 1 when `x` tracks one, no `dW`.
    fn forward_pass(&self) -> kernel::Pass<'_> {
        self.base.pass([self.base.need[0], false], 1.0)
    }

    fn save_lse(&self, lse: SavedLse) {
        if let Ok(mut l) = self.lse.lock() {
            *l = Some(lse);
        }
    }

    /// The counted rows' indices on `dev` (u32).
    fn rows_on(&self, dev: &candle_core::Device) -> Result<Tensor> {
        let r: Vec<u32> = self.base.rows.iter().map(|&i| i as u32).collect();
        Tensor::from_vec(r, self.base.rows.len(), dev)
    }

    /// Whether flat row `i` counts, as a `u8` mask `[N]` on `dev`.
    fn counted_on(&self, dev: &candle_core::Device) -> Result<Tensor> {
        let mut m = vec![0u8; self.base.n];
        for &i in &self.base.rows {
            m[i] = 1;
        }
        Tensor::from_vec(m, self.base.n, dev)
    }

    /// The gradients in `need` (`[dx, dW]`, `dx` flat `[n, c]`) for the upstream gradient
    /// `g` (flat `[N]`, zero at ignored rows), recomputed with the saved `lse`.
    fn recompute(&self, x: &Tensor, w: &Tensor, g: &Tensor, need: [bool; 2]) -> Result<Grads> {
        let b = &self.base;
        let guard = self
            .lse
            .lock()
            .map_err(|_| candle_core::Error::Msg("candle-fused: poisoned lock".into()))?;
        let lse = match guard.as_ref() {
            Some(l) => l,
            None => candle_core::bail!("{}: no saved lse for the backward", self.name()),
        };
        if let (SavedLse::Host(lse), true) = (lse, cpu::has_kernel(x) && w.device().is_cpu()) {
            let gh = g.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            let p = kernel::Pass {
                row_scale: Some(&gh),
                lse: Some(lse),
                ..b.pass(need, 1.0)
            };
            let (sx, lx) = x.storage_and_layout();
            let (sw, lw) = w.storage_and_layout();
            let (sx, sw): (In<'_>, In<'_>) = ((cpu_of(&sx)?, lx), (cpu_of(&sw)?, lw));
            return cpu::dispatch!(sx.0.dtype(), T => {
                let xs = cpu::contiguous::<T>(sx.0, sx.1)?;
                let ws = strided::<T>(sw.0, sw.1)?;
                let out = kernel::run::<T>(xs, ws, &p);
                let dx = out.dx.map(|d| cpu::tensor(d, (b.n, b.c))).transpose()?;
                let dw = out.dw.map(|d| cpu::tensor(d, (b.v, b.c))).transpose()?;
                Ok([dx, dw, None])
            });
        }
        let lse = match lse {
            SavedLse::Device(t) => t.clone(),
            SavedLse::Host(v) => Tensor::new(v.as_slice(), x.device())?.to_dtype(g.dtype())?,
        };
        let gr = if b.rows.len() == b.n {
            g.clone()
        } else {
            g.index_select(&self.rows_on(g.device())?, 0)?
        };
        let rg = RowGrad { g: &gr, lse: &lse };
        let x2 = x.detach().reshape((b.n, b.c))?;
        let out = b.device_pass(&x2, &w.detach(), &b.pass(need, 1.0), Some(&rg))?;
        Ok([out.dx, out.dw, None])
    }
}

impl Kernel for TokensOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear-cross-entropy-per-token"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let b = &self.base;
        let p = self.forward_pass();
        let (sx, lx) = ins[0];
        let (sw, lw) = ins[1];
        let (nll, lse, dx) = cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let ws = strided::<T>(sw, lw)?;
            let out = kernel::run::<T>(xs, ws, &p);
            let dx = out.dx.map(|d| cpu::tensor(d, b.x_shape.clone())).transpose()?;
            (out.nll, out.lse, dx)
        });
        b.grads[0].set(dx);
        if b.need[1] {
            self.save_lse(SavedLse::Host(lse));
        }
        let mut full = vec![0f64; b.n];
        for (&i, &l) in b.rows.iter().zip(&nll) {
            full[i] = l;
        }
        let out = match acc_dtype(sx.dtype()) {
            DType::F64 => CpuStorage::F64(full),
            _ => CpuStorage::F32(full.iter().map(|&l| l as f32).collect()),
        };
        Ok((out, self.out_shape.clone()))
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Grads> {
        let b = &self.base;
        let (x, w) = (ins[0], ins[1]);
        let acc = acc_dtype(x.dtype());
        // the upstream gradient of each row, exactly 0 where the target is ignored
        let g = g.flatten_all()?.to_dtype(acc)?;
        let g = if b.rows.len() == b.n {
            g
        } else {
            self.counted_on(g.device())?
                .where_cond(&g, &g.zeros_like()?)?
        };
        let mut out: Grads = [None, None, None];
        let mut missing = [false, b.need[1]];
        if b.need[0] {
            match b.grads[0].take()? {
                // dx_i (for g = 1) times g_i, in the accumulation dtype, rounded once
                Some(dx) => {
                    let dx2 = dx.reshape((b.n, b.c))?.to_dtype(acc)?;
                    let scaled = dx2.broadcast_mul(&g.reshape((b.n, 1))?)?;
                    out[0] = Some(scaled.to_dtype(x.dtype())?.reshape(b.x_shape.clone())?);
                }
                None => missing[0] = true,
            }
        }
        if missing.iter().any(|&m| m) {
            let r = self.recompute(x, w, &g, missing)?;
            if missing[0] {
                out[0] = r[0]
                    .clone()
                    .map(|d| d.reshape(b.x_shape.clone()))
                    .transpose()?;
            }
            if missing[1] {
                out[1] = r[1].clone();
            }
        }
        Ok(out)
    }
}
