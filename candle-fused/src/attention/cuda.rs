//! Attention on CUDA through the Triton kernels (`triton/attention.py`, launch table
//! `cuda_kernels/attention.rs`): `attn_fwd` saves the log-sum-exp (f32 `[B, H, T]`); the
//! backward runs `attn_bwd_delta` (`D_i = <dO_i, O_i>`), `attn_bwd_dkdv` (one program per key
//! block of a kv head, summing its query heads in order: no atomics) and `attn_bwd_dq`. The
//! formulas are the CPU kernel's (`kernel.rs`, `kernel/backward.rs`), as the interpreter check
//! of the Triton source verifies. Each kernel has several builds (`cuda_kernels::attention::
//! builds`: head size 64 or 128 with dropout compiled in or out, then the generic one); the
//! first whose table rules accept the launch runs.
//!
//! The kernels take contiguous `[B, H, T, D]` (q, o, dO, dq) and `[B, KV, T, D]` (k, v, dk, dv)
//! tensors. [`super::attention`] passes its inputs as they are (made contiguous and 16-byte
//! aligned by `triton_input` when needed). The other two entry points pay copies around the
//! kernels (each one Candle copy kernel, memory-bound, small next to the attention itself):
//!
//! * [`super::attention_qkv`]: forward, q, k, v gathered out of `[B, T, 3C]` (one read and one
//!   write of the projection) and the output scattered to `[B, T, C]` (one of the output);
//!   backward, q, k, v gathered again (not kept from the forward: the graph holds no extra
//!   `B x T x 3C` buffer between forward and backward), o and dO to `[B, H, T, D]`, and `dqkv`
//!   assembled from dq, dk, dv (two copies each: heads merged, then concatenated).
//! * [`super::attention_merged`]: forward, the output scattered to `[B, T, H * D]`; backward, o
//!   and dO gathered back to `[B, H, T, D]`.
//!
//! Copy launches per layer, counted from this code path: `attention_qkv` 4 in the forward and
//! 11 in the backward (q, k, v, o, dO made contiguous; dq, dk, dv merged; the cat, one copy per
//! part), 15 in all; `attention_merged` 1 + 2. Passing the row strides to the kernels (3C for
//! q, k, v in the packed projection, C for o) and writing dq, dk, dv into the packed gradient
//! would remove every one of them; not done yet.

use super::composite::{merge_heads, split_heads};
use super::config::Resolved;
use super::kernel::{Geom, View};
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

/// `[B, heads, T, D]` of a contiguous storage: `(shape, layout)` of the heads that `v`
/// describes, from `base` (the storage's start offset).
fn heads_layout(g: &Geom, heads: usize, v: View, base: usize) -> (Shape, Layout) {
    let shape = Shape::from((g.b, heads, g.tq, g.d));
    let l = Layout::new(shape.clone(), vec![v.sb, v.sh, v.st, 1], base + v.off);
    (shape, l)
}

/// `attn_fwd` on contiguous q, k, v: the output `[B, H, T, D]`; the log-sum-exp into `saved`.
fn fwd(
    g: &Geom,
    r: &Resolved,
    [q, k, v]: [Buf<'_>; 3],
    dev: &CudaDevice,
    dt: DType,
    saved: &Saved,
) -> Result<Output> {
    let mut o = Output::new(dev, (g.b, g.h, g.tq, g.d), dt)?;
    let mut lse = Output::new(dev, (g.b, g.h, g.tq), DType::F32)?;
    let doc = doc(r, g, dev)?;
    {
        let (gd, ld) = doc.storage_and_layout();
        let tensors = vec![
            q,
            k,
            v,
            Buf::read(cuda_of(&gd)?, ld).bits_as(DType::I32)?,
            Buf::write(&mut o),
            Buf::write(&mut lse),
        ];
        launch_first(&builds(r.dropout > 0.0).fwd, dt, tensors, &scalars(g, r))?;
    }
    saved.set(lse.into_tensor());
    Ok(o)
}

/// `[B, H, T, D]` -> `[B, T, H * D]` (the merged rows the output projection reads).
fn merged(g: &Geom, o: Output) -> Result<(CudaStorage, Shape)> {
    let (s, _) = o.into_parts();
    let (b, h, t, d) = (g.b, g.h, g.tq, g.d);
    let l = Layout::new(Shape::from((b, t, h, d)), vec![h * t * d, d, t * d, 1], 0);
    Ok(Output::copy_of(&s, &l, (b, t, h * d))?.into_parts())
}

/// The forward of [`super::attention_qkv`] on the contiguous `[B, T, 3C]` projection.
pub(super) fn qkv_fwd(
    (s, l): CudaIn<'_>,
    g: &Geom,
    r: &Resolved,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let gather = |v: View| {
        let (shape, layout) = heads_layout(g, g.h, v, l.start_offset());
        Output::copy_of(s, &layout, shape)
    };
    let (q, k, v) = (gather(g.q)?, gather(g.k)?, gather(g.v)?);
    let ins = [
        Buf::read_output(&q),
        Buf::read_output(&k),
        Buf::read_output(&v),
    ];
    let o = fwd(g, r, ins, s.device(), s.dtype(), saved)?;
    merged(g, o)
}

/// The forward of [`super::attention`] / [`super::attention_merged`] on contiguous q, k, v.
pub(super) fn bhtd_fwd(
    [(sq, lq), (sk, lk), (sv, lv)]: [CudaIn<'_>; 3],
    g: &Geom,
    r: &Resolved,
    merge: bool,
    saved: &Saved,
) -> Result<(CudaStorage, Shape)> {
    let ins = [Buf::read(sq, lq), Buf::read(sk, lk), Buf::read(sv, lv)];
    let o = fwd(g, r, ins, sq.device(), sq.dtype(), saved)?;
    if merge {
        merged(g, o)
    } else {
        Ok(o.into_parts())
    }
}

/// The backward kernels on `[B, H, T, D]` q, o, dO and `[B, KV, T, D]` k, v: `[dq, dk, dv]`,
/// `dq` when `need_q`, `dk` and `dv` when `need_kv`.
#[allow(clippy::too_many_arguments)]
fn bwd(
    g: &Geom,
    r: &Resolved,
    [q, k, v]: [&Tensor; 3],
    o: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    need_q: bool,
    need_kv: bool,
) -> Result<Grads> {
    if !(need_q || need_kv) {
        return Ok([None, None, None]);
    }
    let dt = q.dtype();
    let Device::Cuda(dev) = q.device() else {
        bail!("attention: the Triton backward needs CUDA tensors")
    };
    let ts = [q, k, v, o, &dout.to_dtype(dt)?, lse]
        .into_iter()
        .map(triton_input)
        .collect::<Result<Vec<_>>>()?;
    let doc = doc(r, g, dev)?;
    let guards: Vec<_> = ts
        .iter()
        .chain([&doc])
        .map(|t| t.storage_and_layout())
        .collect();
    let st = guards
        .iter()
        .map(|(s, _)| cuda_of(s))
        .collect::<Result<Vec<_>>>()?;
    let read = |i: usize| Buf::read(st[i], guards[i].1);
    let (q, k, v, o, dout, lse) = (0, 1, 2, 3, 4, 5);
    let read_doc = || read(6).bits_as(DType::I32);
    let builds = builds(r.dropout > 0.0);
    let mut delta = Output::new(dev, (g.b, g.h, g.tq), DType::F32)?;
    let tensors = vec![read(o), read(dout), Buf::write(&mut delta)];
    launch_first(&builds.delta, dt, tensors, &[])?;
    let cfg = scalars(g, r);
    // what both kernels read, in their argument order (their outputs follow)
    let reads = || -> Result<Vec<_>> {
        Ok(vec![
            read(q),
            read(k),
            read(v),
            read_doc()?,
            read(dout),
            read(lse),
            Buf::read_output(&delta),
        ])
    };
    let (dk, dv) = if need_kv {
        let mut dk = Output::new(dev, (g.b, g.kvh, g.tk, g.d), dt)?;
        let mut dv = Output::new(dev, (g.b, g.kvh, g.tk, g.d), dt)?;
        let mut tensors = reads()?;
        tensors.extend([Buf::write(&mut dk), Buf::write(&mut dv)]);
        launch_first(&builds.dkdv, dt, tensors, &cfg)?;
        (Some(dk.into_tensor()), Some(dv.into_tensor()))
    } else {
        (None, None)
    };
    let dq = if need_q {
        let mut dq = Output::new(dev, (g.b, g.h, g.tq, g.d), dt)?;
        let mut tensors = reads()?;
        tensors.push(Buf::write(&mut dq));
        launch_first(&builds.dq, dt, tensors, &cfg)?;
        Some(dq.into_tensor())
    } else {
        None
    };
    Ok([dq, dk, dv])
}

/// `[B, T, H * D]` (a merged output or its gradient) -> `[B, H, T, D]`.
fn split(g: &Geom, t: &Tensor) -> Result<Tensor> {
    t.reshape((g.b, g.tq, g.h, g.d))?.transpose(1, 2)
}

/// The gradients of [`super::attention_qkv`]: `[dqkv, None, None]`.
pub(super) fn qkv_bwd(
    g: &Geom,
    r: &Resolved,
    qkv: &Tensor,
    o: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
) -> Result<Grads> {
    let (q, k, v) = split_heads(&qkv.detach(), g.h)?;
    let (o, dout) = (split(g, o)?, split(g, dout)?);
    let [Some(dq), Some(dk), Some(dv)] = bwd(g, r, [&q, &k, &v], &o, &dout, lse, true, true)?
    else {
        bail!("attention_qkv: missing gradients")
    };
    let parts = [merge_heads(&dq)?, merge_heads(&dk)?, merge_heads(&dv)?];
    Ok([Some(Tensor::cat(&parts, 2)?), None, None])
}

/// The gradients of [`super::attention`] (`merge`: [`super::attention_merged`], whose output
/// and its gradient are `[B, T, H * D]`): `[dq, dk, dv]` (`None` where not needed).
pub(super) fn bhtd_bwd(
    g: &Geom,
    r: &Resolved,
    [q, k, v]: [&Tensor; 3],
    (o, dout): (&Tensor, &Tensor),
    lse: &Tensor,
    merge: bool,
) -> Result<Grads> {
    let (o, dout) = if merge {
        (split(g, o)?, split(g, dout)?)
    } else {
        (o.clone(), dout.clone())
    };
    let need_kv = k.track_op() || v.track_op();
    bwd(g, r, [q, k, v], &o, &dout, lse, q.track_op(), need_kv)
}
