//! A linear layer `y = x W + b` as one differentiable op.
//!
//! Composed from Candle primitives, a biased linear layer materialises `x W` and then `x W + b`
//! (both stay alive until the backward ends: Candle keeps every node of the graph), its weight
//! gradient is a batch of GEMMs summed when `x` has leading dims, and the bias gradient is a
//! strided reduction on one thread. Here the forward is one GEMM that starts from the bias rows,
//! and the backward is two GEMMs (`dx = dy Wᵀ`, `dW = xᵀ dy`) plus a column sum over fixed row
//! blocks (the same on any thread count). The weight may be any 2-D view, e.g. `w.t()` of a
//! `[out, in]` candle-nn weight or of a tied embedding: it is read in place through its strides.
//!
//! bf16 runs its GEMMs on the bf16 data itself where the CPU has AVX512-BF16
//! (`gemm_bf16`: `vdpbf16ps`, products exact in f32, f32 sums), so it reads half the
//! bytes and does twice the multiply-adds per instruction of f32. Elsewhere, and for f16, the
//! 16-bit inputs are widened to f32 for Candle's GEMM (which has no 16-bit CPU kernel). Either
//! way the GEMM accumulates in f32 and the result is rounded to the storage type once.

pub(crate) mod gemm;

use crate::cpu::{self, Elem, Real};
use crate::op::{self, cpu_of, Grads, In, Kernel};
use crate::pool;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result, Shape, Tensor};
use gemm::{gemm_new, gemm_new_t, gemm_raw, narrow, operand, widen};
pub(crate) use gemm::{strided, Strided};

/// `x [.., in] · w [in, out] + b [out]` (b optional), `[.., out]`.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 4), &dev)?;
/// let w = Var::randn(0f32, 1.0, (5, 4), &dev)?; // candle-nn layout [out, in]
/// let b = Var::zeros(5, candle_core::DType::F32, &dev)?;
/// let y = candle_fused::linear::linear(&x, &w.t()?, Some(&b))?;
/// assert_eq!(y.dims(), &[2, 3, 5]);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&w).unwrap().dims(), &[5, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (n_in, n_out) = check(x, w, b)?;
    let x = x.contiguous()?;
    let op = LinearOp { n_in, n_out };
    if x.device().is_cuda() && b.is_none() && x.elem_count() > 0 {
        // the op's CUDA forward: one cuBLAS GEMM writing the output (no composite output to
        // copy); the bias case stays composite
        return op::apply(op, &[&x, w], None, None);
    }
    if !cpu::has_kernel(&x) {
        let y = linear_composite(&x.detach(), &w.detach(), b.map(Tensor::detach).as_ref())?;
        return op::apply(op, &[&x, w], b, Some(y));
    }
    let b = b.map(Tensor::contiguous).transpose()?;
    op::apply(op, &[&x, w], b.as_ref(), None)
}

/// The composite reference of [`linear`]: `x` flattened to 2-D, Candle's `matmul`,
/// `broadcast_add`.
pub fn linear_composite(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (n_in, n_out) = w.dims2()?;
    let mut dims = x.dims().to_vec();
    let y = x.reshape(((), n_in))?.matmul(w)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    if let Some(l) = dims.last_mut() {
        *l = n_out;
    }
    y.reshape(dims)
}

/// `a [m, k] · b [k, n]` through the GEMM [`linear`] and its backward run on the CPU: both
/// operands read in place through their strides (a transposed view costs no copy), bf16 on
/// the bf16 kernel where the CPU has AVX512-BF16, f32 accumulation, on Candle's thread pool.
/// No gradient. Other devices run Candle's `matmul`. For measuring the GEMMs a step runs
/// (the `gemm` bench) and for callers that want one product.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let a = Tensor::randn(0f32, 1.0, (6, 4), &Device::Cpu)?;
/// let b = Tensor::randn(0f32, 1.0, (5, 4), &Device::Cpu)?;
/// let y = candle_fused::linear::matmul(&a, &b.t()?)?; // [6, 4] · [4, 5]
/// let want = a.matmul(&b.t()?)?;
/// assert!((y - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if k != k2 || a.dtype() != b.dtype() {
        bail!(
            "candle-fused matmul: {:?} {:?} times {:?} {:?} do not match",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype()
        );
    }
    if !(cpu::has_kernel(a) && b.device().is_cpu()) {
        return a.matmul(b);
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    cpu::dispatch!(a.dtype(), T => {
        let (da, ta) = strided::<T>(cpu_of(&sa)?, la)?;
        let (db, tb) = strided::<T>(cpu_of(&sb)?, lb)?;
        let (oa, ob) = (operand(da), operand(db));
        let y = gemm_new_t::<T>(m, n, k, (&oa, ta), (&ob, tb), pool::parts());
        cpu::tensor(y, (m, n))
    })
}

pub(crate) fn check(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<(usize, usize)> {
    let (n_in, n_out) = match w.dims() {
        [i, o] => (*i, *o),
        d => bail!("candle-fused linear: the weight must be 2-D [in, out], got {d:?}"),
    };
    if x.rank() == 0 || x.dim(x.rank() - 1)? != n_in {
        bail!(
            "candle-fused linear: input {:?} does not end in the weight's in-features {n_in}",
            x.dims()
        );
    }
    if let Some(b) = b {
        if b.dims() != [n_out] {
            bail!(
                "candle-fused linear: bias {:?} must be [{n_out}] (the weight's out-features)",
                b.dims()
            );
        }
        check_input_dtype("linear", "bias", b, x)?;
    }
    check_input_dtype("linear", "weight", w, x)?;
    if !w.device().same_device(x.device()) {
        bail!("candle-fused linear: weight and input are on different devices");
    }
    Ok((n_in, n_out))
}

/// Errors unless `t` (called `name`, an operand of `op`) has the dtype of the input `x`.
pub(crate) fn check_input_dtype(op: &str, name: &str, t: &Tensor, x: &Tensor) -> Result<()> {
    let (dt, dx) = (t.dtype(), x.dtype());
    if dt != dx {
        bail!("candle-fused {op}: {name} dtype {dt:?} differs from input {dx:?}");
    }
    Ok(())
}

/// The shape of the output for an input of layout `lx`: its last dim becomes `n_out`.
pub(crate) fn out_shape(lx: &Layout, n_out: usize) -> Shape {
    let mut dims = lx.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = n_out;
    }
    Shape::from(dims)
}

/// The op: `(x, w)` or `(x, w, b)`.
pub(crate) struct LinearOp {
    pub(crate) n_in: usize,
    pub(crate) n_out: usize,
}

impl Kernel for LinearOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sx, lx), (sw, lw), b) = (ins[0], ins[1], ins.get(2));
        let shape = out_shape(lx, self.n_out);
        cpu::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let w = strided::<T>(sw, lw)?;
            let bs = b.map(|(s, l)| cpu::contiguous::<T>(s, l)).transpose()?;
            let y = fwd_kernel(xs, w, bs, self.n_in, self.n_out);
            Ok((T::storage(y), shape))
        })
    }

    /// No bias, `x` contiguous ([`linear`] applies it so): Candle's cuBLAS GEMM over `x` as
    /// `[rows, n_in]` and `w` through its strides.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
        let ((sx, lx), (sw, lw)) = (ins[0], ins[1]);
        let rows = lx.shape().elem_count() / self.n_in;
        let lx2 = Layout::contiguous_with_offset((rows, self.n_in), lx.start_offset());
        let y = sx.matmul(sw, (1, rows, self.n_out, self.n_in), &lx2, lw)?;
        Ok((y, out_shape(lx, self.n_out)))
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (x, w, b) = (ins[0], ins[1], ins.get(2));
        let need = [x.track_op(), w.track_op(), b.is_some_and(|b| b.track_op())];
        let (n_in, n_out) = (self.n_in, self.n_out);
        if !(cpu::has_kernel(x) && dy.device().is_cpu()) {
            // Composite gradients on detached tensors (devices without a kernel).
            let (x2, w) = (x.detach().reshape(((), n_in))?, w.detach());
            let g = dy.to_dtype(x.dtype())?.reshape(((), n_out))?;
            let dx = need[0]
                .then(|| g.matmul(&w.t()?)?.reshape(x.shape()))
                .transpose()?;
            let dw = need[1].then(|| x2.t()?.matmul(&g)).transpose()?;
            let db = need[2].then(|| g.sum(0)).transpose()?;
            return Ok([dx, dw, db]);
        }
        let x = x.contiguous()?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        cpu::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&x, |xs| {
                cpu::with_slice::<T, _>(&dy, |dys| {
                    let (sw, lw) = w.storage_and_layout();
                    let ws = strided::<T>(cpu_of(&sw)?, lw)?;
                    let g = bwd_kernel(xs, ws, dys, n_in, n_out, need);
                    let dx = g.dx.map(|v| cpu::tensor(v, x.shape())).transpose()?;
                    let dw = g.dw.map(|v| cpu::tensor(v, (n_in, n_out))).transpose()?;
                    let db = g.db.map(|v| cpu::tensor(v, n_out)).transpose()?;
                    Ok([dx, dw, db])
                })
            })
        })
    }
}

pub(crate) fn fwd_kernel<T: Elem>(
    x: &[T],
    w: (&[T], Strided),
    b: Option<&[T]>,
    n_in: usize,
    n_out: usize,
) -> Vec<T> {
    narrow(fwd_acc(x, w, b, n_in, n_out))
}

/// `x w (+ b)` in the accumulation type, not yet rounded to `T` (callers add more to it).
pub(crate) fn fwd_acc<T: Elem>(
    x: &[T],
    (w, ws): (&[T], Strided),
    b: Option<&[T]>,
    n_in: usize,
    n_out: usize,
) -> Vec<T::Acc> {
    let rows = x.len().checked_div(n_in).unwrap_or(0);
    let xa = operand(x);
    let wa = operand(w);
    let x2 = (&xa, Strided { rs: n_in, cs: 1 });
    let threads = pool::parts();
    match b {
        Some(b) => {
            // Start from the bias rows, accumulate the product into them.
            let ba = widen(b);
            let mut out = Vec::with_capacity(rows * n_out);
            for _ in 0..rows {
                out.extend_from_slice(&ba);
            }
            assert_eq!(out.len(), rows * n_out);
            // SAFETY: `out` holds rows x n_out initialised elements, exclusively borrowed.
            unsafe {
                gemm_raw(
                    rows,
                    n_out,
                    n_in,
                    out.as_mut_ptr(),
                    true,
                    x2,
                    (&wa, ws),
                    threads,
                )
            };
            out
        }
        None => gemm_new(rows, n_out, n_in, x2, (&wa, ws), threads),
    }
}

/// Column sums of `g [rows, n]` as partials over fixed row blocks added in block order (the
/// same for any thread count).
fn column_sums<T: Elem>(g: &[T], rows: usize, n: usize) -> Vec<T::Acc> {
    let rb = cpu::row_block(rows);
    let part = |bi: usize| {
        let mut s = vec![T::Acc::ZERO; n];
        for r in bi * rb..((bi + 1) * rb).min(rows) {
            for (a, v) in s.iter_mut().zip(&g[r * n..(r + 1) * n]) {
                *a += v.acc();
            }
        }
        s
    };
    let blocks = rows.div_ceil(rb);
    let parts: Vec<Vec<T::Acc>> = if rows * n >= cpu::PAR_MIN_WORK {
        pool::map(blocks, part)
    } else {
        (0..blocks).map(part).collect()
    };
    let mut out = vec![T::Acc::ZERO; n];
    for p in parts {
        for (a, v) in out.iter_mut().zip(p) {
            *a += v;
        }
    }
    out
}

pub(crate) struct LinearGrads<T> {
    pub dx: Option<Vec<T>>,
    pub dw: Option<Vec<T>>,
    pub db: Option<Vec<T>>,
}

pub(crate) fn bwd_kernel<T: Elem>(
    x: &[T],
    (w, ws): (&[T], Strided),
    dy: &[T],
    n_in: usize,
    n_out: usize,
    need: [bool; 3],
) -> LinearGrads<T> {
    let rows = dy.len().checked_div(n_out).unwrap_or(0);
    let g = operand(dy);
    let gs = Strided { rs: n_out, cs: 1 };
    // dx and (dW, db) are independent: on two threads, small GEMMs run side by side, one per
    // thread (small GEMMs scale poorly across threads; two at once keep both cores busy with
    // less synchronisation). With more threads each runs on all of them in turn (the two
    // halves of a `pool::join` cannot split further). The split never changes a sum (see
    // `gemm_raw`).
    let threads = pool::parts();
    // Measured on 2 cores: worth it below ~64M multiply-adds per GEMM (the baby GPT's layers),
    // a loss above (GPT 4/4/256's 200M+), where one GEMM on all threads is already efficient.
    let small = rows * n_in * n_out < 1 << 26;
    let both = need[0] && (need[1] || need[2]) && threads == 2 && small;
    let (t_dx, t_dw) = if both { (1, 1) } else { (threads, threads) };
    let dx_job = || {
        need[0].then(|| {
            let wa = operand(w);
            // dx = dy Wᵀ: (r, i) = Σ_o dy[r, o] w[i, o].
            let wt = Strided {
                rs: ws.cs,
                cs: ws.rs,
            };
            gemm_new_t(rows, n_in, n_out, (&g, gs), (&wa, wt), t_dx)
        })
    };
    let dwb_job = || {
        let dw = need[1].then(|| {
            let xa = operand(x);
            // dW = xᵀ dy: (i, o) = Σ_r x[r, i] dy[r, o].
            let xt = Strided { rs: 1, cs: n_in };
            gemm_new_t(n_in, n_out, rows, (&xa, xt), (&g, gs), t_dw)
        });
        (dw, need[2].then(|| narrow(column_sums(dy, rows, n_out))))
    };
    let (dx, (dw, db)) = if both {
        pool::join(dx_job, dwb_job)
    } else {
        (dx_job(), dwb_job())
    };
    LinearGrads { dx, dw, db }
}
