//! `trainer export --format gguf` against llama.cpp's own converter: the committed fixtures
//! (scripts/python/make_gguf_fixtures.py) hold, per model and type, every metadata key
//! `convert_hf_to_gguf.py` wrote and the sha256 of every tensor's bytes. Our files are read
//! back by Candle's GGUF reader (a parser that is not ours) and must hold the same keys with
//! the same types and values, and the same tensors byte for byte.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use trainer::export::gguf::{export_gguf, export_gguf_lora, GgufOptions, GgufType};
use trainer::load::ModelDir;

const MODELS: [&str; 6] = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "llama3_rope",
    "llama_linear_rope",
];

fn fixture(name: &str) -> PathBuf {
    common::fixtures("gguf").join(name)
}

/// Export options of type `ty` (the stored dtype's if `None`), with the tokenizer or not.
fn gguf_options(ty: Option<GgufType>, tokenizer: bool) -> GgufOptions {
    GgufOptions {
        ty,
        tokenizer,
        force: false,
        other_base: false,
    }
}

fn types() -> [(&'static str, GgufType); 5] {
    [
        ("f32", GgufType::F32),
        ("f16", GgufType::F16),
        ("bf16", GgufType::Bf16),
        ("q8_0", GgufType::Q8_0),
        ("q4_k_m", GgufType::Q4KM),
    ]
}

/// The RMS distance of tensor `name` of the GGUF file `q`, dequantized, from the same tensor
/// of the f32 file `f32`.
fn rms_error(q: &Path, f32: &Path, name: &str) -> f64 {
    let read = |p: &Path| {
        let mut f = File::open(p).unwrap();
        let c = Content::read(&mut f).unwrap();
        let t = c.tensor(&mut f, name, &candle_core::Device::Cpu).unwrap();
        let t = t.dequantize(&candle_core::Device::Cpu).unwrap();
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let (a, b) = (read(q), read(f32));
    let sum: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    (sum / a.len() as f64).sqrt()
}

/// A metadata value as the fixture records it: gguf-py's type names and a JSON value.
fn describe(v: &Value) -> (Vec<String>, Json) {
    let scalar = |v: &Value| -> (&'static str, Json) {
        match v {
            Value::U32(x) => ("UINT32", Json::from(*x)),
            Value::I32(x) => ("INT32", Json::from(*x)),
            Value::U64(x) => ("UINT64", Json::from(*x)),
            Value::F32(x) => ("FLOAT32", Json::from(*x as f64)),
            Value::Bool(x) => ("BOOL", Json::from(*x)),
            Value::String(x) => ("STRING", Json::from(x.clone())),
            other => ("OTHER", Json::from(format!("{other:?}"))),
        }
    };
    match v {
        Value::Array(items) => {
            let elem = items.first().map(|i| scalar(i).0).unwrap_or("EMPTY");
            let values = items.iter().map(|i| scalar(i).1).collect();
            (vec!["ARRAY".into(), elem.into()], Json::Array(values))
        }
        v => {
            let (t, j) = scalar(v);
            (vec![t.into()], j)
        }
    }
}

/// Two recorded values equal, floats compared as the f32 they were written as.
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) if x.is_f64() || y.is_f64() => {
            x.as_f64().map(|v| v as f32) == y.as_f64().map(|v| v as f32)
        }
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        _ => a == b,
    }
}

/// gguf-py's name of a type (`Q4_K` where Candle says `Q4K`).
fn ggml_name(t: candle_core::quantized::GgmlDType) -> String {
    let n = format!("{t:?}").to_uppercase();
    match n.strip_suffix('K') {
        Some(q) if q.starts_with('Q') => format!("{q}_K"),
        _ => n,
    }
}

/// Every difference between our file and the converter's record, one line each. Tensors must
/// be the same bytes, except that a lossy type's tensor may differ if it is no further from
/// the f32 file `f32` than theirs (`rms_error` in the record).
fn differences(ours: &Path, expected: &Json, f32: &Path) -> Vec<String> {
    let mut file = File::open(ours).unwrap();
    let content = Content::read(&mut file).unwrap();
    let mut out = Vec::new();
    let keys: BTreeMap<&String, &Value> = content
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != "general.name")
        .collect();
    // The converter derives these from the path it was given (adapters: the base's).
    let from_path = |k: &str| k.starts_with("general.base_model.") || k == "general.tags";
    let mut want = expected["keys"].as_object().unwrap().clone();
    want.retain(|k, _| !from_path(k));
    for (k, v) in &keys {
        let (types, value) = describe(v);
        match want.get(k.as_str()) {
            None => out.push(format!("key {k}: ours only")),
            Some(w) => {
                let wt: Vec<String> = serde_json::from_value(w["type"].clone()).unwrap();
                if wt != types || !same(&w["value"], &value) {
                    let show = |j: &Json| j.to_string().chars().take(120).collect::<String>();
                    out.push(format!(
                        "key {k}: ours {types:?} {}, theirs {wt:?} {}",
                        show(&value),
                        show(&w["value"])
                    ));
                }
            }
        }
    }
    for k in want.keys() {
        if !keys.contains_key(k) {
            out.push(format!("key {k}: theirs only"));
        }
    }
    let want = expected["tensors"].as_object().unwrap();
    for (name, info) in &content.tensor_infos {
        let Some(w) = want.get(name) else {
            out.push(format!("tensor {name}: ours only"));
            continue;
        };
        let dims = info.shape.dims().to_vec();
        let bytes =
            info.shape.elem_count() / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        let mut data = vec![0u8; bytes];
        file.seek(SeekFrom::Start(content.tensor_data_offset + info.offset))
            .unwrap();
        file.read_exact(&mut data).unwrap();
        let digest = format!("{:x}", Sha256::digest(&data));
        let wshape: Vec<usize> = serde_json::from_value(w["shape"].clone()).unwrap();
        let wtype = w["type"].as_str().unwrap();
        let same_bytes = w["sha256"] == digest.as_str();
        let close_enough = || match w["rms_error"].as_f64() {
            Some(theirs) => rms_error(ours, f32, name) <= theirs * (1.0 + 1e-6),
            None => false,
        };
        if wtype != ggml_name(info.ggml_dtype) || wshape != dims || !(same_bytes || close_enough())
        {
            out.push(format!(
                "tensor {name}: ours {} {dims:?} {digest}, theirs {wtype} {wshape:?} {}",
                ggml_name(info.ggml_dtype),
                w["sha256"]
            ));
        }
    }
    for k in want.keys() {
        if !content.tensor_infos.contains_key(k) {
            out.push(format!("tensor {k}: theirs only"));
        }
    }
    out
}

/// Fails listing `all` when there is any difference.
fn assert_no_differences(all: &[String]) {
    assert!(
        all.is_empty(),
        "{} differences:\n{}",
        all.len(),
        all.join("\n")
    );
}

/// Every difference, labelled `<fixture> <type>`, between what `export(type, out)` writes for
/// each of `types` (to `<fixture>.<type>.gguf` in `tmp`) and the converter's files described
/// in the fixture's `expected.json`; `f32(out)` is the export the quantized types' values are
/// compared against.
fn export_differences(
    tmp: &Path,
    fixture_name: &str,
    types: &[(&str, GgufType)],
    export: impl Fn(GgufType, &Path),
    f32: impl Fn(&Path) -> PathBuf,
) -> Vec<String> {
    let expected = common::read_json(&fixture(fixture_name).join("expected.json"));
    let mut all = Vec::new();
    for (name, ty) in types {
        let out = tmp.join(format!("{fixture_name}.{name}.gguf"));
        export(*ty, &out);
        for d in differences(&out, &expected["types"][name], &f32(&out)) {
            all.push(format!("{fixture_name} {name}: {d}"));
        }
    }
    all
}

#[test]
fn exports_equal_llama_cpp_converter() {
    let tmp = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    for model in MODELS {
        let source = ModelDir::open(fixture(model).to_str().unwrap()).unwrap();
        let export = |ty, out: &Path| {
            export_gguf(&source, out, &gguf_options(Some(ty), true)).unwrap();
        };
        let f32 = tmp.path().join(format!("{model}.f32.gguf"));
        all.extend(export_differences(
            tmp.path(),
            model,
            &types(),
            export,
            |_| f32.clone(),
        ));
    }
    assert_no_differences(&all);
}

#[test]
fn default_type_follows_the_stored_dtype_as_the_converter_auto() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, want) in [("llama", GgufType::F16), ("qwen2", GgufType::Bf16)] {
        let source = ModelDir::open(fixture(model).to_str().unwrap()).unwrap();
        let options = gguf_options(None, true);
        let done =
            export_gguf(&source, &tmp.path().join(format!("{model}.gguf")), &options).unwrap();
        assert_eq!(done.ty, want, "{model}");
    }
}

#[test]
fn a_word_level_tokenizer_is_refused_by_name_and_nothing_is_left() {
    // The embedded chat base's tokenizer is WordLevel, which GGUF cannot express.
    let (tmp, model) = common::temp_join("model");
    common::copy_model(&fixture("llama"), &model);
    let mut tok = common::read_json(&fixture("llama").join("tokenizer.json"));
    tok["model"]["type"] = "WordLevel".into();
    std::fs::write(model.join("tokenizer.json"), tok.to_string()).unwrap();
    let source = ModelDir::open(model.to_str().unwrap()).unwrap();
    let out = tmp.path().join("out.gguf");
    let mut options = gguf_options(Some(GgufType::F16), true);
    let err = export_gguf(&source, &out, &options)
        .unwrap_err()
        .to_string();
    common::assert_mentions(
        &err,
        &["tokenizer.json", "WordLevel", "--gguf-no-tokenizer"],
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "only the model directory remains");
    options.tokenizer = false;
    let done = export_gguf(&source, &out, &options).unwrap();
    assert!(!done.tokenizer);
    let content = Content::read(&mut File::open(&out).unwrap()).unwrap();
    assert!(!content.metadata.keys().any(|k| k.starts_with("tokenizer.")));
}

#[test]
fn adapters_are_merged_as_the_merged_export_is() {
    // A PEFT adapter over its base, written to GGUF, holds the same bytes as the merged
    // Hugging Face export (`export --merge`) written to GGUF: the adapters are merged once,
    // by the same path. (No tokenizer: the LoRA fixture has none.)
    use trainer::export::{export, ExportOptions};
    let tmp = tempfile::tempdir().unwrap();
    let lora = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora");
    let adapter = ModelDir::at(lora.join("adapter_plain")).unwrap();
    let merged = tmp.path().join("merged");
    let options = ExportOptions {
        merge: true,
        ..ExportOptions::default()
    };
    export(&adapter, &merged, &options).unwrap();
    let gguf = gguf_options(Some(GgufType::F32), false);
    let (a, b) = (tmp.path().join("a.gguf"), tmp.path().join("b.gguf"));
    export_gguf(&adapter, &a, &gguf).unwrap();
    export_gguf(&ModelDir::at(merged.clone()).unwrap(), &b, &gguf).unwrap();
    let tensors = |p: &Path| {
        let mut f = File::open(p).unwrap();
        let c = Content::read(&mut f).unwrap();
        let mut all: Vec<(String, Vec<u8>)> = c
            .tensor_infos
            .iter()
            .map(|(n, i)| {
                let mut d = vec![0u8; i.shape.elem_count() * 4];
                f.seek(SeekFrom::Start(c.tensor_data_offset + i.offset))
                    .unwrap();
                f.read_exact(&mut d).unwrap();
                (n.clone(), d)
            })
            .collect();
        all.sort();
        all
    };
    let (ta, tb) = (tensors(&a), tensors(&b));
    assert_eq!(ta.len(), 2 * 9 + 3);
    assert!(
        ta == tb,
        "the adapter's GGUF differs from the merged model's"
    );
    // ...and differs from the base's: the adapter is not a no-op.
    let c = tmp.path().join("c.gguf");
    export_gguf(&ModelDir::at(lora.join("base")).unwrap(), &c, &gguf).unwrap();
    assert!(tensors(&c) != ta);
}

/// Each GGUF LoRA fixture and the model fixture it adapts.
const LORA_FIXTURES: [(&str, &str); 3] = [
    ("lora_llama", "llama"),
    ("lora_qwen2", "qwen2"),
    ("lora_llama_rslora", "llama"),
];

#[test]
fn lora_adapters_equal_llama_cpp_lora_converter() {
    // PEFT adapters over the llama (q/k rows permuted: lora_B's too) and qwen2 fixtures, and
    // an rsLoRA one, against convert_lora_to_gguf.py's files (make_gguf_lora_fixtures.py).
    let tmp = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    for (name, base) in LORA_FIXTURES {
        let source =
            ModelDir::adapter_over(fixture(name), fixture(base).to_str().unwrap()).unwrap();
        let export = |ty, out: &Path| {
            export_gguf_lora(&source, out, &gguf_options(Some(ty), false)).unwrap();
        };
        let types = &types()[..4];
        all.extend(export_differences(
            tmp.path(),
            name,
            types,
            export,
            Path::to_path_buf,
        ));
    }
    assert_no_differences(&all);
}

#[test]
fn what_a_gguf_lora_cannot_hold_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora");
    let options = gguf_options(None, false);
    let out = tmp.path().join("a.gguf");
    // A whole model has no adapters.
    let err = export_gguf_lora(&ModelDir::at(lora.join("base")).unwrap(), &out, &options)
        .unwrap_err()
        .to_string();
    common::assert_mentions(&err, &["no adapters", "--gguf-lora"]);
    // q4_k_m is a model type.
    let q4 = GgufOptions {
        ty: Some(GgufType::Q4KM),
        ..options
    };
    let adapter = ModelDir::at(lora.join("adapter_plain")).unwrap();
    let err = export_gguf_lora(&adapter, &out, &q4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("q4_k_m"), "{err}");
    // Whole saved modules (modules_to_save) are named.
    let saved = ModelDir::at(lora.join("adapter_mts")).unwrap();
    let err = export_gguf_lora(&saved, &out, &options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("modules_to_save"), "{err}");
    assert!(!out.exists(), "nothing is written");
}
