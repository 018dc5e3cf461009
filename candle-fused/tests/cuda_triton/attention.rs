//! The layouts test (`attention_merged`, `attention_qkv` against `attention`) on the attention
//! family's vector files (`tests/families/attention.rs`).

use super::*;
use crate::families::attention::{attention_cfg, attention_grads, merge, unmerge};
use crate::families::{backward_of, grad, input};
use candle_core::Var;

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
        let g = backward_of(&y, &merge(&dout)?)?;
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

    // Llama's layout: k and v as their `[B, T, KV, D]` projections seen through a transpose,
    // read in place (no copy on either side), their gradients in that layout
    let llama = counted("attention_merged, transposed k and v", &|| {
        let tr = |x: &Tensor| Var::from_tensor(&x.transpose(1, 2)?.contiguous()?);
        let (qv, kt, vt) = (Var::from_tensor(&q)?, tr(&k)?, tr(&v)?);
        let (kv_, vv) = (
            kt.as_tensor().transpose(1, 2)?,
            vt.as_tensor().transpose(1, 2)?,
        );
        ensure!(kvh == 1 || !vv.is_contiguous(), "v is not a strided view");
        let y = candle_fused::attention::attention_merged(qv.as_tensor(), &kv_, &vv, &cfg)?;
        let g = backward_of(&y, &merge(&dout)?)?;
        let back = |x: &Var| -> Result<Tensor> { Ok(grad(&g, x)?.transpose(1, 2)?.contiguous()?) };
        Ok(vec![
            ("o", unmerge(&y, h)?),
            ("dq", grad(&g, &qv)?),
            ("dk", back(&kt)?),
            ("dv", back(&vt)?),
        ])
    })?;
    ensure!(
        same_bits(&bhtd, &llama)?,
        "{}: attention_merged on transposed k, v differs from attention",
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
        let g = backward_of(&y, &merge(&dout)?)?;
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
