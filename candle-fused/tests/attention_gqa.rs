//! Tests of the attention options for Llama-family models: grouped-query attention (KV heads
//! shared by several query heads), sliding windows, per-token document ids, queries at the end
//! of the keys (KV-cache decoding) and the heads-merged output, against the composite reference
//! (K / V repeated as transformers' `repeat_kv`, the masks built as additive 0 / -inf), the
//! fallback path, explicit masks built from transformers' formulas, and the H == KV kernel on
//! explicitly repeated K / V.
//!
//! Tolerances (max abs error relative to the largest reference magnitude, see [`close`]), as in
//! `tests/attention.rs`: f64 1e-10 (summation order and the online-softmax rescaling, ~1e-15
//! per op; observed <4e-15); f32 1e-5 for values, 2e-5 for gradients (~6e-8 per op over up to
//! 800 keys, and dK / dV summed over up to 4 query heads; observed <9e-7 for values, <1.1e-6
//! for gradients).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::attention::{
    attention, attention_composite, attention_merged, attention_merged_composite, AttentionConfig,
};
use candle_fused::RngKey;
use common::*;

fn tols(dt: DType) -> (f64, f64) {
    match dt {
        DType::F64 => (1e-10, 1e-10),
        _ => (1e-5, 2e-5),
    }
}

/// `(B, H, KV, Tq, Tk, D, Dv)`.
type Shape7 = (usize, usize, usize, usize, usize, usize, usize);

/// Random q `[B, H, Tq, D]`, k `[B, KV, Tk, D]`, v `[B, KV, Tk, Dv]`.
fn qkv_inputs(seed: u64, s: Shape7, dt: DType) -> Result<[Tensor; 3]> {
    let (b, h, kv, tq, tk, d, dv) = s;
    Ok([
        rand_seeded(seed, &[b, h, tq, d], 1.5, dt)?,
        rand_seeded(seed + 1, &[b, kv, tk, d], 1.5, dt)?,
        rand_seeded(seed + 2, &[b, kv, tk, dv], 1.0, dt)?,
    ])
}

/// Document ids `[B, T]` (u32) from per-row document lengths (the last document is cut or
/// extended to fill the row); ids count up from `first_id` along the row.
fn doc_ids(rows: &[&[usize]], t: usize, first_id: u32) -> Result<Tensor> {
    let mut ids = Vec::with_capacity(rows.len() * t);
    for lens in rows {
        let mut row = Vec::with_capacity(t);
        for (n, &len) in lens.iter().enumerate() {
            row.extend(std::iter::repeat_n(first_id + n as u32, len));
        }
        let last = *row.last().unwrap_or(&first_id);
        row.resize(t, last);
        ids.extend_from_slice(&row);
    }
    Ok(Tensor::from_vec(ids, (rows.len(), t), &Device::Cpu)?)
}

/// Three layouts for up to 3 batch rows: documents of lengths 1, 5, 1, 1, 20, 3, 9, .. in row
/// 0, one long document after a 2-token one in row 1, and in row 2 ids that are not contiguous
/// (the same id in two separate runs: equal ids attend to each other wherever they are).
fn layouts(b: usize, t: usize) -> Result<Tensor> {
    let rows: [&[usize]; 2] = [&[1, 5, 1, 1, 20, 3, 9, 1, 40, 7], &[2, 1000]];
    let mut parts = Vec::new();
    for r in 0..b {
        if r < 2 {
            parts.push(doc_ids(&rows[r..r + 1], t, 10 * r as u32)?);
        } else {
            let v: Vec<u32> = (0..t).map(|p| [7u32, 3, 7, 1][(p / 6) % 4]).collect();
            parts.push(Tensor::from_vec(v, (1, t), &Device::Cpu)?);
        }
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// Max `|a - b|` relative to `max(max |b|, 0.1)` (NaN-aware, [`compare::diff`]) at most `tol`.
/// The floor: with a window of 1 each query sees one key (`P = 1`), so its dQ and the dK are
/// exactly 0 in the composite (`dS = P (dP - D) = 0`), where the kernel and the fallback hold
/// the rounding of `dP - D` instead (observed <1.5e-7 in f32, 1.5e-6 against the floor); the
/// values and the other gradients here are O(1).
fn close(a: &Tensor, b: &Tensor, tol: f64, what: &str) -> Result<()> {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let d = compare::diff(&values(a), &values(b)).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    let worst = d.max_abs / d.max_ref.max(0.1);
    anyhow::ensure!(
        worst <= tol,
        "{what}: relative error {worst:e} > {tol:e} ({d})"
    );
    Ok(())
}

/// Fused (kernel and fallback) against the composite: values and the gradients of q, k, v.
fn check(what: &str, cfg: &AttentionConfig, ins: &[Tensor], tv: f64, tg: f64) -> Result<()> {
    let f = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], cfg);
    let (y, g) = grads(&f, ins, 5)?;
    let (yr, gr) = grads(&|x| attention_composite(&x[0], &x[1], &x[2], cfg), ins, 5)?;
    let (yf, gf) = with_fallback(|| grads(&f, ins, 5))?;
    close(&y, &yr, tv, &format!("{what} value"))?;
    close(&yf, &yr, tv, &format!("{what} fallback value"))?;
    for (i, n) in ["dq", "dk", "dv"].iter().enumerate() {
        close(&g[i], &gr[i], tg, &format!("{what} {n}"))?;
        close(&gf[i], &gr[i], tg, &format!("{what} fallback {n}"))?;
    }
    Ok(())
}

#[test]
fn gqa_matches_composite() -> Result<()> {
    // (H, KV): two and three query heads per kv head, H == KV, multi-query (KV = 1); sizes not
    // multiples of the 32-row / 256-key tiles, Tq < Tk, Dv != D.
    let heads = [(4, 2), (6, 3), (3, 3), (4, 1)];
    let sizes = [(2, 37, 37, 8, 8), (1, 70, 300, 16, 5), (2, 1, 9, 4, 4)];
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        for (n, &(h, kv)) in heads.iter().enumerate() {
            for (m, &(b, tq, tk, d, dv)) in sizes.iter().enumerate() {
                let s = 100 + 10 * n as u64 + m as u64;
                let ins = qkv_inputs(s, (b, h, kv, tq, tk, d, dv), dt)?;
                let cfgs = [
                    ("causal", AttentionConfig::causal()),
                    ("full", AttentionConfig::full().with_scale(0.3)),
                    (
                        "causal mask p=0.2",
                        AttentionConfig::causal()
                            .with_mask(mask(s, tq, tk, dt)?)
                            .with_dropout(0.2, RngKey::new(s, 1)),
                    ),
                ];
                for (name, cfg) in &cfgs {
                    let what = format!("{dt:?} H={h} KV={kv} {:?} {name}", (b, tq, tk, d, dv));
                    check(&what, cfg, &ins, tv, tg)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn windows_match_composite() -> Result<()> {
    // w = 1 (each query sees itself), w smaller than a 32-row block, w spanning several query
    // blocks, and with T = 800 (> 3 key tiles of 256) windows spanning several key tiles.
    let cases = [
        (1, 2, 2, 70, 70, &[1usize, 5, 40][..]),
        (2, 4, 2, 45, 45, &[3, 31, 33][..]),
        (1, 2, 1, 800, 800, &[300, 600][..]),
        (1, 3, 3, 100, 100, &[64][..]),
    ];
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        for (n, &(b, h, kv, tq, tk, ws)) in cases.iter().enumerate() {
            if dt == DType::F64 && tk > 300 {
                continue;
            }
            let s = 200 + 10 * n as u64;
            let ins = qkv_inputs(s, (b, h, kv, tq, tk, 8, 8), dt)?;
            for &w in ws {
                let base = AttentionConfig::causal().with_window(w);
                let what = format!("{dt:?} {:?} w={w}", (b, h, kv, tq, tk));
                check(&what, &base, &ins, tv, tg)?;
                let cfg = base.with_dropout(0.1, RngKey::new(s, 2));
                check(&format!("{what} p=0.1"), &cfg, &ins, tv, tg)?;
            }
        }
    }
    Ok(())
}

#[test]
fn window_covering_the_row_is_plain_causal() -> Result<()> {
    // w >= T: no key is outside the window, so the kernel does what plain causal does, bit for
    // bit (the same key tiles from 0).
    let (b, h, kv, t) = (2, 4, 2, 77);
    let ins = qkv_inputs(1, (b, h, kv, t, t, 16, 16), DType::F32)?;
    let f = |cfg: AttentionConfig| move |x: &[Tensor]| attention_merged(&x[0], &x[1], &x[2], &cfg);
    let (y, g) = grads(&f(AttentionConfig::causal()), &ins, 2)?;
    for w in [t, t + 1, 1000] {
        let (yw, gw) = grads(&f(AttentionConfig::causal().with_window(w)), &ins, 2)?;
        same_bits(&yw, &y, &format!("w={w} value"))?;
        for i in 0..3 {
            same_bits(&gw[i], &g[i], &format!("w={w} grad {i}"))?;
        }
    }
    Ok(())
}

/// An additive `[Tq, Tk]` mask (0 / -inf) of who sees whom, from `sees(i_abs, j)`.
fn explicit_mask(tq: usize, tk: usize, sees: impl Fn(i64, i64) -> bool) -> Result<Tensor> {
    let v: Vec<f64> = (0..tq * tk)
        .map(|x| {
            let (i_abs, j) = ((x / tk + tk) as i64 - tq as i64, (x % tk) as i64);
            if sees(i_abs, j) {
                0.0
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, (tq, tk), &Device::Cpu)?)
}

#[test]
fn masks_follow_transformers_formulas() -> Result<()> {
    // The window and the documents against explicit masks written from transformers'
    // definitions (Mistral's sliding window: visible iff j <= i and j > i - w; packed
    // sequences: visible iff same document, block-diagonal), through `with_mask` and
    // non-causal attention: same values and gradients, kernel and composite (a separate check
    // of the composite's own masks, which the other tests compare the kernel with).
    let (b, h, kv, tq, tk) = (3, 4, 2, 30, 50);
    let ins = qkv_inputs(7, (b, h, kv, tq, tk, 8, 8), DType::F64)?;
    let ids = layouts(b, tk)?;
    let idv: Vec<Vec<u32>> = ids.to_vec2()?;
    for w in [1, 7, 30] {
        let win = AttentionConfig::causal()
            .with_window(w)
            .with_doc_ids(ids.clone());
        for (r, id) in idv.iter().enumerate() {
            let row = |t: &Tensor| t.narrow(0, r, 1);
            let rins: Vec<Tensor> = ins.iter().map(row).collect::<candle_core::Result<_>>()?;
            let m = explicit_mask(tq, tk, |i, j| {
                j <= i && j > i - w as i64 && id[i as usize] == id[j as usize]
            })?;
            let expl = AttentionConfig::full().with_mask(m);
            let rwin = AttentionConfig {
                doc_ids: Some(row(&ids)?),
                ..win.clone()
            };
            for (name, op) in [
                ("kernel", attention as fn(&_, &_, &_, &_) -> _),
                ("composite", attention_composite),
            ] {
                let (y, g) = grads(&|x| op(&x[0], &x[1], &x[2], &rwin), &rins, 3)?;
                let (ye, ge) = grads(&|x| op(&x[0], &x[1], &x[2], &expl), &rins, 3)?;
                let what = format!("{name} w={w} row {r}");
                compare::assert_close(&y, &ye, 1e-12, &format!("{what} value"));
                for i in 0..3 {
                    compare::assert_close(&g[i], &ge[i], 1e-12, &format!("{what} grad {i}"));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn doc_ids_match_composite() -> Result<()> {
    // Several documents per row of different lengths (length-1 documents included), a
    // different layout per batch row, non-contiguous ids in row 2; causal and full attention,
    // GQA, with a window, a mask and dropout.
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        for (n, &(h, kv, t)) in [(2, 2, 45), (4, 2, 100), (6, 3, 300)].iter().enumerate() {
            if dt == DType::F64 && t > 100 {
                continue;
            }
            let b = 3;
            let s = 300 + 10 * n as u64;
            let ins = qkv_inputs(s, (b, h, kv, t, t, 8, 8), dt)?;
            let ids = layouts(b, t)?;
            let cfgs = [
                ("causal", AttentionConfig::causal()),
                ("full", AttentionConfig::full()),
                ("causal w=9", AttentionConfig::causal().with_window(9)),
                (
                    "causal w=40 mask p=0.3",
                    AttentionConfig::causal()
                        .with_window(40)
                        .with_mask(mask(s, t, t, dt)?)
                        .with_dropout(0.3, RngKey::new(s, 4)),
                ),
            ];
            for (name, cfg) in cfgs {
                let cfg = cfg.with_doc_ids(ids.clone());
                let what = format!("{dt:?} docs H={h} KV={kv} T={t} {name}");
                check(&what, &cfg, &ins, tv, tg)?;
            }
        }
    }
    Ok(())
}

#[test]
fn decoding_queries_at_the_end() -> Result<()> {
    // Tq < Tk: the queries are the last Tq positions (KV cache), with window and documents.
    let (b, h, kv, tk) = (3, 4, 2, 100);
    let ids = layouts(b, tk)?;
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        for tq in [1, 5, 40] {
            let ins = qkv_inputs(400 + tq as u64, (b, h, kv, tq, tk, 8, 4), dt)?;
            for w in [1, 3, 33, 200] {
                let cfg = AttentionConfig::causal().with_window(w);
                let what = format!("{dt:?} Tq={tq} w={w}");
                check(&what, &cfg, &ins, tv, tg)?;
                let cfg = cfg.with_doc_ids(ids.clone());
                check(&format!("{what} docs"), &cfg, &ins, tv, tg)?;
            }
        }
    }
    Ok(())
}

#[test]
fn finite_differences_f64() -> Result<()> {
    // Central differences against the kernel's and the fallback's gradients (step 1e-5,
    // tolerance 1e-7 of the largest gradient, as in `tests/attention.rs`).
    let (b, h, kv, tq, tk) = (2, 4, 2, 4, 6);
    let ins = qkv_inputs(41, (b, h, kv, tq, tk, 3, 2), DType::F64)?;
    let ids = doc_ids(&[&[2, 1, 3], &[4, 2]], tk, 0)?;
    let cfgs = [
        AttentionConfig::causal(),
        AttentionConfig::causal().with_window(2),
        AttentionConfig::full().with_doc_ids(ids.clone()),
        AttentionConfig::causal()
            .with_window(3)
            .with_doc_ids(ids)
            .with_dropout(0.3, RngKey::new(5, 5)),
    ];
    for (n, cfg) in cfgs.iter().enumerate() {
        for fallback in [false, true] {
            let f =
                |x: &[Tensor]| fallback_if(fallback, || attention_merged(&x[0], &x[1], &x[2], cfg));
            let probe = rand_seeded(42, f(&ins)?.dims(), 1.0, DType::F64)?;
            grad::check_fd(&f, &ins, &probe, 1e-5, 1e-7)
                .map_err(|e| anyhow::anyhow!("config {n} fallback={fallback}: {e}"))?;
        }
    }
    Ok(())
}

#[test]
fn half_precision_close_to_f32_composite() -> Result<()> {
    // 16-bit inputs, f32 arithmetic in the kernel; the reference is the f32 composite on the
    // same (rounded) inputs. Tolerances as in `tests/attention.rs`: a few units of the type's
    // epsilon (bf16 2^-8, f16 2^-11); gradients also see the rounded output in D_i.
    let (b, h, kv, t) = (3, 6, 2, 70);
    let ids = layouts(b, t)?;
    for (dt, tv, tg) in [(DType::BF16, 1e-2, 1.5e-2), (DType::F16, 2e-3, 2e-3)] {
        let ins = qkv_inputs(51, (b, h, kv, t, t, 16, 16), dt)?;
        let ins32: Vec<Tensor> = ins
            .iter()
            .map(|x| x.to_dtype(DType::F32))
            .collect::<candle_core::Result<_>>()?;
        let cfgs = [
            AttentionConfig::causal(),
            AttentionConfig::causal()
                .with_window(20)
                .with_doc_ids(ids.clone()),
            AttentionConfig::full()
                .with_doc_ids(ids.clone())
                .with_dropout(0.1, RngKey::new(5, 5)),
        ];
        for (n, cfg) in cfgs.iter().enumerate() {
            let g16 = rand_seeded(52, &[b, t, h * 16], 1.0, dt)?;
            let g32 = g16.to_dtype(DType::F32)?;
            let f = |x: &[Tensor]| attention_merged(&x[0], &x[1], &x[2], cfg);
            let (y, g) = value_and_grads(&f, &ins, &g16)?;
            let (yr, gr) = value_and_grads(
                &|x| attention_merged_composite(&x[0], &x[1], &x[2], cfg),
                &ins32,
                &g32,
            )?;
            assert_eq!(y.dtype(), dt);
            compare::assert_close(&y, &yr.to_dtype(dt)?, tv, &format!("{dt:?} {n} value"));
            for i in 0..3 {
                assert_eq!(g[i].dtype(), dt);
                compare::assert_close(&g[i], &gr[i], tg, &format!("{dt:?} {n} grad {i}"));
            }
        }
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs() -> Result<()> {
    // q, k, v as the model has them: `[B, T, heads, D]` projections transposed to
    // `[B, heads, T, D]` (strided views), and a narrowed head dim for v.
    let (b, h, kv, t, d) = (2, 6, 3, 41, 8);
    let ids = layouts(b, t)?;
    for dt in [DType::F32, DType::F64] {
        let (tv, tg) = tols(dt);
        let ins = [
            rand_seeded(61, &[b, t, h, d], 1.5, dt)?,
            rand_seeded(62, &[b, t, kv, d], 1.5, dt)?,
            rand_seeded(63, &[b, t, kv, 2 * d], 1.0, dt)?,
        ];
        let cfg = AttentionConfig::causal()
            .with_window(10)
            .with_doc_ids(ids.clone());
        let view = |x: &[Tensor]| -> candle_core::Result<[Tensor; 3]> {
            Ok([
                x[0].transpose(1, 2)?,
                x[1].transpose(1, 2)?,
                x[2].narrow(3, 3, d)?.transpose(1, 2)?,
            ])
        };
        let f = |x: &[Tensor]| {
            let [q, k, v] = view(x)?;
            assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
            attention_merged(&q, &k, &v, &cfg)
        };
        let fr = |x: &[Tensor]| {
            let [q, k, v] = view(x)?;
            attention_merged_composite(&q, &k, &v, &cfg)
        };
        let (y, g) = grads(&f, &ins, 64)?;
        let (yr, gr) = grads(&fr, &ins, 64)?;
        let (yf, gf) = with_fallback(|| grads(&f, &ins, 64))?;
        compare::assert_close(&y, &yr, tv, &format!("{dt:?} strided value"));
        compare::assert_close(&yf, &yr, tv, &format!("{dt:?} strided fallback value"));
        for i in 0..3 {
            compare::assert_close(&g[i], &gr[i], tg, &format!("{dt:?} strided grad {i}"));
            compare::assert_close(&gf[i], &gr[i], tg, &format!("{dt:?} fallback grad {i}"));
        }
    }
    Ok(())
}

/// `[B, KV, T, X]` -> contiguous `[B, KV * rep, T, X]`, kv head `c` at heads `c * rep ..`.
fn repeat_kv(x: &Tensor, rep: usize) -> candle_core::Result<Tensor> {
    let (b, kv, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, kv, rep, t, d))?
        .contiguous()?
        .reshape((b, kv * rep, t, d))
}

#[test]
fn gqa_equals_kernel_on_repeated_kv() -> Result<()> {
    // The grouped kernel against the H == KV kernel on K / V explicitly repeated: the forward
    // and dQ read the same rows in the same order (bit-identical); dK / dV of a kv head
    // accumulate its query heads one after the other in one buffer, the repeated path sums
    // the per-head gradients afterwards: equal within 1e-6 (f32 rounding of a few additions;
    // observed <3e-7).
    let (b, t) = (2, 300);
    let ids = layouts(b, t)?;
    for (h, kv) in [(4, 2), (6, 3), (4, 1)] {
        let rep = h / kv;
        let ins = qkv_inputs(70 + h as u64, (b, h, kv, t, t, 16, 8), DType::F32)?;
        let cfgs = [
            AttentionConfig::causal(),
            AttentionConfig::causal()
                .with_window(50)
                .with_doc_ids(ids.clone())
                .with_dropout(0.1, RngKey::new(3, 3)),
        ];
        for (n, cfg) in cfgs.iter().enumerate() {
            let what = format!("H={h} KV={kv} config {n}");
            let (y, g) = grads(&|x| attention(&x[0], &x[1], &x[2], cfg), &ins, 71)?;
            let rep_ins = [
                ins[0].clone(),
                repeat_kv(&ins[1], rep)?,
                repeat_kv(&ins[2], rep)?,
            ];
            let (yr, gr) = grads(&|x| attention(&x[0], &x[1], &x[2], cfg), &rep_ins, 71)?;
            same_bits(&y, &yr, &format!("{what} value"))?;
            same_bits(&g[0], &gr[0], &format!("{what} dq"))?;
            for i in 1..3 {
                let (bb, _, tt, x) = gr[i].dims4()?;
                let summed = gr[i].reshape((bb, kv, rep, tt, x))?.sum(2)?;
                compare::assert_close(&g[i], &summed, 1e-6, &format!("{what} grad {i}"));
            }
        }
    }
    Ok(())
}

#[test]
fn merged_equals_transposed_output() -> Result<()> {
    // The merged layout is a different output view of the same kernel: bit-identical values
    // and gradients to `attention(..).transpose(1, 2).reshape(..)`, on the kernel and the
    // fallback.
    let (b, h, kv, tq, tk, d, dv) = (2, 6, 2, 37, 50, 8, 5);
    let ids = layouts(b, tk)?;
    let cfg = AttentionConfig::causal()
        .with_window(12)
        .with_doc_ids(ids)
        .with_dropout(0.2, RngKey::new(9, 9));
    for dt in [DType::F32, DType::BF16] {
        let ins = qkv_inputs(81, (b, h, kv, tq, tk, d, dv), dt)?;
        for fb in [false, true] {
            let f = |x: &[Tensor]| fallback_if(fb, || attention_merged(&x[0], &x[1], &x[2], &cfg));
            let ft = |x: &[Tensor]| {
                fallback_if(fb, || {
                    attention(&x[0], &x[1], &x[2], &cfg)?
                        .transpose(1, 2)?
                        .reshape((b, tq, h * dv))
                })
            };
            let (y, g) = grads(&f, &ins, 82)?;
            let (yt, gt) = grads(&ft, &ins, 82)?;
            assert_eq!(y.dims(), &[b, tq, h * dv]);
            same_bits(&y, &yt, &format!("{dt:?} fallback={fb} value"))?;
            for i in 0..3 {
                same_bits(&g[i], &gt[i], &format!("{dt:?} fallback={fb} grad {i}"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn gqa_identical_for_any_thread_count() -> Result<()> {
    // Sized above the parallel threshold (B * KV tasks of H / KV heads each).
    let (b, h, kv, t) = (2, 6, 2, 120);
    let ins = qkv_inputs(91, (b, h, kv, t, t, 16, 16), DType::F32)?;
    assert!(b * h * t * t * 16 > PAR_MIN_WORK);
    let ids = layouts(b, t)?;
    let cfgs = [
        AttentionConfig::causal(),
        AttentionConfig::causal()
            .with_window(30)
            .with_doc_ids(ids)
            .with_dropout(0.1, RngKey::new(4, 4)),
    ];
    for (n, cfg) in cfgs.iter().enumerate() {
        let f = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], cfg);
        let probe = rand_seeded(92, &[b, h, t, 16], 1.0, DType::F32)?;
        assert_same_bits_on_thread_counts(&f, &ins, &probe, &format!("config {n}"))?;
    }
    Ok(())
}

/// Who sees whom in [`nan_in_k_reaches_only_rows_that_see_it`]: causal, window `w`, same id.
fn sees(ids: &[u32], w: usize, tq: usize, i: usize, j: usize) -> bool {
    let i_abs = i + ids.len() - tq;
    j <= i_abs && i_abs - j < w && ids[i_abs] == ids[j]
}

#[test]
fn nan_in_k_reaches_only_rows_that_see_it() -> Result<()> {
    // A NaN in one key row (batch row 1, kv head 1, position p, away from index 0). Kernel:
    // exactly the output rows that see that key are NaN (nothing in other batch rows, other kv
    // groups, outside the window or in other documents); dK / dV rows are NaN exactly where a
    // query that sees the NaN key also sees them; dQ is NaN on the rows that see it, and
    // otherwise only in the query heads of that kv head and batch row (a tile multiplies the
    // NaN key by the zero weights of rows that do not see it). The fallback (dense products,
    // like the composite) spreads NaN over that group but never outside it.
    let (b, h, kv, tq, tk, d) = (2, 4, 2, 40, 60, 4);
    let (rep, w) = (h / kv, 15);
    let ids = layouts(3, tk)?.narrow(0, 1, 2)?;
    let idv: Vec<Vec<u32>> = ids.to_vec2()?;
    let cfg = AttentionConfig::causal().with_window(w).with_doc_ids(ids);
    let sees_p = |i: usize, p: usize| sees(&idv[1], w, tq, i, p);
    for p in [33, 45, 59] {
        let [q, k, v] = qkv_inputs(95, (b, h, kv, tq, tk, d, d), DType::F32)?;
        let mut kvals = values(&k);
        kvals[((kv + 1) * tk + p) * d + 2] = f64::NAN;
        let k = Tensor::from_vec(kvals, k.dims(), &Device::Cpu)?.to_dtype(DType::F32)?;
        assert!((0..tq).any(|i| sees_p(i, p)), "p={p} must be seen");
        for fb in [false, true] {
            let f = |x: &[Tensor]| fallback_if(fb, || attention(&x[0], &x[1], &x[2], &cfg));
            let (y, g) = grads(&f, &[q.clone(), k.clone(), v.clone()], 96)?;
            let what = format!("p={p} fallback={fb}");
            let (ny, ndq) = (nans(&y), nans(&g[0]));
            for bb in 0..b {
                for hh in 0..h {
                    let group = bb == 1 && hh / rep == 1;
                    for i in 0..tq {
                        let at = (bb * h + hh) * tq + i;
                        let hit = group && sees_p(i, p);
                        for (n, nn) in [("y", &ny), ("dq", &ndq)] {
                            let row = &nn[at * d..(at + 1) * d];
                            if hit || !group || (n == "y" && !fb) {
                                assert!(row.iter().all(|&x| x == hit), "{what}: {n} {bb} {hh} {i}");
                            }
                        }
                    }
                }
            }
            let (ndk, ndv) = (nans(&g[1]), nans(&g[2]));
            for bb in 0..b {
                for c in 0..kv {
                    let group = bb == 1 && c == 1;
                    for j in 0..tk {
                        let at = (bb * kv + c) * tk + j;
                        let hit = group && (0..tq).any(|i| sees_p(i, p) && sees_p(i, j));
                        for (n, nn) in [("dk", &ndk), ("dv", &ndv)] {
                            let row = &nn[at * d..(at + 1) * d];
                            if hit || !group || !fb {
                                assert!(row.iter().all(|&x| x == hit), "{what}: {n} {bb} {c} {j}");
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
