//! Token embedding: the rows of a table `w [V, C]` picked by ids, with a deterministic
//! backward that accumulates in f32.
//!
//! The forward gathers rows: `y[p] = w[ids[p]]`, the CPU kernel on the CPU, Candle's
//! `index_select` elsewhere (a gather is a copy: no arithmetic, the same bits on every device,
//! so CUDA keeps Candle's kernel rather than a Triton one). The backward writes every row of
//! `dW [V, C]` once: row `v` is the sum of the rows of `dy` at the positions holding `v`, added
//! in ascending position in the accumulation dtype (f32 for f32 / bf16 / f16, f64 for f64) and
//! rounded once to the table's dtype; rows of ids absent from the batch are zero. Ids get no
//! gradient and `dy` is read by nothing else.
//!
//! **Against Candle's `embedding`** (`index_select`, whose backward is `index_add` in the
//! table's dtype): for f32 and f64 tables each row of `dW` is the same chain of adds in the
//! same order starting from 0, so the same bits; for bf16 / f16 tables `index_add` rounds
//! after every add, this op once (more accurate: the error of one rounding, not of one per
//! repeated id). Where the table also gets another gradient (a tied language-model head),
//! Candle adds this op's `dW` to it once, where `index_add` added each row of `dy` into it.
//!
//! **The order, from the host.** The positions sorted by id (a counting sort: ascending
//! position within each id) and each id's segment of them are computed on the host from the
//! ids as the caller built them (`host_ids`, e.g. the batch's token ids before their upload),
//! so a GPU backward reads nothing back. Without them the op reads the ids tensor once, in
//! the backward, and counts it ([`id_reads`]).
//!
//! On CUDA with the Triton kernels switched on (`cuda_kernels::set_triton`), the backward is
//! `embedding_bwd` (`triton/embedding.py`): one program per (vocabulary row, column block)
//! adding its segment's rows of `dy` in f32 in the same order (the CPU kernel's bits), one
//! launch, no memset (absent rows are written as zeros). Elsewhere (Metal, CUDA with the
//! kernels off) the backward is Candle's `index_add` into an f32 zero table (deterministic,
//! sums in f32), rounded once.

#[cfg(feature = "cuda")]
mod cuda;

use crate::cpu::{self, Elem, Real};
use crate::op::{self, Grads, In, Kernel};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Result, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Reads of an ids tensor by the backward (no `host_ids` given), since the process started.
static ID_READS: AtomicU64 = AtomicU64::new(0);

/// How many times a backward of [`embedding`] read its ids tensor (on a GPU: a device to host
/// copy and a sync) because the call gave no `host_ids`; process-wide, from 0.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::embedding::{embedding, id_reads};
/// let w = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let ids = Tensor::new(&[1u32, 1, 0], &Device::Cpu)?;
/// let before = id_reads();
/// embedding(&w, &ids, Some(&[1, 1, 0][..]))?.sum_all()?.backward()?;
/// assert_eq!(id_reads(), before);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn id_reads() -> u64 {
    ID_READS.load(Ordering::Relaxed)
}

/// The rows of `w [V, C]` at `ids` (u32, any shape): `[ids.dims.., C]` in `w`'s dtype.
///
/// Differentiable in `w` (the module doc says how: every row of `dW` summed in f32 in
/// ascending position, rounded once). `host_ids`: the same ids, flat, in row-major order, as
/// the caller holds them on the host; they order the backward without reading `ids` back
/// (given, they are checked for length and range on the host; `ids` itself is trusted to hold
/// them). `None`: the backward reads `ids` once.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fused::embedding::embedding;
/// let w = Var::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu)?;
/// let ids = Tensor::new(&[[2u32, 0], [2, 2]], &Device::Cpu)?;
/// let y = embedding(&w, &ids, Some(&[2, 0, 2, 2][..]))?;
/// assert_eq!(y.dims(), &[2, 2, 2]);
/// assert_eq!(y.get(0)?.to_vec2::<f32>()?, [[5., 6.], [1., 2.]]);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&w).unwrap().to_vec2::<f32>()?, [[1., 1.], [0., 0.], [3., 3.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn embedding(w: &Tensor, ids: &Tensor, host_ids: Option<&[u32]>) -> Result<Tensor> {
    let (v, c) = check("embedding", w, ids)?;
    let host = match host_ids {
        Some(h) => {
            if h.len() != ids.elem_count() {
                bail!(
                    "embedding: host_ids hold {} ids, ids has {} ({:?})",
                    h.len(),
                    ids.elem_count(),
                    ids.shape()
                )
            }
            check_range("embedding", h, v)?;
            Some(Arc::<[u32]>::from(h))
        }
        None => None,
    };
    let mut dims = ids.dims().to_vec();
    dims.push(c);
    let op = EmbeddingOp { v, c, host };
    if cpu::has_kernel(w) && ids.device().is_cpu() {
        let (w, ids) = (w.contiguous()?, ids.contiguous()?);
        return op::apply(op, &[&w, &ids], None, None);
    }
    let y = w
        .detach()
        .index_select(&ids.flatten_all()?, 0)?
        .reshape(dims)?;
    op::apply(op, &[w, ids], None, Some(y))
}

/// The reference: Candle's `index_select` of `w`'s rows at `ids`, reshaped to `[ids.dims.., C]`
/// (its backward is Candle's `index_add`, in `w`'s dtype).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let ids = Tensor::new(&[1u32, 0, 1], &Device::Cpu)?;
/// let y = candle_fused::embedding::embedding_composite(&w, &ids)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[3., 4.], [1., 2.], [3., 4.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn embedding_composite(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (_, c) = check("embedding_composite", w, ids)?;
    let mut dims = ids.dims().to_vec();
    dims.push(c);
    w.index_select(&ids.flatten_all()?, 0)?.reshape(dims)
}

/// Checks the arguments; returns `(V, C)`.
fn check(op: &str, w: &Tensor, ids: &Tensor) -> Result<(usize, usize)> {
    let (v, c) = match w.dims() {
        &[v, c] => (v, c),
        d => bail!("{op}: the table must be [V, C], got {d:?}"),
    };
    op::check_float(op, "the table", w)?;
    if ids.dtype() != DType::U32 {
        bail!("{op}: ids must be u32, got {:?}", ids.dtype())
    }
    if !ids.device().same_device(w.device()) {
        bail!("{op}: ids and the table are on different devices")
    }
    if u32::try_from(ids.elem_count()).is_err() || u32::try_from(v).is_err() {
        bail!(
            "{op}: at most 2^32 - 1 ids and rows, got {} and {v}",
            ids.elem_count()
        )
    }
    Ok((v, c))
}

/// Errors on the first id `>= v`, naming its position.
fn check_range(op: &str, ids: &[u32], v: usize) -> Result<()> {
    match ids.iter().position(|&i| i as usize >= v) {
        Some(p) => bail!(
            "{op}: id {} at position {p} is out of range for a table of {v} rows",
            ids[p]
        ),
        None => Ok(()),
    }
}

/// The positions of the ids sorted by id, ascending position within an id (`order`), and
/// where each id's positions start: `order[start[v]..start[v + 1]]` (`start` has `V + 1`
/// entries; an absent id has an empty segment).
pub(crate) struct Segments {
    pub(crate) order: Vec<u32>,
    pub(crate) start: Vec<u32>,
}

impl Segments {
    /// The counting sort of `ids` (all `< v`, at most `u32::MAX` of them).
    pub(crate) fn new(ids: &[u32], v: usize) -> Self {
        let mut start = vec![0u32; v + 1];
        for &i in ids {
            start[i as usize + 1] += 1;
        }
        for k in 0..v {
            start[k + 1] += start[k];
        }
        let mut next = start[..v].to_vec();
        let mut order = vec![0u32; ids.len()];
        for (p, &i) in ids.iter().enumerate() {
            let slot = &mut next[i as usize];
            order[*slot as usize] = p as u32;
            *slot += 1;
        }
        Segments { order, start }
    }
}

/// `(w, ids)`: the table `[V, C]` and the ids.
struct EmbeddingOp {
    v: usize,
    c: usize,
    /// The ids as the caller holds them on the host, flat.
    host: Option<Arc<[u32]>>,
}

impl EmbeddingOp {
    /// The backward's order: from the host ids, else from `ids` read once (counted).
    fn segments(&self, ids: &Tensor) -> Result<Segments> {
        if let Some(h) = &self.host {
            return Ok(Segments::new(h, self.v));
        }
        ID_READS.fetch_add(1, Ordering::Relaxed);
        let h = ids.flatten_all()?.to_vec1::<u32>()?;
        check_range("embedding", &h, self.v)?;
        Ok(Segments::new(&h, self.v))
    }
}

impl Kernel for EmbeddingOp {
    fn name(&self) -> &'static str {
        "candle-fused-embedding"
    }

    fn cpu_fwd(&self, ins: &[In<'_>]) -> Result<(CpuStorage, Shape)> {
        let ((sw, lw), (si, li)) = (ins[0], ins[1]);
        let ids = match (si, li.contiguous_offsets()) {
            (CpuStorage::U32(s), Some((a, b))) => &s[a..b],
            _ => bail!("embedding: ids must be contiguous u32"),
        };
        check_range("embedding", ids, self.v)?;
        let mut dims = li.dims().to_vec();
        dims.push(self.c);
        cpu::dispatch!(sw.dtype(), T => {
            let ws = cpu::contiguous::<T>(sw, lw)?;
            Ok((T::storage(gather(ws, ids, self.c)), Shape::from(dims)))
        })
    }

    fn bwd(&self, ins: &[&Tensor], _y: &Tensor, dy: &Tensor) -> Result<Grads> {
        let (w, ids) = (ins[0], ins[1]);
        if !w.track_op() {
            return Ok([None, None, None]);
        }
        let dt = w.dtype();
        let (v, c) = (self.v, self.c);
        #[cfg(feature = "cuda")]
        if crate::cuda_kernels::triton_for(dy)
            && crate::cuda_kernels::may_launch("embedding_bwd")
            && cuda::fits(v, c, dy.elem_count() / c.max(1))
        {
            let seg = self.segments(ids)?;
            return Ok([Some(cuda::bwd(dy, dt, &seg, v, c)?), None, None]);
        }
        if !(cpu::has_kernel(w) && dy.device().is_cpu()) {
            return Ok([Some(composite_bwd(ids, dy, dt, v, c)?), None, None]);
        }
        let seg = self.segments(ids)?;
        let dy = dy.to_dtype(dt)?.contiguous()?;
        cpu::dispatch!(dt, T => {
            cpu::with_slice::<T, _>(&dy, |dys| {
                let dw = cpu::tensor(scatter_add(dys, &seg, c), (v, c))?;
                Ok([Some(dw), None, None])
            })
        })
    }
}

/// `dW` by Candle's `index_add` into an f32 (f64 for f64) zero table, rounded once (devices
/// without a kernel).
fn composite_bwd(ids: &Tensor, dy: &Tensor, dt: DType, v: usize, c: usize) -> Result<Tensor> {
    let acc = if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let dy = dy.detach().to_dtype(acc)?.reshape(((), c))?;
    let zeros = Tensor::zeros((v, c), acc, dy.device())?;
    zeros
        .index_add(&ids.detach().flatten_all()?, &dy, 0)?
        .to_dtype(dt)
}

/// The forward: row `p` of the output is row `ids[p]` of `w` (`ids` in range).
fn gather<T: Elem>(w: &[T], ids: &[u32], c: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(ids.len() * c);
    for &i in ids {
        let i = i as usize;
        y.extend_from_slice(&w[i * c..(i + 1) * c]);
    }
    y
}

/// The backward: row `v` of `dW` is the sum of the rows `order[start[v]..start[v + 1]]` of
/// `dy` (`[N, c]`), added in that order from 0 in the accumulation type, rounded once.
pub(crate) fn scatter_add<T: Elem>(dy: &[T], seg: &Segments, c: usize) -> Vec<T> {
    let v = seg.start.len() - 1;
    let mut dw = vec![T::from_acc(T::Acc::ZERO); v * c];
    let per_row = c * dy.len().div_ceil(c.max(1)).div_ceil(v.max(1)).max(1);
    cpu::for_rows(&mut dw, c, per_row, |r, row| {
        let (a, b) = (seg.start[r] as usize, seg.start[r + 1] as usize);
        if a == b {
            return;
        }
        let mut acc = vec![T::Acc::ZERO; c];
        for &p in &seg.order[a..b] {
            let p = p as usize;
            for (s, d) in acc.iter_mut().zip(&dy[p * c..(p + 1) * c]) {
                *s += d.acc();
            }
        }
        for (o, s) in row.iter_mut().zip(acc) {
            *o = T::from_acc(s);
        }
    });
    dw
}
