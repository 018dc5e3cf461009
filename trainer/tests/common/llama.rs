//! The Llama-family fixtures of `tests/fixtures/llama/` (made with transformers by
//! `scripts/python/make_llama_fixtures.py`): a case's batch, transformers' loss, logits and
//! gradients.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use trainer::model::{Ctx, Kernels, Model, Params, Rows, IGNORE};

use super::rel;

/// The directory of fixture `case`.
pub fn fixture(case: &str) -> PathBuf {
    super::fixtures("llama").join(case)
}

/// A case's batch and what transformers computed of it.
pub struct Expected {
    pub idx: Tensor,
    pub targets: Tensor,
    pub rows: Rows,
    pub loss: f32,
    pub logits: Tensor,
    pub grads: HashMap<String, Tensor>,
    /// Whatever else the file holds, by name.
    pub extra: HashMap<String, Tensor>,
}

/// Checks `model`, whose trainable tensors are `trainable`, against PEFT's results `e`
/// with `kernels`: the logits within 1e-5 of theirs (relative to their largest), the loss within
/// 1e-5, the trainable tensors theirs by name, each gradient within 1e-4 (relative). `what`
/// names the case in failures. Returns the logits.
pub fn check_against(
    model: &dyn Model,
    trainable: &Params,
    e: &Expected,
    kernels: Kernels,
    what: &str,
) -> Tensor {
    let ctx = Ctx::eval().with_kernels(kernels);
    let logits = model.forward(&e.idx, &ctx).unwrap();
    let r = rel(&logits, &e.logits);
    assert!(
        r < 1e-5,
        "{what}: logits differ from PEFT's by {r:e} (relative)"
    );
    let loss = model.loss(&e.idx, &e.targets, &ctx).unwrap();
    let l = loss.mean.to_scalar::<f32>().unwrap();
    assert!(
        (l - e.loss).abs() < 1e-5,
        "{what}: loss {l} vs PEFT {}",
        e.loss
    );
    let grads = loss.mean.backward().unwrap();
    let mut names: Vec<&String> = trainable.iter().map(|(n, _)| n).collect();
    names.sort();
    let mut want: Vec<&String> = e.grads.keys().collect();
    want.sort();
    assert_eq!(
        names, want,
        "{what}: trainable parameters are PEFT's tensors"
    );
    for (name, var) in trainable.iter() {
        let g = grads
            .get(var.as_tensor())
            .expect("every adapter tensor has a gradient");
        let r = rel(g, &e.grads[name]);
        assert!(
            r < 1e-4,
            "{what} {name}: gradient differs by {r:e} (relative)"
        );
    }
    logits
}

/// Case `case`'s batch (targets shifted as transformers shifts its labels) and results.
pub fn expected(case: &str) -> Expected {
    expected_at(&fixture(case).join("expected.safetensors"))
}

/// The batch and results in the `expected.safetensors` at `path`.
pub fn expected_at(path: &Path) -> Expected {
    let mut t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let ids = t.remove("input_ids").unwrap();
    let labels: Vec<Vec<i64>> = t.remove("labels").unwrap().to_vec2().unwrap();
    // transformers shifts the labels: position t predicts labels[t + 1]; the last predicts
    // nothing.
    let targets: Vec<Vec<u32>> = labels
        .iter()
        .map(|row| {
            (0..row.len())
                .map(|i| match row.get(i + 1) {
                    Some(&l) if l >= 0 => l as u32,
                    _ => IGNORE,
                })
                .collect()
        })
        .collect();
    let rows = match t.remove("position_ids") {
        None => Rows::default(),
        Some(p) => {
            let pos: Vec<Vec<i64>> = p.to_vec2().unwrap();
            // A new document wherever the positions restart (transformers'
            // `find_packed_sequence_indices`).
            let docs: Vec<Vec<u32>> = pos
                .iter()
                .map(|row| {
                    let mut d = 0u32;
                    row.iter()
                        .enumerate()
                        .map(|(i, &p)| {
                            if i > 0 && p == 0 {
                                d += 1;
                            }
                            d
                        })
                        .collect()
                })
                .collect();
            let pos: Vec<Vec<u32>> = pos
                .iter()
                .map(|r| r.iter().map(|&p| p as u32).collect())
                .collect();
            Rows {
                positions: Some(Tensor::new(pos, &Device::Cpu).unwrap()),
                doc_ids: Some(Tensor::new(docs, &Device::Cpu).unwrap()),
                tokens: None,
            }
        }
    };
    let loss = t.remove("loss").unwrap().to_scalar::<f32>().unwrap();
    let logits = t.remove("logits").unwrap();
    let (grads, extra): (HashMap<_, _>, HashMap<_, _>) =
        t.into_iter().partition(|(k, _)| k.starts_with("grad."));
    let grads = grads
        .into_iter()
        .map(|(k, v)| (k["grad.".len()..].to_string(), v))
        .collect();
    Expected {
        idx: ids.to_dtype(DType::U32).unwrap(),
        targets: Tensor::new(targets, &Device::Cpu).unwrap(),
        rows,
        loss,
        logits,
        grads,
        extra,
    }
}

/// `model`'s greedy continuation of the prompt in the `generate.safetensors` at `path` (KV
/// cache, CPU), and transformers' continuation recorded there.
pub fn greedy_against(model: &dyn Model, path: &Path) -> (Vec<u32>, Vec<u32>) {
    let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let ids = |name: &str| -> Vec<u32> {
        let v: Vec<i64> = t[name].squeeze(0).unwrap().to_vec1().unwrap();
        v.iter().map(|&x| x as u32).collect()
    };
    let (prompt, want) = (ids("prompt"), ids("greedy"));
    let new = want.len() - prompt.len();
    let got = trainer::sample::greedy_batch(model, &[prompt], new, &Device::Cpu)
        .unwrap()
        .remove(0);
    (got, want[want.len() - new..].to_vec())
}

/// The error of reading `base` changed by `edit` as a `config.json` in `dir` (through the
/// registry, as every loading path reads one), checked to name the file.
pub fn config_error(
    base: &serde_json::Value,
    edit: &dyn Fn(&mut serde_json::Value),
    dir: &Path,
) -> String {
    let mut v = base.clone();
    edit(&mut v);
    let path = dir.join("config.json");
    std::fs::write(&path, v.to_string()).unwrap();
    let e = trainer::model::config_from_hf_json_file(&path)
        .expect_err("a bad config.json")
        .to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");
    e
}
