//! Attention (`triton/attention.py`): each file `attention.<dtype>.<case>.safetensors` holds the
//! inputs `q [B, H, T, D]`, `k`, `v [B, KV, T, D]`, `do [B, H, T, D]` (the dtype), `doc [B, T]`
//! (u32 document ids; all 0 when the case has none, which sees the same keys), the
//! configuration `scale`, `dropout`, `keep` (f32 `[1]`: `1 / (1 - p)` rounded to f32 as the CPU
//! kernel does), `flags` (u32 `[causal, window]`, window 0 = none), `rng` (u32 `[seed lo, seed
//! hi, site lo, site hi, offset lo, offset hi]`), and the CPU kernel's (`attention`, the fused
//! op) output `o` and gradients `dq`, `dk`, `dv` (the dtype, the backward of `sum(o * do)`).
//! `lse [B, H, T]` (f32) is the log-sum-exp of the visible scores computed here with composite
//! f32 ops (the op keeps its own private): the kernel saves exactly that statistic.
//!
//! Sizes are not multiples of the Triton blocks (T = 37, 70 against 64-row / 64-key blocks),
//! the heads are grouped (H = 6 over KV = 2), a sliding window crosses a block boundary, one
//! batch row's documents are not contiguous, dropout has an odd element offset. Between them
//! the cases run every build a launcher picks (`cuda_kernels::attention::builds`): the 64 and
//! 128 head-size builds with and without dropout (D = 64, 96, 128) and the generic one
//! (D = 40; f32 always).

use super::{
    forward_backward, input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES,
};
use crate::common::{self, Lcg};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_fused::attention::{attention, AttentionConfig};
use candle_fused::RngKey;
use std::path::Path;

/// Launches: attn_fwd; attn_bwd_delta, attn_bwd_dkdv, attn_bwd_dq.
pub(crate) const FAMILY: Family =
    Family::new("attention", ATTENTION, run, |_| Ok(4), write_vectors);

/// One test case: sizes and options.
struct Case {
    name: &'static str,
    b: usize,
    h: usize,
    kv: usize,
    t: usize,
    d: usize,
    causal: bool,
    window: Option<usize>,
    /// Document ids of each batch row (`None`: no document ids).
    docs: Option<fn(usize, usize) -> u32>,
    dropout: f32,
}

/// Row 0: two contiguous documents; row 1: ids 3, 7, 3, 9 (id 3 is not contiguous).
fn packed(b: usize, p: usize) -> u32 {
    match (b, p) {
        (0, p) if p < 30 => 0,
        (0, _) => 1,
        (_, p) if p < 10 => 3,
        (_, p) if p < 40 => 7,
        (_, p) if p < 55 => 3,
        _ => 9,
    }
}

impl Case {
    /// A causal case of `b` rows, `h` query heads over `kv` key heads, `t` positions and head size
    /// `d`, without a window, documents or dropout.
    const fn causal(name: &'static str, b: usize, h: usize, kv: usize, t: usize, d: usize) -> Self {
        Case {
            name,
            b,
            h,
            kv,
            t,
            d,
            causal: true,
            window: None,
            docs: None,
            dropout: 0.0,
        }
    }
}

const CASES: [Case; 6] = [
    Case::causal("causal_b2h6kv2_t37_d64", 2, 6, 2, 37, 64),
    Case::causal("causal_b2h6kv2_t70_d64", 2, 6, 2, 70, 64),
    Case {
        window: Some(20),
        docs: Some(packed),
        dropout: 0.2,
        ..Case::causal("window20_docs_drop20pc_b2h6kv2_t70_d64", 2, 6, 2, 70, 64)
    },
    Case {
        causal: false,
        dropout: 0.1,
        ..Case::causal("full_drop10pc_b1h2kv1_t37_d128", 1, 2, 1, 37, 128)
    },
    // the head-size builds' partial tile (D = 96 in the 128 build) without dropout
    Case::causal("causal_b1h2kv1_t37_d96", 1, 2, 1, 37, 96),
    // a head size no head-size build takes (not a multiple of 16): the generic build
    Case {
        dropout: 0.1,
        ..Case::causal("causal_drop10pc_b1h2kv1_t21_d40", 1, 2, 1, 21, 40)
    },
];

const SEED: u64 = 0x1234_5678_9abc_def0;
const SITE: u64 = 0x5_0000_0003;
const OFFSET: u64 = 1_000_003;

/// `[B, 1, T, T]` f32: 0 where query `i` of batch row `b` sees key `j`, `-inf` elsewhere.
fn visibility(c: &Case, ids: &[u32]) -> Result<Tensor> {
    let t = c.t;
    let mut v = vec![0f32; c.b * t * t];
    for b in 0..c.b {
        for i in 0..t {
            for j in 0..t {
                let sees = (!c.causal || j <= i)
                    && c.window.is_none_or(|w| i - j < w)
                    && ids[b * t + i] == ids[b * t + j];
                if !sees {
                    v[(b * t + i) * t + j] = f32::NEG_INFINITY;
                }
            }
        }
    }
    Ok(Tensor::from_vec(v, (c.b, 1, t, t), &Device::Cpu)?)
}

/// The log-sum-exp `[B, H, T]` of the visible scaled scores, in f32 (K, V repeated per group:
/// fine for a reference).
fn lse(c: &Case, q: &Tensor, k: &Tensor, scale: f64, vis: &Tensor) -> Result<Tensor> {
    let rep = c.h / c.kv;
    let kf = k
        .to_dtype(DType::F32)?
        .unsqueeze(2)?
        .expand((c.b, c.kv, rep, c.t, c.d))?
        .reshape((c.b, c.h, c.t, c.d))?;
    let s = (q.to_dtype(DType::F32)?.matmul(&kf.t()?.contiguous()?)? * scale)?;
    let s = s.broadcast_add(vis)?;
    let m = s.max_keepdim(D::Minus1)?;
    let l = s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok((l + m)?.squeeze(D::Minus1)?)
}

fn vectors(c: &Case, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let q = common::rand(&[c.b, c.h, c.t, c.d], dt, &mut rng, 2.0, 0.0)?;
    let k = common::rand(&[c.b, c.kv, c.t, c.d], dt, &mut rng, 2.0, 0.0)?;
    let v = common::rand(&[c.b, c.kv, c.t, c.d], dt, &mut rng, 1.0, 0.0)?;
    let dout = common::rand(&[c.b, c.h, c.t, c.d], dt, &mut rng, 1.0, 0.0)?;
    let ids: Vec<u32> = (0..c.b * c.t)
        .map(|x| c.docs.map_or(0, |f| f(x / c.t, x % c.t)))
        .collect();
    let doc = Tensor::from_vec(ids.clone(), (c.b, c.t), &Device::Cpu)?;
    let mut cfg = AttentionConfig::causal().with_causal(c.causal);
    if let Some(w) = c.window {
        cfg = cfg.with_window(w);
    }
    if c.docs.is_some() {
        cfg = cfg.with_doc_ids(doc.clone());
    }
    if c.dropout > 0.0 {
        let key = RngKey::new(SEED, SITE).with_offset(OFFSET);
        cfg = cfg.with_dropout(c.dropout, key);
    }
    let scale = 1.0 / (c.d as f64).sqrt();
    let (o, [dq, dk, dv]) =
        forward_backward([&q, &k, &v], &dout, |[q, k, v]| attention(q, k, v, &cfg))?;
    let lse = lse(c, &q, &k, scale, &visibility(c, &ids)?)?;
    let f = |x: f32| Tensor::new(&[x], &Device::Cpu);
    let u = |x: &[u32]| Tensor::new(x, &Device::Cpu);
    let keep = (1.0 / (1.0 - c.dropout as f64)) as f32;
    Ok(vec![
        ("q", q),
        ("k", k),
        ("v", v),
        ("do", dout),
        ("doc", doc),
        ("scale", f(scale as f32)?),
        ("dropout", f(c.dropout)?),
        ("keep", f(keep)?),
        (
            "flags",
            u(&[c.causal as u32, c.window.unwrap_or(0) as u32])?,
        ),
        (
            "rng",
            u(&[
                SEED as u32,
                (SEED >> 32) as u32,
                SITE as u32,
                (SITE >> 32) as u32,
                OFFSET as u32,
                (OFFSET >> 32) as u32,
            ])?,
        ),
        ("o", o),
        ("lse", lse),
        ("dq", dq),
        ("dk", dk),
        ("dv", dv),
    ])
}

fn write_vectors(dir: &Path) -> Result<()> {
    write_each(
        dir,
        "attention",
        2000,
        &CASES,
        |_| ALL_DTYPES,
        |c| c.name.into(),
        vectors,
    )
}

// attention (triton/attention.py TOL, ERROR): o relative to its row's largest value, dq, dk,
// dv to the tensor's (a key few queries see has a tiny dK row). f32 1e-5: both sides in f32
// with IEEE products, different summation orders and exp implementations (measured under the
// interpreter: 1e-6). bf16 2^-6, f16 2^-9: two units in the last place; the outputs are rounded
// once on each side and the kernels round P and dS to the dtype for the tensor-core dots (the
// CPU keeps them f32). `lse` stays inside the op: not compared here.
const ATTENTION: &[Check] = &[
    Check::new("o", Mode::Row, [1e-5, 1.0 / 64.0, 1.0 / 512.0]),
    Check::new("dq", Mode::Tensor, [1e-5, 1.0 / 64.0, 1.0 / 512.0]),
    Check::new("dk", Mode::Tensor, [1e-5, 1.0 / 64.0, 1.0 / 512.0]),
    Check::new("dv", Mode::Tensor, [1e-5, 1.0 / 64.0, 1.0 / 512.0]),
];

/// The vector file's configuration (`flags`, `doc`, `dropout`, `rng`; the scale is the
/// default, checked against `scale`): document ids only when some id is not 0 (all-zero ids
/// stand for none, so both kernel paths of `DOC` run).
pub(crate) fn attention_cfg(t: &Tensors, dev: &Device) -> Result<AttentionConfig> {
    let cpu = &Device::Cpu;
    let d = input(t, "q", cpu)?.dim(3)?;
    let scale = input(t, "scale", cpu)?.to_vec1::<f32>()?[0];
    ensure!(
        scale == (1.0 / (d as f64).sqrt()) as f32,
        "scale {scale} is not 1/sqrt({d})"
    );
    let flags = input(t, "flags", cpu)?.to_vec1::<u32>()?;
    let mut cfg = AttentionConfig::causal().with_causal(flags[0] != 0);
    if flags[1] > 0 {
        cfg = cfg.with_window(flags[1] as usize);
    }
    let doc = input(t, "doc", cpu)?;
    if doc.max_all()?.to_scalar::<u32>()? > 0 {
        cfg = cfg.with_doc_ids(doc.to_device(dev)?);
    }
    let p = input(t, "dropout", cpu)?.to_vec1::<f32>()?[0];
    if p > 0.0 {
        let w = input(t, "rng", cpu)?.to_vec1::<u32>()?;
        let u64_of = |i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
        let key = RngKey::new(u64_of(0), u64_of(2)).with_offset(u64_of(4));
        cfg = cfg.with_dropout(p, key);
    }
    Ok(cfg)
}

/// `attention` on `(q, k, v)`: the output and the gradients of `sum(o * dout)`.
pub(crate) fn attention_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    cfg: &AttentionConfig,
) -> Result<Outputs> {
    let (o, [dq, dk, dv]) = forward_backward([q, k, v], dout, |[q, k, v]| attention(q, k, v, cfg))?;
    Ok(vec![("o", o), ("dq", dq), ("dk", dk), ("dv", dv)])
}

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let cfg = attention_cfg(t, dev)?;
    let [q, k, v, dout] = ["q", "k", "v", "do"].map(|n| input(t, n, dev));
    attention_grads(&q?, &k?, &v?, &dout?, &cfg)
}

/// `[B, H, T, D]` -> `[B, T, H * D]`.
pub(crate) fn merge(x: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = x.dims4()?;
    Ok(x.transpose(1, 2)?.reshape((b, n, h * d))?)
}

/// `[B, T, H * D]` -> `[B, H, T, D]`.
pub(crate) fn unmerge(x: &Tensor, h: usize) -> Result<Tensor> {
    let (b, n, c) = x.dims3()?;
    Ok(x.reshape((b, n, h, c / h))?.transpose(1, 2)?.contiguous()?)
}
