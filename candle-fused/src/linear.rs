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
//! ([`crate::gemm_bf16`]: `vdpbf16ps`, products exact in f32, f32 sums), so it reads half the
//! bytes and does twice the multiply-adds per instruction of f32. Elsewhere, and for f16, the
//! 16-bit inputs are widened to f32 for Candle's GEMM (which has no 16-bit CPU kernel). Either
//! way the GEMM accumulates in f32 and the result is rounded to the storage type once.

use std::borrow::Cow;

use crate::cpu::{self, Elem, Real};
use crate::fallback::Precomputed;
use crate::gemm_bf16;
use crate::pool::{self, Shared};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, Layout, MetalStorage, Result, Shape,
    Tensor,
};

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
    if !cpu::has_kernel(&x) {
        let y = linear_composite(&x.detach(), &w.detach(), b.map(|b| b.detach()).as_ref())?;
        let tracked: Vec<&Tensor> = [Some(&x), Some(w), b].into_iter().flatten().collect();
        if !crate::fallback::tracks(&tracked) {
            return Ok(y);
        }
        let op = LinearOp {
            pre: Some(Precomputed::new(y)?),
            n_in,
            n_out,
        };
        return match b {
            Some(b) => x.apply_op3(w, b, op),
            None => x.apply_op2(w, op),
        };
    }
    let op = LinearOp {
        pre: None,
        n_in,
        n_out,
    };
    match b {
        Some(b) => x.apply_op3(w, &b.contiguous()?, op),
        None => x.apply_op2(w, op),
    }
}

/// The composite reference: `x` flattened to 2-D, Candle's `matmul`, `broadcast_add`.
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
        if b.dtype() != x.dtype() {
            bail!(
                "candle-fused linear: bias dtype {:?} differs from input {:?}",
                b.dtype(),
                x.dtype()
            );
        }
    }
    if w.dtype() != x.dtype() {
        bail!(
            "candle-fused linear: weight dtype {:?} differs from input {:?}",
            w.dtype(),
            x.dtype()
        );
    }
    if !w.device().same_device(x.device()) {
        bail!("candle-fused linear: weight and input are on different devices");
    }
    Ok((n_in, n_out))
}

struct LinearOp {
    pre: Option<Precomputed>,
    n_in: usize,
    n_out: usize,
}

/// A 2-D operand: element `(r, c)` at `r * rs + c * cs` of its slice.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    rs: usize,
    cs: usize,
}

/// The slice a strided 2-D `layout` reads in `s` (from its start offset) and its strides.
pub(crate) fn strided<'a, T: Elem>(s: &'a CpuStorage, l: &Layout) -> Result<(&'a [T], Strided)> {
    let st = l.stride();
    if st.len() != 2 {
        bail!("candle-fused linear: the weight must be 2-D");
    }
    let data = &T::slice(s)?[l.start_offset()..];
    let (r, c) = (l.dims()[0], l.dims()[1]);
    let need = if r * c == 0 {
        0
    } else {
        (r - 1) * st[0] + (c - 1) * st[1] + 1
    };
    if data.len() < need {
        bail!("candle-fused linear: weight storage too short for its layout");
    }
    Ok((
        data,
        Strided {
            rs: st[0],
            cs: st[1],
        },
    ))
}

/// The data as the accumulation type: borrowed when `T` is it (f32, f64), widened otherwise.
fn widen<T: Elem>(s: &[T]) -> Cow<'_, [T::Acc]> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<T::Acc>() {
        // SAFETY: `T` and `T::Acc` are the same type (checked above), so the slice is valid
        // as `[T::Acc]` with the same length and alignment.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const T::Acc, s.len()) })
    } else {
        Cow::Owned(s.iter().map(|v| v.acc()).collect())
    }
}

/// A GEMM operand as the kernels take it: bf16 as stored (for [`gemm_bf16`]), or in the
/// accumulation type (borrowed for f32 / f64, widened for 16-bit types).
enum Operand<'a, A: Clone> {
    Bf16(&'a [half::bf16]),
    Acc(Cow<'a, [A]>),
}

/// `s` as a GEMM operand: bf16 stays bf16 when the CPU runs the bf16 kernel, anything else
/// goes through [`widen`].
fn operand<T: Elem>(s: &[T]) -> Operand<'_, T::Acc> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<half::bf16>() && gemm_bf16::available()
    {
        // SAFETY: `T` is `bf16` (checked above): same length, alignment and bits.
        let b = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const half::bf16, s.len()) };
        Operand::Bf16(b)
    } else {
        Operand::Acc(widen(s))
    }
}

/// Rounds back to `T` (moves the buffer when `T` is the accumulation type).
fn narrow<T: Elem>(v: Vec<T::Acc>) -> Vec<T> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<T::Acc>() {
        let mut v = std::mem::ManuallyDrop::new(v);
        // SAFETY: same type (checked above): pointer, length and capacity stay valid, and the
        // original vector is not dropped.
        unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut T, v.len(), v.capacity()) }
    } else {
        v.into_iter().map(T::from_acc).collect()
    }
}

/// `dst [m x n] (row-major) = acc * dst + lhs [m x k] · rhs [k x n]`, split into `threads`
/// bands run on [`pool`] when large (the split is over rows or columns of `dst`, never over
/// `k`, so the sums do not depend on the thread count). Two bf16 operands run [`gemm_bf16`], two in the
/// accumulation type Candle's `gemm` crate.
///
/// # Safety
/// `dst` is valid for writes of `m * n` elements (and initialised when `acc`); nothing else
/// accesses them during the call. With `acc == false` the elements are only written, never
/// read (`gemm` treats a zero `alpha` as "overwrite"), so they may be uninitialised.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<A: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut A,
    acc: bool,
    lhs: (&Operand<'_, A>, Strided),
    rhs: (&Operand<'_, A>, Strided),
    threads: usize,
) {
    let (lhs, rhs) = match (lhs, rhs) {
        ((Operand::Acc(l), ls), (Operand::Acc(r), rs)) => ((&l[..], ls), (&r[..], rs)),
        ((Operand::Bf16(l), ls), (Operand::Bf16(r), rs)) => {
            assert!(
                std::any::TypeId::of::<A>() == std::any::TypeId::of::<f32>(),
                "candle-fused linear: bf16 accumulates in f32"
            );
            let mat = |data, s: Strided| gemm_bf16::Mat {
                data,
                rs: s.rs,
                cs: s.cs,
            };
            // SAFETY: `A` is f32 (asserted); `dst` per this function's contract, which is
            // `gemm_bf16::gemm`'s; the kernel is available (`operand` checked).
            unsafe {
                gemm_bf16::gemm(
                    gemm_bf16::Kernel::Avx512Bf16,
                    (m, n, k),
                    dst as *mut f32,
                    acc,
                    mat(l, ls),
                    mat(r, rs),
                    threads > 1,
                )
            };
            return;
        }
        _ => unreachable!("candle-fused linear: both operands come from one dtype"),
    };
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            for i in 0..m * n {
                // SAFETY: in bounds by the caller's contract.
                unsafe { dst.add(i).write(A::ZERO) };
            }
        }
        return;
    }
    let last =
        |(s, st): (&[A], Strided), r: usize, c: usize| (r - 1) * st.rs + (c - 1) * st.cs < s.len();
    assert!(
        last(lhs, m, k) && last(rhs, k, n),
        "candle-fused linear: operand out of bounds"
    );
    // One block of dst (rows r0..r1, columns c0..c1) on the calling thread, `k` summed in
    // fixed chunks of at most KC, accumulated in order. `gemm` itself blocks `k` by rules that
    // depend on the output's size (outputs up to 64 x 64 in 512-long blocks, larger ones in
    // equal blocks of about 512): with every call's `k` at most 512 both rules give one block,
    // so an element's sum is the same whichever band computes it.
    let kc = k.div_ceil(k.div_ceil(KC));
    let block = |dst: Shared<A>, (r0, r1): (usize, usize), (c0, c1): (usize, usize)| {
        for (i, k0) in (0..k).step_by(kc).enumerate() {
            // SAFETY: the block lies inside dst (m x n, row stride n, valid per the caller)
            // and, with rows k0..k0 + kc, inside both operands (asserted above); blocks of one
            // call are disjoint.
            unsafe {
                gemm::gemm(
                    r1 - r0,
                    c1 - c0,
                    kc.min(k - k0),
                    dst.at(r0 * n + c0),
                    1,
                    n as isize,
                    acc || i > 0,
                    lhs.0.as_ptr().add(r0 * lhs.1.rs + k0 * lhs.1.cs),
                    lhs.1.cs as isize,
                    lhs.1.rs as isize,
                    rhs.0.as_ptr().add(c0 * rhs.1.cs + k0 * rhs.1.rs),
                    rhs.1.cs as isize,
                    rhs.1.rs as isize,
                    A::ONE,
                    A::ONE,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            }
        }
    };
    let dst = Shared(dst);
    // Split dst into `threads` bands of rows or of columns (whichever dimension is longer, in
    // multiples of 16 so every band keeps the full micro-kernel). Outputs of at most 256
    // elements take another `gemm` kernel (dot products), so no band may be that small unless
    // the whole output is (then it is not split).
    let along_rows = m >= n;
    let (len, other) = if along_rows { (m, n) } else { (n, m) };
    let band = len.div_ceil(threads.max(1)).next_multiple_of(16);
    let bands = len.div_ceil(band);
    let smallest = len - (bands - 1) * band;
    if threads < 2 || bands < 2 || m * n * k < 1 << 18 || smallest * other <= 256 {
        block(dst, (0, m), (0, n));
        return;
    }
    pool::for_each(bands, |i| {
        let (lo, hi) = (i * band, ((i + 1) * band).min(len));
        if along_rows {
            block(dst, (lo, hi), (0, n));
        } else {
            block(dst, (0, m), (lo, hi));
        }
    });
}

/// The longest `k` one `gemm` call sums (see [`gemm_raw`]).
const KC: usize = 512;

/// A new `m x n` matrix `lhs · rhs`, written once by the GEMM (no zero-fill first).
fn gemm_new<A: Real>(
    m: usize,
    n: usize,
    k: usize,
    lhs: (&Operand<'_, A>, Strided),
    rhs: (&Operand<'_, A>, Strided),
    threads: usize,
) -> Vec<A> {
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: the buffer has capacity m x n, is written in full by `gemm_raw` (acc = false) and
    // only then given its length.
    unsafe {
        gemm_raw(m, n, k, out.as_mut_ptr(), false, lhs, rhs, threads);
        out.set_len(m * n);
    }
    out
}

pub(crate) fn fwd_kernel<T: Elem>(
    x: &[T],
    (w, ws): (&[T], Strided),
    b: Option<&[T]>,
    n_in: usize,
    n_out: usize,
) -> Vec<T> {
    let rows = x.len().checked_div(n_in).unwrap_or(0);
    let xa = operand(x);
    let wa = operand(w);
    let x2 = (&xa, Strided { rs: n_in, cs: 1 });
    let threads = pool::parts();
    let out = match b {
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
    };
    narrow(out)
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

pub(crate) struct Grads<T> {
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
) -> Grads<T> {
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
            narrow(gemm_new(rows, n_in, n_out, (&g, gs), (&wa, wt), t_dx))
        })
    };
    let dwb_job = || {
        let dw = need[1].then(|| {
            let xa = operand(x);
            // dW = xᵀ dy: (i, o) = Σ_r x[r, i] dy[r, o].
            let xt = Strided { rs: 1, cs: n_in };
            narrow(gemm_new(n_in, n_out, rows, (&xa, xt), (&g, gs), t_dw))
        });
        (dw, need[2].then(|| narrow(column_sums(dy, rows, n_out))))
    };
    let (dx, (dw, db)) = if both {
        pool::join(dx_job, dwb_job)
    } else {
        (dx_job(), dwb_job())
    };
    Grads { dx, dw, db }
}

impl LinearOp {
    fn fwd_cpu(
        &self,
        (sx, lx): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        if let Some(p) = &self.pre {
            return p.cpu();
        }
        let mut dims = lx.dims().to_vec();
        if let Some(l) = dims.last_mut() {
            *l = self.n_out;
        }
        crate::dispatch!(sx.dtype(), T => {
            let xs = cpu::contiguous::<T>(sx, lx)?;
            let w = strided::<T>(sw, lw)?;
            let bs = b.map(|(s, l)| cpu::contiguous::<T>(s, l)).transpose()?;
            let y = fwd_kernel(xs, w, bs, self.n_in, self.n_out);
            Ok((T::storage(y), Shape::from(dims)))
        })
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let need = [x.track_op(), w.track_op(), b.is_some_and(Tensor::track_op)];
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
            return Ok((dx, dw, db));
        }
        let x = x.contiguous()?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        crate::dispatch!(x.dtype(), T => {
            cpu::with_slice::<T, _>(&x, |xs| {
                cpu::with_slice::<T, _>(&dy, |dys| {
                    let (sw, lw) = w.storage_and_layout();
                    let candle_core::Storage::Cpu(sw) = &*sw else {
                        bail!("candle-fused linear: weight not on the CPU");
                    };
                    let ws = strided::<T>(sw, lw)?;
                    let g = bwd_kernel(xs, ws, dys, n_in, n_out, need);
                    let dx = g.dx.map(|v| cpu::tensor(v, x.shape())).transpose()?;
                    let dw = g.dw.map(|v| cpu::tensor(v, (n_in, n_out))).transpose()?;
                    let db = g.db.map(|v| cpu::tensor(v, n_out)).transpose()?;
                    Ok((dx, dw, db))
                })
            })
        })
    }

    fn pre(&self) -> Result<&Precomputed> {
        match &self.pre {
            Some(p) => Ok(p),
            None => bail!("candle-fused linear: no kernel for this device"),
        }
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd_cpu((s1, l1), (s2, l2), None)
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.pre()?.cuda()
    }
    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        self.pre()?.metal()
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, None, dy)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "candle-fused-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd_cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.pre()?.cuda()
    }
    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        self.pre()?.metal()
    }
    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, w, Some(b), dy)
    }
}
