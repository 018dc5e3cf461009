//! Attention on CUDA through the Triton kernels (`triton/attention.py`, launch table
//! `cuda_kernels/attention.rs`): `attn_fwd` saves the log-sum-exp (f32 `[B, H, T]`); the
//! backward runs `attn_bwd_delta` (`D_i = <dO_i, O_i>`), `attn_bwd_dkdv` (one program per key
//! block of a kv head, summing its query heads in order: no atomics) and `attn_bwd_dq`. The
//! formulas are the CPU kernel's (`kernel.rs`, `kernel/backward.rs`), as the interpreter check
//! of the Triton source verifies. Each kernel has several builds (`cuda_kernels::attention::
//! builds`: head size 64 or 128 with dropout compiled in or out, then the generic one); the
//! first whose table rules accept the launch runs.
//!
//! The kernels take every `[B, heads, T, D]` tensor with its own strides (D's is 1), so no copy
//! is made around them:
//!
//! * [`super::attention_qkv`]: q, k, v are read in place from GPT-2's `[B, T, 3C]` projection
//!   (row stride 3C, head stride D, at columns 0, C, 2C), the output is written as `[B, T, C]`
//!   rows, and dq, dk, dv are written straight into one packed `[B, T, 3C]` gradient;
//! * [`super::attention`] / [`super::attention_merged`]: q, k, v are read as they come (Llama's
//!   rotated q, k are contiguous `[B, H, T, D]`, its v the `[B, T, KV, D]` projection seen as
//!   `[B, KV, T, D]` by a transpose); the merged output and its gradient are `[B, T, H * D]`
//!   rows; each gradient is written in its input's order of dimensions (dv into a `[B, T, KV,
//!   D]` buffer returned as the same transposed view, so the transpose's and the reshape's
//!   backward are views too).
//!
//! An input is copied only when the kernels cannot read it (a last stride other than 1, a
//! start that is not 16-byte aligned: [`super::rows_input`]).

use super::config::Resolved;
use super::kernel::{Geom, View};
use super::layout::{order, permuted};
use crate::cuda_kernels::attention::builds;
use crate::cuda_kernels::launch::{cuda_of, launch_first, Buf, CudaIn, Output};
use crate::cuda_kernels::{triton_input, Scalar};
use crate::op::{Grads, Saved};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout, Result, Shape, Tensor};

/// The scalars of the tiled kernels, in the table's order: scale, causal, window, p_drop,
/// keep, then the dropout key as lo / hi i32 bit patterns of seed, site and offset.
fn scalars(g: &Geom, r: &Resolved) -> Vec<Scalar> {
    // a window of T or more keys hides nothing from T causal queries: 0 (none), which also
    // keeps the kernel's `n0 + BLOCK_N - 1 + window` inside i32
    let window = match r.window {
        Some(w) if w < g.tk => w as i32,
        _ => 0,
    };
    // 1 / (1 - p) in f64, rounded to f32: the CPU kernel's `keep` for f32, bf16, f16 inputs
    let keep = (1.0 / (1.0 - f64::from(r.dropout))) as f32;
    let mut s = vec![
        Scalar::F32(r.scale as f32),
        Scalar::I32(i32::from(r.causal)),
        Scalar::I32(window),
        Scalar::F32(r.dropout),
        Scalar::F32(keep),
    ];
    for x in [r.key.seed, r.key.site, r.key.offset] {
        // the bits of each u64 half, as the kernel's `_u32` reads them back
        s.extend(crate::cuda_kernels::dropout::words(x).map(Scalar::I32));
    }
    s
}

/// The `DOC` argument `[B, T]`: the u32 document ids (passed as i32 bits: the kernels only
/// compare them), or zeros when there are none (every key is then in the query's document).
fn doc(r: &Resolved, g: &Geom, dev: &CudaDevice) -> Result<Tensor> {
    match &r.doc_ids {
        Some(ids) => triton_input(ids),
        None => Tensor::zeros((g.b, g.tk), DType::I32, &Device::Cuda(dev.clone())),
    }
}

/// `[B, heads, T, D]` of the rows `v` describes in a storage that starts at `base` (the
/// tensor's own start offset).
fn heads_layout(g: &Geom, heads: usize, v: View, base: usize) -> Layout {
    let shape = Shape::from((g.b, heads, g.tq, g.d));
    Layout::new(shape, vec![v.sb, v.sh, v.st, 1], base + v.off)
}

/// The output of the forward: `[B, T, H * D]` rows (`merged`) or `[B, H, T, D]`, and the
/// `[B, H, T, D]` view of it the kernels write (`g.o`).
fn out_buffer(g: &Geom, merged: bool, dev: &CudaDevice, dt: DType) -> Result<(Output, Layout)> {
    let o = if merged {
        Output::new(dev, (g.b, g.tq, g.h * g.d), dt)?
    } else {
        Output::new(dev, (g.b, g.h, g.tq, g.d), dt)?
    };
    Ok((o, heads_layout(g, g.h, g.o, 0)))
}

/// `attn_fwd` on q, k, v (views): the output (see [`out_buffer`]); the log-sum-exp into `saved`.
#[allow(clippy::too_many_arguments)]
fn fwd(
    g: &Geom,
    r: &Resolved,
    [q, k, v]: [Buf<'_>; 3],
    dev: &CudaDevice,
    dt: DType,
    merged: bool,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let (mut o, lo) = out_buffer(g, merged, dev, dt)?;
    let mut lse = Output::new(dev, (g.b, g.h, g.tq), DType::F32)?;
    let doc = doc(r, g, dev)?;
    {
        let (gd, ld) = doc.storage_and_layout();
        let tensors = vec![
            q,
            k,
            v,
            Buf::read(cuda_of(&gd)?, ld).bits_as(DType::I32)?,
            Buf::write_as(&mut o, lo),
            Buf::write(&mut lse),
        ];
        launch_first(&builds(r.dropout > 0.0).fwd, dt, tensors, &scalars(g, r))?;
    }
    saved.set(lse.into_tensor());
    Ok(o.into_parts())
}

/// The forward of [`super::attention_qkv`] on the `[B, T, 3C]` projection, read in place.
pub(super) fn qkv_fwd(
    (s, l): CudaIn<'_>,
    g: &Geom,
    r: &Resolved,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let read = |v: View| Buf::read(s, &heads_layout(g, g.h, v, l.start_offset()));
    let ins = [read(g.q), read(g.k), read(g.v)];
    fwd(g, r, ins, s.device(), s.dtype(), true, saved)
}

/// The forward of [`super::attention`] / [`super::attention_merged`] on q, k, v as they come.
pub(super) fn bhtd_fwd(
    [(sq, lq), (sk, lk), (sv, lv)]: [CudaIn<'_>; 3],
    g: &Geom,
    r: &Resolved,
    merge: bool,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let ins = [Buf::read(sq, lq), Buf::read(sk, lk), Buf::read(sv, lv)];
    fwd(g, r, ins, sq.device(), sq.dtype(), merge, saved)
}

/// Where the backward writes its gradients: `grads` (one buffer, or one per input) and, per
/// gradient, the index of its buffer and its `[B, heads, T, D]` view there.
struct Targets {
    grads: Vec<Output>,
    views: [(usize, Layout); 3],
}

/// The backward kernels. `ins`: the storages of q, k, v (one for a packed projection) and the
/// `[B, heads, T, D]` views of q, k, v in them; `o`, `dout`: the output and its gradient as
/// `[B, H, T, D]` views; `need`: which of dq and dk, dv to compute (the others are not
/// launched; their part of `t.grads` is left unwritten).
#[allow(clippy::too_many_arguments)]
fn bwd(
    g: &Geom,
    r: &Resolved,
    ins: (&[&CudaStorage], [(usize, Layout); 3]),
    (so, lo): (&CudaStorage, Layout),
    (sd, ld): (&CudaStorage, Layout),
    lse: &Tensor,
    [need_q, need_kv]: [bool; 2],
    t: &mut Targets,
) -> Result<()> {
    let dt = so.dtype();
    let dev = so.device();
    let (lse, doc) = (triton_input(lse)?, doc(r, g, dev)?);
    let ((gl, ll), (gd, ldoc)) = (lse.storage_and_layout(), doc.storage_and_layout());
    let (sl, sdoc) = (cuda_of(&gl)?, cuda_of(&gd)?);
    let builds = builds(r.dropout > 0.0);
    let mut delta = Output::new(dev, (g.b, g.h, g.tq), DType::F32)?;
    let tensors = vec![
        Buf::read(so, &lo),
        Buf::read(sd, &ld),
        Buf::write(&mut delta),
    ];
    launch_first(&builds.delta, dt, tensors, &[])?;
    let cfg = scalars(g, r);
    let (stores, views) = ins;
    // what both kernels read, in their argument order (their outputs follow)
    let reads = || -> Result<Vec<_>> {
        let read = |i: usize| Buf::read(stores[views[i].0], &views[i].1);
        Ok(vec![
            read(0),
            read(1),
            read(2),
            Buf::read(sdoc, ldoc).bits_as(DType::I32)?,
            Buf::read(sd, &ld),
            Buf::read(sl, ll),
            Buf::read_output(&delta),
        ])
    };
    let [(iq, lq), (ik, lk), (iv, lv)] = t.views.clone();
    if need_kv {
        let mut tensors = reads()?;
        if ik == iv {
            tensors.push(Buf::write_as(&mut t.grads[ik], lk));
            tensors.push(Buf::alias(tensors.len() - 1, lv));
        } else {
            let (a, b) = two_mut(&mut t.grads, ik, iv)?;
            tensors.extend([Buf::write_as(a, lk), Buf::write_as(b, lv)]);
        }
        launch_first(&builds.dkdv, dt, tensors, &cfg)?;
    }
    if need_q {
        let mut tensors = reads()?;
        tensors.push(Buf::write_as(&mut t.grads[iq], lq));
        launch_first(&builds.dq, dt, tensors, &cfg)?;
    }
    Ok(())
}

/// Two distinct elements of `v`, mutably.
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> Result<(&mut T, &mut T)> {
    if i == j || i.max(j) >= v.len() {
        bail!(
            "attention: gradient buffers {i} and {j} are not two of {}",
            v.len()
        )
    }
    let (lo, hi) = v.split_at_mut(i.max(j));
    let (a, b) = (&mut lo[i.min(j)], &mut hi[0]);
    Ok(if i < j { (a, b) } else { (b, a) })
}

/// `o` (the op's own output) and `dout` (in the io dtype), contiguous, for their `[B, H, T, D]`
/// views through `g.o`.
fn out_views(o: &Tensor, dout: &Tensor) -> Result<[Tensor; 2]> {
    let dout = dout.to_dtype(o.dtype())?;
    Ok([o.contiguous()?, super::rows_input(&dout.contiguous()?)?])
}

/// The gradients of [`super::attention_qkv`]: `[dqkv, None, None]`, dq, dk, dv written into
/// one packed `[B, T, 3C]` buffer.
pub(super) fn qkv_bwd(
    g: &Geom,
    r: &Resolved,
    qkv: &Tensor,
    o: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
) -> Result<Grads> {
    let Device::Cuda(dev) = qkv.device() else {
        bail!("attention_qkv: the Triton backward needs CUDA tensors")
    };
    let [o, dout] = out_views(o, dout)?;
    let (gx, lx) = qkv.storage_and_layout();
    let ((go, lo), (gd, ld)) = (o.storage_and_layout(), dout.storage_and_layout());
    let at = |v: View, base: usize| heads_layout(g, g.h, v, base);
    let views = |base: usize| [(0, at(g.q, base)), (0, at(g.k, base)), (0, at(g.v, base))];
    let mut t = Targets {
        grads: vec![Output::new(dev, qkv.dims(), qkv.dtype())?],
        views: views(0),
    };
    bwd(
        g,
        r,
        (&[cuda_of(&gx)?], views(lx.start_offset())),
        (cuda_of(&go)?, at(g.o, lo.start_offset())),
        (cuda_of(&gd)?, at(g.o, ld.start_offset())),
        lse,
        [true, true],
        &mut t,
    )?;
    let dqkv = t.grads.remove(0).into_tensor();
    Ok([Some(dqkv), None, None])
}

/// A fresh gradient for the `[B, heads, T, D]` tensor `x`, its dimensions in `x`'s order
/// (Llama's v: `[B, T, KV, D]` seen as `[B, KV, T, D]`, so the buffer is `[B, T, KV, D]`), D
/// innermost: the buffer, the view the kernels write and the permutation back to `x`'s dims.
fn grad_like(x: &Tensor, dev: &CudaDevice) -> Result<(Output, Layout, [usize; 4])> {
    let dims = x.dims();
    let (shape, strides, back) = permuted(dims, order(dims, x.stride()));
    let out = Output::new(dev, shape, x.dtype())?;
    Ok((out, Layout::new(Shape::from(dims), strides, 0), back))
}

/// The gradients of [`super::attention`] (`merge`: [`super::attention_merged`], whose output
/// and its gradient are `[B, T, H * D]`): `[dq, dk, dv]` (`None` where not needed), each in
/// its input's order of dimensions ([`grad_like`]).
pub(super) fn bhtd_bwd(
    g: &Geom,
    r: &Resolved,
    [q, k, v]: [&Tensor; 3],
    (o, dout): (&Tensor, &Tensor),
    lse: &Tensor,
) -> Result<Grads> {
    let (need_q, need_kv) = (q.track_op(), k.track_op() || v.track_op());
    if !(need_q || need_kv) {
        return Ok([None, None, None]);
    }
    let Device::Cuda(dev) = q.device() else {
        bail!("attention: the Triton backward needs CUDA tensors")
    };
    let [o, dout] = out_views(o, dout)?;
    let guards = [q, k, v].map(|x| x.storage_and_layout());
    let stores = guards
        .iter()
        .map(|(s, _)| cuda_of(s))
        .collect::<Result<Vec<_>>>()?;
    let ((go, lo), (gd, ld)) = (o.storage_and_layout(), dout.storage_and_layout());
    let (mut grads, mut views, mut perms) = (Vec::new(), Vec::new(), Vec::new());
    for (i, x) in [q, k, v].into_iter().enumerate() {
        let (out, l, p) = grad_like(x, dev)?;
        grads.push(out);
        views.push((i, l));
        perms.push(p);
    }
    let views: [(usize, Layout); 3] = [views[0].clone(), views[1].clone(), views[2].clone()];
    let mut t = Targets { grads, views };
    let ins = [0, 1, 2].map(|i| (i, guards[i].1.clone()));
    bwd(
        g,
        r,
        (&stores, ins),
        (cuda_of(&go)?, heads_layout(g, g.h, g.o, lo.start_offset())),
        (cuda_of(&gd)?, heads_layout(g, g.h, g.o, ld.start_offset())),
        lse,
        [need_q, need_kv],
        &mut t,
    )?;
    let mut out = t
        .grads
        .into_iter()
        .zip(perms)
        .map(|(b, p)| b.into_tensor().permute(p));
    let mut next = |want: bool| -> Result<Option<Tensor>> {
        match out.next() {
            Some(x) if want => Ok(Some(x?)),
            _ => Ok(None),
        }
    };
    Ok([next(need_q)?, next(need_kv)?, next(need_kv)?])
}
