//! Attention cases, and the layouts test (`attention_merged`, `attention_qkv` against
//! `attention`). The vector cases run every build the launcher picks
//! (`cuda_kernels::attention::builds`; `tests/triton_record` checks the coverage): in bf16 and
//! f16, `_d64_nodrop` (D = 64 causal), `_d64` (the window / documents / dropout case), `_d128`
//! (D = 128 with dropout), `_d128_nodrop` (D = 96: a partial tile), the generic build (D = 40);
//! f32 always the generic one.

use super::*;
use candle_fused::attention::AttentionConfig;
use candle_fused::RngKey;

// attention (triton/attention.py TOL, ERROR): o relative to its row's largest value, dq, dk,
// dv to the tensor's (a key few queries see has a tiny dK row). f32 1e-5: both sides in f32
// with IEEE products, different summation orders and exp implementations (measured under the
// interpreter: 1e-6). bf16 2^-6, f16 2^-9: two units in the last place; the outputs are rounded
// once on each side and the kernels round P and dS to the dtype for the tensor-core dots (the
// CPU keeps them f32). `lse` stays inside the op: not compared here.
pub(crate) const ATTENTION: &[Check] = &[
    Check {
        name: "o",
        mode: Mode::Row,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dq",
        mode: Mode::Tensor,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dk",
        mode: Mode::Tensor,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
    Check {
        name: "dv",
        mode: Mode::Tensor,
        tol: [1e-5, 1.0 / 64.0, 1.0 / 512.0],
    },
];

/// The vector file's configuration (`flags`, `doc`, `dropout`, `rng`; the scale is the
/// default, checked against `scale`): document ids only when some id is not 0 (all-zero ids
/// stand for none, so both kernel paths of `DOC` run).
pub(crate) fn attention_cfg(t: &HashMap<String, Tensor>, dev: &Device) -> Result<AttentionConfig> {
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
    let (q, k, v) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let o = candle_fused::attention::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), cfg)?;
    let g = (&o * dout)?.sum_all()?.backward()?;
    Ok(vec![
        ("o", o),
        ("dq", grad(&g, &q)?),
        ("dk", grad(&g, &k)?),
        ("dv", grad(&g, &v)?),
    ])
}

pub(crate) fn attention(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
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

/// `attention_merged` and `attention_qkv` give the bits of `attention` on the same heads (they
/// run the same kernels; only the copies around them differ): merged on the vector's grouped
/// q, k, v; qkv (one kv head per query head) against `attention` with k, v repeated per group.
/// Every attention vector file in `dir`, all of them whatever fails; the Triton switch as the
/// caller set it.
pub(crate) fn attention_layouts(dev: &Device, dir: &Path) -> Result<()> {
    let files = vector_files(dir, "attention")?;
    check_each(&files, |(p, _)| file_label(p), |(p, _)| layouts(dev, p))
}

/// [`attention_layouts`] on one vector file.
fn layouts(dev: &Device, path: &Path) -> Result<()> {
    eprintln!("{} (layouts)", path.display());
    let t = candle_core::safetensors::load(path, &Device::Cpu)?;
    let cfg = attention_cfg(&t, dev)?;
    let [q, k, v, dout] = ["q", "k", "v", "do"].map(|n| input(&t, n, dev));
    let (q, k, v, dout) = (q?, k?, v?, dout?);
    let (b, h, n, d) = q.dims4()?;
    let kvh = k.dim(1)?;
    let counted = |what: &str, run: &dyn Fn() -> Result<Outputs>| -> Result<Outputs> {
        let before = launch_count();
        let out = run()?;
        let launched = launch_count() - before;
        let want = if dev.is_cuda() { 4 } else { 0 };
        ensure!(
            launched == want,
            "{what}: {launched} Triton launches, expected {want}"
        );
        Ok(out)
    };

    let bhtd = attention_grads(&q, &k, &v, &dout, &cfg)?;
    let merged = counted("attention_merged", &|| {
        let vars = [&q, &k, &v].map(Var::from_tensor);
        let [qv, kv, vv] = vars;
        let (qv, kv, vv) = (qv?, kv?, vv?);
        let y = candle_fused::attention::attention_merged(
            qv.as_tensor(),
            kv.as_tensor(),
            vv.as_tensor(),
            &cfg,
        )?;
        let g = (&y * &merge(&dout)?)?.sum_all()?.backward()?;
        Ok(vec![
            ("o", unmerge(&y, h)?),
            ("dq", grad(&g, &qv)?),
            ("dk", grad(&g, &kv)?),
            ("dv", grad(&g, &vv)?),
        ])
    })?;
    ensure!(
        same_bits(&bhtd, &merged)?,
        "{}: attention_merged differs from attention",
        path.display()
    );

    let rep = |x: &Tensor| -> Result<Tensor> {
        Ok(x.unsqueeze(2)?
            .expand((b, kvh, h / kvh, n, d))?
            .reshape((b, h, n, d))?)
    };
    let (k, v) = (rep(&k)?, rep(&v)?);
    let repeated = attention_grads(&q, &k, &v, &dout, &cfg)?;
    let qkv_out = counted("attention_qkv", &|| {
        let qkv = Var::from_tensor(&Tensor::cat(&[merge(&q)?, merge(&k)?, merge(&v)?], 2)?)?;
        let y = candle_fused::attention::attention_qkv(qkv.as_tensor(), h, &cfg)?;
        let g = (&y * &merge(&dout)?)?.sum_all()?.backward()?;
        let dqkv = grad(&g, &qkv)?;
        let part = |i: usize| unmerge(&dqkv.narrow(2, i * h * d, h * d)?, h);
        Ok(vec![
            ("o", unmerge(&y, h)?),
            ("dq", part(0)?),
            ("dk", part(1)?),
            ("dv", part(2)?),
        ])
    })?;
    ensure!(
        same_bits(&repeated, &qkv_out)?,
        "{}: attention_qkv differs from attention",
        path.display()
    );
    Ok(())
}
