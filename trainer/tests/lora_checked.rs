//! PEFT adapters enter a model like weights: every command that loads one (training from it,
//! merging it for `sample`/`eval`, exporting it) refuses non-float, non-finite or overflowing
//! tensors, tensors its `target_modules` do not select and selected modules without tensors,
//! naming the file and the tensor or module; and it refuses an adapter made on another base,
//! which it recognises by content (a reformatted `config.json` or resharded weights are the
//! same base). The bad adapters are written here, from the fixture's good one.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::export::{export, ExportOptions};
use trainer::load::ModelDir;
use trainer::lora::{BaseIdentity, RecordedBase};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lora")
        .join(name)
}

const Q0: &str = "base_model.model.model.layers.0.self_attn.q_proj";

/// A copy of the fixture's `adapter_plain` in `dir/name`, over the fixture's base (or `base`),
/// with its tensors changed by `edit` and its `adapter_config.json` by `config`.
fn adapter(
    dir: &Path,
    name: &str,
    base: Option<&Path>,
    edit: impl FnOnce(&mut HashMap<String, Tensor>),
    config: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    let src = fixture("adapter_plain");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    let base = base.map_or_else(|| fixture("base"), Path::to_path_buf);
    json["base_model_name_or_path"] = base.display().to_string().into();
    config(&mut json);
    std::fs::write(d.join("adapter_config.json"), json.to_string()).unwrap();
    let mut t = candle_core::safetensors::load(src.join("adapter_model.safetensors"), &Device::Cpu)
        .unwrap();
    edit(&mut t);
    candle_core::safetensors::save(&t, d.join("adapter_model.safetensors")).unwrap();
    d
}

/// A copy of the fixture base in `dir` with one value changed (element 5 of `model.norm.weight`
/// set to 0.5): another base under another path.
fn another_base(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture("base/config.json"), dir.join("config.json")).unwrap();
    let mut t =
        candle_core::safetensors::load(fixture("base/model.safetensors"), &Device::Cpu).unwrap();
    poison(&mut t, "model.norm.weight", 0.5);
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

/// `name`'s tensor with element 5 set to `v`.
fn poison(t: &mut HashMap<String, Tensor>, name: &str, v: f32) {
    let x = &t[name];
    let mut values = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    values[5] = v;
    let y = Tensor::from_vec(values, x.dims(), &Device::Cpu).unwrap();
    t.insert(name.to_string(), y);
}

/// The errors of the three ways an adapter enters a model: merged for inference (`sample`,
/// `eval`), kept apart for export, and as the start of a LoRA run (`--adapter`).
fn errors(dir: &Path, adapter: &Path) -> [String; 3] {
    let merged = ModelDir::at(adapter.to_path_buf())
        .and_then(|m| m.load_model(&Device::Cpu))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_else(|| "merged: no error".into());
    let out = dir.join(format!(
        "export-{}",
        adapter.file_name().unwrap().to_string_lossy()
    ));
    let exported = ModelDir::at(adapter.to_path_buf())
        .and_then(|m| export(&m, &out, &ExportOptions::default()))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_else(|| "export: no error".into());
    let trained = trainer::train::Trainer::new(TrainConfig {
        adapter: Some(adapter.to_path_buf()),
        ..lora_run(dir, &fixture("base"))
    })
    .err()
    .map(|e| e.to_string())
    .unwrap_or_else(|| "train: no error".into());
    [merged, exported, trained]
}

/// A LoRA run over `base` on a small char corpus.
fn lora_run(dir: &Path, base: &Path) -> TrainConfig {
    let corpus = dir.join("corpus.txt");
    std::fs::write(
        &corpus,
        "to be or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    TrainConfig {
        init_from: Some(base.display().to_string()),
        data: DataKind::Char,
        data_path: Some(corpus),
        lora_r: 4,
        max_iters: 2,
        lr_decay_iters: Some(2),
        eval_interval: 2,
        ..common::tiny_config(&dir.join("run"))
    }
}

#[test]
fn bad_adapter_tensors_are_refused_by_every_command_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let a = format!("{Q0}.lora_A.weight");
    let b = format!("{Q0}.lora_B.weight");
    let cases: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        (
            "nan",
            adapter(dir, "nan", None, |t| poison(t, &a, f32::NAN), |_| {}),
            vec![&a, "NaN"],
        ),
        (
            "inf",
            adapter(
                dir,
                "inf",
                None,
                |t| poison(t, &b, f32::NEG_INFINITY),
                |_| {},
            ),
            vec![&b, "-inf"],
        ),
        (
            "i32",
            adapter(
                dir,
                "i32",
                None,
                |t| {
                    let x = t[&a].to_dtype(DType::I64).unwrap();
                    let x = Tensor::from_vec(
                        x.flatten_all()
                            .unwrap()
                            .to_vec1::<i64>()
                            .unwrap()
                            .iter()
                            .map(|v| *v as i32)
                            .collect::<Vec<_>>(),
                        x.dims(),
                        &Device::Cpu,
                    )
                    .unwrap();
                    t.insert(a.clone(), x);
                },
                |_| {},
            ),
            vec![&a, "I32"],
        ),
        (
            // Finite f32 values whose product overflows: 1e38 · 1e38.
            "huge",
            adapter(
                dir,
                "huge",
                None,
                |t| {
                    for n in [&a, &b] {
                        let x = (t[n.as_str()].ones_like().unwrap() * 1e38).unwrap();
                        t.insert(n.clone(), x);
                    }
                },
                |_| {},
            ),
            vec!["model.layers.0.self_attn.q_proj", "overflows"],
        ),
        (
            // One finite 1e38 (a flipped exponent bit): a finite update s·B·A, and no overflow
            // in the forward pass either (the next RMSNorm rescales it), but ~1e36 against
            // weights of ~0.1: garbage out, so refused.
            "one_1e38",
            adapter(dir, "one_1e38", None, |t| poison(t, &a, 1e38), |_| {}),
            vec![
                "model.layers.0.self_attn.q_proj",
                "times the largest magnitude",
            ],
        ),
        (
            "three_d",
            adapter(
                dir,
                "three_d",
                None,
                |t| {
                    let x = t[&a].unsqueeze(0).unwrap();
                    t.insert(a.clone(), x);
                },
                |_| {},
            ),
            vec![&a, "2-D"],
        ),
    ];
    for (case, path, words) in cases {
        for e in errors(dir, &path) {
            assert!(
                e.contains(&format!("{case}/adapter_model.safetensors"))
                    && words.iter().all(|w| e.contains(w)),
                "{case}: {e}"
            );
        }
    }
}

#[test]
fn target_modules_are_honoured_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The config says q_proj; the file holds all seven projections of both layers.
    let narrow = adapter(
        dir,
        "narrow",
        None,
        |_| {},
        |c| c["target_modules"] = serde_json::json!(["q_proj"]),
    );
    for e in errors(dir, &narrow) {
        common::assert_mentions(
            &e,
            &[
                "narrow",
                "12 module(s)",
                "model.layers.0.mlp.down_proj",
                "`q_proj`",
            ],
        );
    }
    // The config selects q_proj and v_proj, the file has none for layer 1's.
    let missing = adapter(
        dir,
        "missing",
        None,
        |t| {
            for (m, s) in [("q", "A"), ("q", "B"), ("v", "A"), ("v", "B")] {
                t.remove(&format!(
                    "base_model.model.model.layers.1.self_attn.{m}_proj.lora_{s}.weight"
                ));
            }
        },
        |_| {},
    );
    for e in errors(dir, &missing) {
        common::assert_mentions(
            &e,
            &[
                "missing",
                "2 module(s)",
                "`model.layers.1.self_attn.q_proj`, `model.layers.1.self_attn.v_proj`",
                "no lora_A/lora_B",
            ],
        );
    }
}

/// The fixture's base in `dir`, its config.json re-serialised (other key order, spacing, a
/// float in exponent form, another `torch_dtype` and `initializer_range`), its weights in two shards with an index.
fn reformatted_base(dir: &Path) -> PathBuf {
    let d = dir.join("reformatted");
    std::fs::create_dir_all(&d).unwrap();
    let text = std::fs::read_to_string(fixture("base/config.json")).unwrap();
    let mut json: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    // Not architecture: the dtype the weights were saved in, their initialisation.
    json.insert("torch_dtype".into(), "bfloat16".into());
    json.insert("initializer_range".into(), 0.5.into());
    let mut pairs: Vec<(String, serde_json::Value)> = json.into_iter().collect();
    pairs.reverse();
    let body: Vec<String> = pairs
        .iter()
        .map(|(k, v)| match k.as_str() {
            "rms_norm_eps" => format!("\"{k}\":{:e}", v.as_f64().unwrap()),
            _ => format!("\"{k}\" : {v}"),
        })
        .collect();
    std::fs::write(
        d.join("config.json"),
        format!("{{\n{}\n}}", body.join(",\n\t")),
    )
    .unwrap();
    let t =
        candle_core::safetensors::load(fixture("base/model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    let mut shards = [HashMap::new(), HashMap::new()];
    for (i, n) in names.into_iter().enumerate() {
        let shard = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        weight_map.insert(n.clone(), shard.into());
        shards[i % 2].insert(n.clone(), t[n].clone());
    }
    for (i, s) in shards.iter().enumerate() {
        let file = d.join(format!("model-0000{}-of-00002.safetensors", i + 1));
        candle_core::safetensors::save(s, file).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    d
}

fn identity(dir: &Path) -> BaseIdentity {
    let (config, params) = ModelDir::at(dir.to_path_buf())
        .unwrap()
        .load(&Device::Cpu)
        .unwrap();
    BaseIdentity::of("x", config.as_ref(), &params).unwrap()
}

#[test]
fn the_base_identity_is_the_architecture_and_the_tensor_values() {
    let tmp = tempfile::tempdir().unwrap();
    let same = reformatted_base(tmp.path());
    assert_eq!(identity(&same), identity(&fixture("base")));
    // One value changed, or one architecture field: another base.
    let other = another_base(&tmp.path().join("other"));
    let (a, b) = (identity(&fixture("base")), identity(&other));
    assert!(a.architecture == b.architecture && a.tensors != b.tensors);
    let text = std::fs::read_to_string(fixture("base/config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["rms_norm_eps"] = serde_json::json!(1e-3);
    std::fs::write(other.join("config.json"), json.to_string()).unwrap();
    std::fs::copy(
        fixture("base/model.safetensors"),
        other.join("model.safetensors"),
    )
    .unwrap();
    let c = identity(&other);
    assert!(a.architecture != c.architecture && a.tensors == c.tensors);
}

#[test]
fn an_adapter_records_its_base_and_is_refused_on_another() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Exported over the fixture's base, the adapter records it.
    let exported = dir.join("exported");
    let source = ModelDir::at(fixture("adapter_plain")).unwrap();
    export(&source, &exported, &ExportOptions::default()).unwrap();
    let a = candle_peft::Adapter::load(&exported, &Device::Cpu).unwrap();
    let recorded = BaseIdentity::from_metadata(&a).unwrap().unwrap();
    assert_eq!(recorded.tensors, identity(&fixture("base")).tensors);
    // Over a reformatted, resharded copy of that base: the same base, accepted.
    let same = reformatted_base(dir);
    let over = |base: &Path, name: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(
            exported.join("adapter_model.safetensors"),
            d.join("adapter_model.safetensors"),
        )
        .unwrap();
        let p = exported.join("adapter_config.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        json["base_model_name_or_path"] = base.display().to_string().into();
        std::fs::write(d.join("adapter_config.json"), json.to_string()).unwrap();
        d
    };
    let on_same = over(&same, "on_same");
    ModelDir::at(on_same)
        .unwrap()
        .load_model(&Device::Cpu)
        .unwrap();
    // Over another base: refused by inference, export and training, naming both bases.
    let other = another_base(&dir.join("other_base"));
    let theirs = identity(&other);
    let on_other = over(&other, "on_other");
    let [merged, exported_err, _] = errors(dir, &on_other);
    for e in [merged, exported_err] {
        common::assert_mentions(
            &e,
            &[
                "on_other/adapter_model.safetensors",
                &recorded.tensors,
                &theirs.tensors,
                "--other-base",
            ],
        );
    }
    let run = |other_base: bool| {
        trainer::train::Trainer::new(TrainConfig {
            adapter: Some(exported.clone()),
            other_base,
            ..lora_run(&dir.join(format!("run-{other_base}")), &other)
        })
    };
    std::fs::create_dir_all(dir.join("run-false")).unwrap();
    std::fs::create_dir_all(dir.join("run-true")).unwrap();
    let e = run(false).err().expect("refused").to_string();
    common::assert_mentions(&e, &[&recorded.tensors, &theirs.tensors]);
    // The override: used, with a warning.
    run(true).unwrap();
    ModelDir::at(over(&other, "on_other_2"))
        .unwrap()
        .with_other_base(true)
        .load_model(&Device::Cpu)
        .unwrap();
    // The commands: refused, then exported with --other-base and a warning naming both.
    let on_other = on_other.display().to_string();
    let refused = common::run_cli(&["export", &on_other, "cli-out"], dir);
    let text = common::output_text(&refused);
    assert!(
        !refused.status.success() && text.contains("--other-base"),
        "{text}"
    );
    let used = common::run_cli(&["export", "--other-base", &on_other, "cli-out"], dir);
    let text = common::output_text(&used);
    assert!(
        used.status.success() && text.contains(&recorded.tensors) && text.contains("used anyway"),
        "{text}"
    );
}

/// Runs written before identities were semantic recorded the digests of the base's files:
/// they are still read, and checked as then.
#[test]
fn old_file_digest_identities_are_still_checked() {
    let (tmp, base) = common::temp_join("base");
    common::copy_model(&fixture("base"), &base);
    let digest = |f: &str| trainer::checkpoint::manifest::digest(&base.join(f)).unwrap();
    let old = serde_json::json!({
        "model": "the-base",
        "config": digest("config.json"),
        "weights": {"model.safetensors": digest("model.safetensors")},
    });
    let recorded: RecordedBase = serde_json::from_value(old).unwrap();
    assert!(matches!(recorded, RecordedBase::Files { .. }));
    let now = identity(&base);
    let files = [base.join("model.safetensors")];
    let ckpt = tmp.path().join("ckpt");
    recorded.check(&now, &base, &files, &ckpt).unwrap();
    let text = std::fs::read_to_string(base.join("config.json")).unwrap();
    std::fs::write(base.join("config.json"), format!("{text}\n")).unwrap();
    let e = recorded
        .check(&now, &base, &files, &ckpt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the-base") && e.contains("config.json"), "{e}");
    // A semantic record reads back as one.
    let semantic: RecordedBase =
        serde_json::from_value(serde_json::to_value(RecordedBase::Semantic(now.clone())).unwrap())
            .unwrap();
    assert_eq!(semantic, RecordedBase::Semantic(now));
}
