//! The composite (plain Candle ops) reference and the fallback path of [`super`].

use super::config::{check_bhtd, check_qkv, resolve, Resolved};
use super::AttentionConfig;
use crate::op::acc_dtype;
use candle_core::{DType, Device, Result, Tensor, D};

/// `[Tq, Tk]` additive causal mask (0 / -inf) of `dtype`: query `i` (absolute position
/// `i + Tk - Tq`) sees key `j` iff `j <= i_abs` and, with a window `w`, `i_abs - j < w`.
fn causal_mask(
    tq: usize,
    tk: usize,
    window: Option<usize>,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let m: Vec<f32> = (0..tq * tk)
        .map(|x| {
            let (i_abs, j) = ((x / tk + tk) as i64 - tq as i64, (x % tk) as i64);
            let out = j > i_abs || window.is_some_and(|w| i_abs - j >= w as i64);
            if out {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(m, (tq, tk), dev)?.to_dtype(dtype)
}

/// `[B, 1, Tq, Tk]` additive document mask (0 / -inf) of `dtype` from the ids `[B, Tk]`: query
/// `i` sees key `j` iff `ids[b, i + Tk - Tq] == ids[b, j]`.
fn doc_mask(ids: &Tensor, tq: usize, dtype: DType) -> Result<Tensor> {
    let (b, tk) = ids.dims2()?;
    let same = ids
        .narrow(1, tk - tq, tq)?
        .unsqueeze(2)?
        .broadcast_eq(&ids.unsqueeze(1)?)?;
    let zero = Tensor::zeros((), dtype, ids.device())?.broadcast_as((b, tq, tk))?;
    let ninf = Tensor::full(f32::NEG_INFINITY, (), ids.device())?
        .to_dtype(dtype)?
        .broadcast_as((b, tq, tk))?;
    same.where_cond(&zero, &ninf)?.unsqueeze(1)
}

/// `[B, H, T, X]` -> `[B, KV, H / KV * T, X]`: the query heads of each kv head stacked along the
/// rows (heads `c * H / KV ..` of kv head `c` are consecutive), so one matmul per kv head
/// serves them all without repeating K / V.
fn group(t: &Tensor, kv: usize) -> Result<Tensor> {
    let (b, h, n, x) = t.dims4()?;
    t.contiguous()?.reshape((b, kv, h / kv * n, x))
}

/// The inverse of [`group`]: `[B, KV, rep * T, X]` -> `[B, KV * rep, T, X]`.
fn ungroup(t: &Tensor, h: usize) -> Result<Tensor> {
    let (b, kv, n, x) = t.dims4()?;
    t.reshape((b, h, n / (h / kv), x))
}

/// transformers' `repeat_kv`: `[B, KV, T, X]` -> `[B, KV * rep, T, X]`, kv head `c` serving
/// heads `c * rep .. (c + 1) * rep` (expand on a new dim, then reshape).
fn repeat_kv(t: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(t.clone());
    }
    let (b, kv, n, x) = t.dims4()?;
    t.unsqueeze(2)?
        .expand((b, kv, rep, n, x))?
        .reshape((b, kv * rep, n, x))
}

/// The dropout factors `Z` (`0` or `1 / (1 - p)`, the scale rounded once to `dtype`, as in the
/// kernel) of the `[B, H, Tq, Tk]` probabilities: [`dropout_mask`](crate::dropout::dropout_mask)
/// of the key, drawn on the device where the Triton dropout kernel applies (CUDA, f32), else on
/// the host.
fn dropout_factors(
    shape: (usize, usize, usize, usize),
    r: &Resolved,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    crate::dropout::dropout_mask(shape, r.dropout, r.key, dtype, dev)
}

/// Scaled, masked scores `[B, H, Tq, Tk]` in the dtype of `q` (`[B, H, Tq, D]`; `k`
/// `[B, KV, Tk, D]`, grouped by [`group`]).
fn scores(q: &Tensor, k: &Tensor, r: &Resolved) -> Result<Tensor> {
    let (_, h, tq, _) = q.dims4()?;
    let (kv, tk) = (k.dim(1)?, k.dim(2)?);
    let s = group(q, kv)?.matmul(&k.contiguous()?.t()?)?;
    let mut s = (ungroup(&s, h)? * r.scale)?;
    if r.causal {
        let m = causal_mask(tq, tk, r.window, s.dtype(), s.device())?;
        s = s.broadcast_add(&m)?;
    }
    if let Some(m) = &r.mask {
        s = s.broadcast_add(&m.to_dtype(s.dtype())?)?;
    }
    if let Some(ids) = &r.doc_ids {
        s = s.broadcast_add(&doc_mask(ids, tq, s.dtype())?)?;
    }
    Ok(s)
}

/// Attention with plain differentiable Candle ops (`candle_nn::ops::softmax`): the reference
/// the fused op is tested against (in f32 for 16-bit inputs, the output rounded once). As
/// transformers' eager attention: K / V repeated to the query heads (`repeat_kv`), the causal,
/// window and document masks added as 0 / `-inf`, softmax in f32. Materialises the
/// `[B, H, Tq, Tk]` scores and, with dropout, the whole mask (the same Philox mask as the
/// fused op, from [`dropout_mask`](crate::dropout::dropout_mask): on the device with the Triton
/// kernels on, else on the host). Rows that see no key give NaN.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::attention::{attention_composite, AttentionConfig};
/// let q = Tensor::randn(0f32, 1., (1, 2, 5, 4), &Device::Cpu)?;
/// let y = attention_composite(&q, &q, &q, &AttentionConfig::causal())?;
/// assert_eq!(y.dims(), &[1, 2, 5, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &AttentionConfig,
) -> Result<Tensor> {
    let s = check_bhtd("attention_composite", q, k, v)?;
    let r = resolve("attention_composite", cfg, (s.b, s.d, s.tq, s.tk), q)?;
    let (dt, adt) = (q.dtype(), acc_dtype(q.dtype()));
    let rep = s.h / s.kv;
    let (k, v) = (repeat_kv(k, rep)?, repeat_kv(v, rep)?);
    let (q, k, v) = (q.to_dtype(adt)?, k.to_dtype(adt)?, v.to_dtype(adt)?);
    let p = candle_nn::ops::softmax(&scores(&q, &k, &r)?, D::Minus1)?;
    let p = if r.dropout > 0.0 {
        p.mul(&dropout_factors(
            (s.b, s.h, s.tq, s.tk),
            &r,
            adt,
            p.device(),
        )?)?
    } else {
        p
    };
    p.matmul(&v.contiguous()?)?.to_dtype(dt)
}

/// [`attention_merged`](super::attention_merged) with plain differentiable Candle ops:
/// [`attention_composite`], then the heads merged (`transpose(1, 2)`, reshape) to
/// `[B, Tq, H * Dv]`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::attention::{attention_merged_composite, AttentionConfig};
/// let q = Tensor::randn(0f32, 1., (1, 4, 5, 8), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 1, 5, 8), &Device::Cpu)?;
/// let y = attention_merged_composite(&q, &kv, &kv, &AttentionConfig::causal())?;
/// assert_eq!(y.dims(), &[1, 5, 32]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_merged_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &AttentionConfig,
) -> Result<Tensor> {
    merge_heads(&attention_composite(q, k, v, cfg)?)
}

/// `q`, `k`, `v` `[B, H, T, D]` views of a `[B, T, 3C]` projection.
pub(super) fn split_heads(qkv: &Tensor, n_head: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, c, d) = check_qkv(qkv, n_head)?;
    let part = |i: usize| {
        qkv.narrow(2, i * c, c)?
            .reshape((b, t, n_head, d))?
            .transpose(1, 2)
    };
    Ok((part(0)?, part(1)?, part(2)?))
}

/// `[B, H, T, D]` -> `[B, T, H * D]`.
pub(super) fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = y.dims4()?;
    y.transpose(1, 2)?.reshape((b, t, h * d))
}

/// [`attention_qkv`](super::attention_qkv) with plain differentiable Candle ops (splits the heads with
/// narrow / reshape / transpose and calls [`attention_composite`]).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::attention::{attention_qkv_composite, AttentionConfig};
/// let qkv = Tensor::randn(0f32, 1., (2, 5, 3 * 8), &Device::Cpu)?;
/// let y = attention_qkv_composite(&qkv, 2, &AttentionConfig::causal())?;
/// assert_eq!(y.dims(), &[2, 5, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_qkv_composite(
    qkv: &Tensor,
    n_head: usize,
    cfg: &AttentionConfig,
) -> Result<Tensor> {
    let (q, k, v) = split_heads(qkv, n_head)?;
    merge_heads(&attention_composite(&q, &k, &v, cfg)?)
}

/// The fallback forward with composite ops on detached inputs (`q` `[B, H, Tq, D]`, `k`, `v`
/// with `KV` heads, not repeated: grouped matmuls): output `[B, H, Tq, Dv]` (dtype of `q`) and
/// log-sum-exp `[B, H, Tq]` (accumulation dtype). Rows that see no key: output 0, log-sum-exp
/// -inf.
pub(super) fn fallback_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    r: &Resolved,
) -> Result<(Tensor, Tensor)> {
    let dt = q.dtype();
    let adt = acc_dtype(dt);
    let (q, k, v) = (
        q.detach().to_dtype(adt)?,
        k.detach().to_dtype(adt)?,
        v.detach().to_dtype(adt)?,
    );
    let s = scores(&q, &k, r)?;
    let m = s.max_keepdim(D::Minus1)?;
    let empty = m.eq(f64::NEG_INFINITY)?;
    let zeros = m.zeros_like()?;
    let m = empty.where_cond(&zeros, &m)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let l = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_mul(&empty.where_cond(&zeros, &l.recip()?)?)?;
    let p = if r.dropout > 0.0 {
        p.mul(&dropout_factors(p.dims4()?, r, adt, p.device())?)?
    } else {
        p
    };
    let h = p.dim(1)?;
    let out = ungroup(&group(&p, v.dim(1)?)?.matmul(&v.contiguous()?)?, h)?.to_dtype(dt)?;
    let lse = (m + l.log()?)?.squeeze(D::Minus1)?;
    Ok((out, lse))
}

/// The fallback backward with composite ops: `(dq, dk, dv)` in the shapes and dtypes of `q`,
/// `k`, `v`, recomputing `P` from the log-sum-exp (`o`, `dout` `[B, H, Tq, Dv]`). The kv
/// gradients come out of grouped matmuls, which sum over each kv head's query heads.
pub(super) fn fallback_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    o: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    r: &Resolved,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dt = q.dtype();
    let adt = acc_dtype(dt);
    let f = |t: &Tensor| t.detach().to_dtype(adt)?.contiguous();
    let (qa, ka, va, o, dout) = (f(q)?, f(k)?, f(v)?, f(o)?, f(dout)?);
    let lse = lse
        .detach()
        .to_device(q.device())?
        .to_dtype(adt)?
        .unsqueeze(D::Minus1)?;
    // Rows that see no key: P = exp(-inf - inf) = 0 instead of NaN.
    let inf = Tensor::full(f32::INFINITY, lse.shape(), lse.device())?.to_dtype(adt)?;
    let lse = lse.eq(f64::NEG_INFINITY)?.where_cond(&inf, &lse)?;
    let (h, kv) = (qa.dim(1)?, ka.dim(1)?);
    let p = scores(&qa, &ka, r)?.broadcast_sub(&lse)?.exp()?;
    let dp = ungroup(&group(&dout, kv)?.matmul(&va.t()?)?, h)?;
    let (pz, dp) = if r.dropout > 0.0 {
        let z = dropout_factors(p.dims4()?, r, adt, p.device())?;
        (p.mul(&z)?, dp.mul(&z)?)
    } else {
        (p.clone(), dp)
    };
    let dv = group(&pz, kv)?.t()?.matmul(&group(&dout, kv)?)?;
    let di = (&dout * &o)?.sum_keepdim(D::Minus1)?;
    let ds = group(&(p * dp.broadcast_sub(&di)?)?, kv)?;
    let dq = (ungroup(&ds.matmul(&ka)?, h)? * r.scale)?;
    let dk = (ds.t()?.matmul(&group(&qa, kv)?)? * r.scale)?;
    Ok((dq.to_dtype(dt)?, dk.to_dtype(dt)?, dv.to_dtype(dt)?))
}
