//! The composite (plain Candle ops) reference and the fallback path of [`super`].

use super::{acc_dtype, check_bhtd, check_qkv, resolve, AttentionConfig, Resolved};
use candle_core::{DType, Device, Result, Tensor, D};

/// `[Tq, Tk]` additive causal mask (0 / -inf) of `dtype`.
fn causal_mask(tq: usize, tk: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..tq * tk)
        .map(|x| {
            if x % tk + tq > x / tk + tk {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(m, (tq, tk), dev)?.to_dtype(dtype)
}

/// The dropout factors `Z` (`0` or `1 / (1 - p)`) of the `[B, H, Tq, Tk]` probabilities.
fn dropout_factors(
    shape: (usize, usize, usize, usize),
    r: &Resolved,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let (b, h, tq, tk) = shape;
    let mut u = vec![0f32; b * h * tq * tk];
    r.key.fill_uniform(0, &mut u);
    u.iter_mut()
        .for_each(|x| *x = if *x < r.dropout { 0.0 } else { 1.0 });
    // The scale is taken in f64 and rounded once to `dtype`, as in the kernel.
    let keep = 1.0 / (1.0 - r.dropout as f64);
    Tensor::from_vec(u, (b, h, tq, tk), dev)?.to_dtype(dtype)? * keep
}

/// Scaled, masked scores `[B, H, Tq, Tk]` in the dtype of `q`.
fn scores(q: &Tensor, k: &Tensor, r: &Resolved) -> Result<Tensor> {
    let (_, _, tq, _) = q.dims4()?;
    let tk = k.dim(2)?;
    let mut s = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * r.scale)?;
    if r.causal {
        s = s.broadcast_add(&causal_mask(tq, tk, s.dtype(), s.device())?)?;
    }
    if let Some(m) = &r.mask {
        s = s.broadcast_add(&m.to_dtype(s.dtype())?)?;
    }
    Ok(s)
}

/// Attention with plain differentiable Candle ops (`candle_nn::ops::softmax`): the reference
/// the fused op is tested against (in f32 for 16-bit inputs, the output rounded once).
/// Materialises the `[B, H, Tq, Tk]` scores and, with dropout, draws the whole mask on the
/// host (the same Philox mask as the fused op). Rows that see no key give NaN.
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
    let (b, h, tq, tk, d, _) = check_bhtd(q, k, v)?;
    let r = resolve(cfg, d, tq, tk, q)?;
    let (dt, adt) = (q.dtype(), acc_dtype(q.dtype()));
    let (q, k, v) = (q.to_dtype(adt)?, k.to_dtype(adt)?, v.to_dtype(adt)?);
    let p = candle_nn::ops::softmax(&scores(&q, &k, &r)?, D::Minus1)?;
    let p = if r.dropout > 0.0 {
        p.mul(&dropout_factors((b, h, tq, tk), &r, adt, p.device())?)?
    } else {
        p
    };
    p.matmul(&v.contiguous()?)?.to_dtype(dt)
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

/// The fallback forward with composite ops on detached inputs: output `[B, H, Tq, Dv]` (dtype
/// of `q`) and log-sum-exp `[B, H, Tq]` (accumulation dtype). Rows that see no key: output 0,
/// log-sum-exp -inf.
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
    let out = p.matmul(&v.contiguous()?)?.to_dtype(dt)?;
    let lse = (m + l.log()?)?.squeeze(D::Minus1)?;
    Ok((out, lse))
}

/// The fallback backward with composite ops: `(dq, dk, dv)` in the shapes and dtypes of `q`,
/// `k`, `v`, recomputing `P` from the log-sum-exp.
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
    let p = scores(&qa, &ka, r)?.broadcast_sub(&lse)?.exp()?;
    let (pz, dp) = if r.dropout > 0.0 {
        let z = dropout_factors(p.dims4()?, r, adt, p.device())?;
        (p.mul(&z)?, dout.matmul(&va.t()?)?.mul(&z)?)
    } else {
        (p.clone(), dout.matmul(&va.t()?)?)
    };
    let dv = pz.t()?.matmul(&dout)?;
    let di = (&dout * &o)?.sum_keepdim(D::Minus1)?;
    let ds = (p * dp.broadcast_sub(&di)?)?;
    let dq = (ds.matmul(&ka)? * r.scale)?;
    let dk = (ds.t()?.matmul(&qa)? * r.scale)?;
    Ok((dq.to_dtype(dt)?, dk.to_dtype(dt)?, dv.to_dtype(dt)?))
}
