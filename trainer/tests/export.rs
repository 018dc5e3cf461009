//! Weights in and out (#21): `trainer export` writes Hugging Face model directories (single
//! file or shards with an index, in the source's dtype or another), which the loader reads
//! back exactly; broken shards are errors naming the file and the tensor; sampling stops at
//! the end tokens `generation_config.json` lists. Nothing is downloaded.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::{output_text, run_cli, values};
use serde_json::Value;
use trainer::checkpoint::{self, io};
use trainer::config::TrainConfig;
use trainer::export::{self, ExportOptions, WeightDtype};
use trainer::load::{ModelDir, WeightFiles, INDEX_FILE};
use trainer::model::llama::{Family, LlamaConfig};
use trainer::model::{ModelConfig, Params};

/// A tiny Llama: 64 ids, 2 layers, 32 wide, 4 heads over 2 kv heads, MLP 48.
fn tiny_llama(tied: bool) -> LlamaConfig {
    LlamaConfig {
        tie_word_embeddings: tied,
        ..LlamaConfig::new(Family::Llama, 64, 2, 32, 4, 2, 48)
    }
}

/// `cfg` initialised with `seed`, saved as a Hugging Face model directory at `dir` with its
/// weights stored as `dtype` (and `torch_dtype` saying so).
fn hf_dir(dir: &Path, cfg: &LlamaConfig, seed: u64, dtype: WeightDtype) -> Params {
    let cfg = LlamaConfig {
        torch_dtype: Some(dtype.torch_name().into()),
        ..cfg.clone()
    };
    let (_, params) = trainer::model::init(&cfg, seed, &Device::Cpu).unwrap();
    checkpoint::save_model(dir, &cfg, &params).unwrap();
    if dtype != WeightDtype::F32 {
        let tensors: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().to_dtype(dtype.dtype()).unwrap()))
            .collect();
        let meta = [("format".to_string(), "pt".to_string())].into();
        io::save_safetensors(&dir.join("model.safetensors"), &tensors, Some(meta)).unwrap();
    }
    params
}

fn load(dir: &Path) -> trainer::Result<(Box<dyn ModelConfig>, Params)> {
    Ok(ModelDir::open(dir.to_str().unwrap())?.load(&Device::Cpu)?)
}

fn load_err(dir: &Path) -> String {
    load(dir).expect_err("loading should fail").to_string()
}

/// Every parameter's values, by name.
fn flat(params: &Params) -> Vec<(String, Vec<f32>)> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), values::<f32>(v.as_tensor())))
        .collect()
}

/// `params` after a round trip through `dtype`.
fn rounded(params: &Params, dtype: DType) -> Vec<(String, Vec<f32>)> {
    params
        .iter()
        .map(|(n, v)| {
            let t = v.as_tensor().to_dtype(dtype).unwrap();
            (n.clone(), values::<f32>(&t))
        })
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap()
}

/// Name, dtype, shape of every stored tensor of model directory `dir`.
fn stored(dir: &Path) -> Vec<(String, String, Vec<usize>)> {
    let mut h: Vec<_> = WeightFiles::locate(dir)
        .unwrap()
        .headers()
        .unwrap()
        .into_iter()
        .map(|h| (h.name, h.dtype, h.shape))
        .collect();
    h.sort();
    h
}

/// Each of `names` holds the same bytes in directories `a` and `b`.
fn assert_same_files(a: &Path, b: &Path, names: &[&str]) {
    for f in names {
        assert_eq!(
            fs::read(a.join(f)).unwrap(),
            fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
}

fn export_to(src: &Path, out: &Path, options: ExportOptions) -> export::Exported {
    export::export_spec(src.to_str().unwrap(), out, &options).unwrap()
}

/// A run in `run` fine-tuned from the model in `hf` on `corpus` (8-token blocks) with the
/// tokenizer `tok`, for `iters` steps.
fn fine_tune(
    hf: &Path,
    corpus: PathBuf,
    tok: PathBuf,
    iters: usize,
    run: &Path,
) -> trainer::train::Trainer {
    common::train(TrainConfig {
        init_from: Some(hf.display().to_string()),
        data: "tokenizer".parse().unwrap(),
        data_path: Some(corpus),
        tokenizer_path: Some(tok),
        block_size: 8,
        max_iters: iters,
        eval_interval: iters,
        ..common::tiny_config(run)
    })
}

#[test]
fn f32_export_round_trips_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    let params = hf_dir(&src, &tiny_llama(false), 1, WeightDtype::F32);
    let done = export_to(&src, &out, ExportOptions::default());
    assert_eq!(done.dtype, WeightDtype::F32);
    assert_eq!(done.weight_files, vec!["model.safetensors".to_string()]);
    assert!(!out.join(INDEX_FILE).exists());
    let cfg = json(&out.join("config.json"));
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["torch_dtype"], "float32");
    assert_eq!(cfg["rope_theta"], 10000.0);
    let file = io::load_safetensors(&out.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(file.metadata["format"], "pt");
    let (config, back) = load(&out).unwrap();
    assert_eq!(config.to_hf_json()["hidden_size"], 32);
    assert_eq!(flat(&back), flat(&params));
    let bytes: u64 = params.iter().map(|(_, v)| 4 * v.elem_count() as u64).sum();
    assert_eq!(done.total_size, bytes);
}

#[test]
fn bf16_export_stores_bf16_and_reloads_within_rounding() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    let params = hf_dir(&src, &tiny_llama(false), 2, WeightDtype::F32);
    let options = ExportOptions {
        dtype: Some(WeightDtype::Bf16),
        ..ExportOptions::default()
    };
    export_to(&src, &out, options);
    assert_eq!(json(&out.join("config.json"))["torch_dtype"], "bfloat16");
    assert!(stored(&out).iter().all(|(_, d, _)| d == "BF16"));
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), rounded(&params, DType::BF16));
    for ((_, a), (_, b)) in flat(&back).iter().zip(flat(&params)) {
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= y.abs() / 256.0, "{x} vs {y}");
        }
    }
    // A source stored in bf16 exports bf16 by default, with the same bytes.
    let (src16, out16) = (tmp.path().join("src16"), tmp.path().join("out16"));
    hf_dir(&src16, &tiny_llama(false), 3, WeightDtype::Bf16);
    let done = export_to(&src16, &out16, ExportOptions::default());
    assert_eq!(done.dtype, WeightDtype::Bf16, "{}", done.dtype_from);
    assert_eq!(json(&out16.join("config.json"))["torch_dtype"], "bfloat16");
    let a = io::load_safetensors(&src16.join("model.safetensors"), &Device::Cpu).unwrap();
    let b = io::load_safetensors(&out16.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (name, t) in &a.tensors {
        assert_eq!(b.tensors[name].dtype(), DType::BF16);
        assert_eq!(values::<f32>(t), values::<f32>(&b.tensors[name]), "{name}");
    }
}

/// A tiny Llama exported in shards of at most 20 000 bytes: (tmp, source params, export).
fn sharded() -> (tempfile::TempDir, Params, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("sharded"));
    let params = hf_dir(&src, &tiny_llama(false), 4, WeightDtype::F32);
    let options = ExportOptions {
        max_shard_size: 20_000,
        ..ExportOptions::default()
    };
    export_to(&src, &out, options);
    (tmp, params, out)
}

#[test]
fn small_shards_get_an_index_and_load_back() {
    let (tmp, params, out) = sharded();
    assert!(!out.join("model.safetensors").exists());
    let text = fs::read_to_string(out.join(INDEX_FILE)).unwrap();
    assert!(text.ends_with("}\n") && text.contains("\n  \"metadata\": {\n    \"total_size\""));
    let index: Value = serde_json::from_str(&text).unwrap();
    let sizes: Vec<(String, u64)> = params
        .iter()
        .map(|(n, v)| (n.clone(), 4 * v.elem_count() as u64))
        .collect();
    let total: u64 = sizes.iter().map(|(_, b)| b).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    let map = index["weight_map"].as_object().unwrap();
    let names: Vec<&String> = map.keys().collect();
    assert_eq!(names, params.iter().map(|(n, _)| n).collect::<Vec<_>>());
    // huggingface_hub's split, in key order.
    let plan = export::plan_shards(&sizes, 20_000);
    let n = plan.len();
    assert!(n >= 3, "{n} shards");
    for (i, shard) in plan.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let loaded = io::load_safetensors(&out.join(&file), &Device::Cpu).unwrap();
        assert_eq!(loaded.metadata["format"], "pt");
        let mut held: Vec<&String> = loaded.tensors.keys().collect();
        held.sort();
        assert_eq!(held, shard.iter().collect::<Vec<_>>(), "{file}");
        for name in shard {
            assert_eq!(map[name], file.as_str());
        }
        let bytes: u64 = shard
            .iter()
            .map(|s| 4 * params.get(s).unwrap().elem_count() as u64)
            .sum();
        assert!(bytes <= 20_000 || shard.len() == 1, "{file}: {bytes}");
    }
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), flat(&params));
    // The same model from a hub cache (shards as separate files of the snapshot).
    let home = tmp.path().join("home");
    common::hf::hub_cache(&home, "test-org/sharded", &out);
    let cache = hf_hub::Cache::new(home.join("hub"));
    let dir = trainer::load::resolve_in("test-org/sharded", &cache).unwrap();
    let (_, back) = ModelDir::at(dir).unwrap().load(&Device::Cpu).unwrap();
    assert_eq!(flat(&back), flat(&params));
}

#[test]
fn tied_models_write_no_lm_head() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    let params = hf_dir(&src, &tiny_llama(true), 5, WeightDtype::F32);
    // A source that also stores the tied copy (as some checkpoints do) loads too.
    let mut tensors: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let embed = params.tensor("model.embed_tokens.weight").unwrap();
    tensors.push(("lm_head.weight".into(), embed));
    io::save_safetensors(&src.join("model.safetensors"), &tensors, None).unwrap();
    export_to(&src, &out, ExportOptions::default());
    let names: Vec<String> = stored(&out).into_iter().map(|(n, _, _)| n).collect();
    assert!(names.contains(&"model.embed_tokens.weight".to_string()));
    assert!(!names.contains(&"lm_head.weight".to_string()), "{names:?}");
    assert_eq!(json(&out.join("config.json"))["tie_word_embeddings"], true);
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), flat(&params));
}

/// Rewrites the safetensors file `path` through `edit` (keeping the metadata).
fn rewrite(path: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let loaded = io::load_safetensors(path, &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, Tensor)> = loaded.tensors.into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors);
    io::save_safetensors(path, &tensors, Some(loaded.metadata)).unwrap();
}

#[test]
fn broken_shards_are_named() {
    let (_tmp, _, out) = sharded();
    let index_path = out.join(INDEX_FILE);
    let index = json(&index_path);
    let map = index["weight_map"].as_object().unwrap().clone();
    let (name, shard) = map.iter().next().unwrap();
    let shard = shard.as_str().unwrap().to_string();
    let shard_path = out.join(&shard);
    let original = fs::read(&shard_path).unwrap();
    let restore = || fs::write(&shard_path, &original).unwrap();

    // A shard the index names is missing: the index and the shard are named.
    fs::rename(&shard_path, out.join("aside")).unwrap();
    let e = load_err(&out);
    assert!(e.contains(INDEX_FILE) && e.contains(&shard), "{e}");
    fs::rename(out.join("aside"), &shard_path).unwrap();

    // A tensor the index maps to a shard that lacks it.
    rewrite(&shard_path, |t| t.retain(|(n, _)| n != name));
    let e = load_err(&out);
    assert!(e.contains(&shard) && e.contains(name.as_str()), "{e}");
    restore();

    // A tensor in a shard that the index does not list.
    let mut fewer = index.clone();
    fewer["weight_map"].as_object_mut().unwrap().remove(name);
    fs::write(&index_path, fewer.to_string()).unwrap();
    let e = load_err(&out);
    common::assert_mentions(&e, &[&shard, name.as_str(), "not in the index"]);
    fs::write(&index_path, index.to_string()).unwrap();

    // A tensor of the wrong shape: the file, the tensor and both shapes.
    let mut shape = None;
    rewrite(&shard_path, |t| {
        let slot = t.iter_mut().find(|(n, _)| n == name).unwrap();
        shape = Some(slot.1.dims().to_vec());
        let n = slot.1.elem_count();
        slot.1 = Tensor::zeros(n + 2, DType::F32, &Device::Cpu).unwrap();
    });
    let e = load_err(&out);
    let want = shape.unwrap();
    let n: usize = want.iter().product();
    common::assert_mentions(
        &e,
        &[
            &shard,
            name.as_str(),
            &format!("{want:?}"),
            &format!("[{}]", n + 2),
        ],
    );
    restore();

    // Integers where float weights belong.
    rewrite(&shard_path, |t| {
        let slot = t.iter_mut().find(|(n, _)| n == name).unwrap();
        slot.1 = slot.1.to_dtype(DType::I64).unwrap();
    });
    let e = load_err(&out);
    common::assert_mentions(&e, &[&shard, name.as_str(), "I64"]);
    restore();
    load(&out).unwrap();
}

#[test]
fn gpt2_and_trainer_runs_export() {
    let tmp = tempfile::tempdir().unwrap();
    // A GPT-2 model directory with its tokenizer and generation settings.
    let hf = common::hf::hf_model_dir(&tmp.path().join("hf"), 32);
    fs::write(hf.join("generation_config.json"), "{\"eos_token_id\": 9}\n").unwrap();
    let out = tmp.path().join("gpt2");
    let done = export_to(&hf, &out, ExportOptions::default());
    assert_eq!(done.dtype, WeightDtype::F32);
    let cfg = json(&out.join("config.json"));
    assert_eq!(
        (cfg["model_type"].as_str(), cfg["n_positions"].as_u64()),
        (Some("gpt2"), Some(32))
    );
    assert_eq!(cfg["torch_dtype"], "float32");
    assert_same_files(&out, &hf, &["tokenizer.json", "generation_config.json"]);
    let (_, want) = load(&hf).unwrap();
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), flat(&want));

    // A run fine-tuned from it on `tokenizer` data: its own tokenizer and the origin's
    // generation settings; f32 (the origin's dtype).
    let data = tmp.path().join("data");
    let corpus = common::hf::corpus(&data);
    let tok = common::hf::tokenizer(&data);
    let run = tmp.path().join("run");
    let t = fine_tune(&hf, corpus, tok.clone(), 2, &run);
    let out = tmp.path().join("run-export");
    let done = export_to(&run, &out, ExportOptions::default());
    assert_eq!(done.dtype, WeightDtype::F32, "{}", done.dtype_from);
    let copied: Vec<&str> = done.copied.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(copied, ["generation_config.json", "tokenizer.json"]);
    assert_eq!(done.copied[1].1, tok);
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), flat(&t.params));
    assert!(
        !out.join("trainer_state.json").exists() && !out.join("optimizer.safetensors").exists()
    );

    // A run from scratch (addition data: no tokenizer): f32 and its config only.
    let (_tmp2, scratch, t) = common::tiny_run(|c| c.max_iters = 2);
    let out = tmp.path().join("scratch");
    let done = export_to(
        &scratch,
        &out,
        ExportOptions {
            dtype: Some(WeightDtype::F16),
            ..ExportOptions::default()
        },
    );
    assert!(done.copied.is_empty());
    assert_eq!(json(&out.join("config.json"))["torch_dtype"], "float16");
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), rounded(&t.params, DType::F16));
}

#[test]
fn a_run_from_a_bf16_llama_exports_bf16_with_the_origins_files() {
    let (tmp, hf) = common::temp_join("hf");
    hf_dir(&hf, &tiny_llama(true), 6, WeightDtype::Bf16);
    common::hf::tokenizer(&hf);
    fs::write(hf.join("chat_template.jinja"), "{{ messages }}").unwrap();
    let corpus = common::hf::corpus(&tmp.path().join("data"));
    let run = tmp.path().join("run");
    let t = fine_tune(&hf, corpus, hf.join("tokenizer.json"), 1, &run);
    let out = tmp.path().join("out");
    let done = export_to(&run, &out, ExportOptions::default());
    assert_eq!(done.dtype, WeightDtype::Bf16, "{}", done.dtype_from);
    let cfg = json(&out.join("config.json"));
    assert_eq!(
        (cfg["model_type"].as_str(), cfg["torch_dtype"].as_str()),
        (Some("llama"), Some("bfloat16"))
    );
    assert_same_files(&out, &hf, &["tokenizer.json", "chat_template.jinja"]);
    let (_, back) = load(&out).unwrap();
    assert_eq!(flat(&back), rounded(&t.params, DType::BF16));
}

/// Asserts that `dir` holds no hidden (`.`) files: no temporary left by an export.
fn assert_no_hidden_files(dir: &Path) {
    let leftovers: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn the_cli_exports_and_refuses_to_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    hf_dir(&dir.join("src"), &tiny_llama(false), 7, WeightDtype::F32);
    let args = common::words("export src out --dtype bf16 --max-shard-size 20KB");
    let o = run_cli(&args, dir);
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(output_text(&o).contains("bf16"), "{}", output_text(&o));
    assert!(dir.join("out").join(INDEX_FILE).is_file());
    let index = json(&dir.join("out").join(INDEX_FILE));
    for file in index["weight_map"].as_object().unwrap().values() {
        assert!(
            dir.join("out").join(file.as_str().unwrap()).is_file(),
            "{file}"
        );
    }
    let o = run_cli(&args, dir);
    assert!(!o.status.success());
    assert!(output_text(&o).contains("--force"), "{}", output_text(&o));
    let mut forced = args.to_vec();
    forced[4] = "f32";
    forced.push("--force");
    let o = run_cli(&forced, dir);
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(json(&dir.join("out/config.json"))["torch_dtype"], "float32");
    assert_no_hidden_files(dir);
    // Never over its own source.
    let o = run_cli(&["export", "out", "out", "--force"], dir);
    assert!(
        !o.status.success() && output_text(&o).contains("holds the model"),
        "{}",
        output_text(&o)
    );
    let o = run_cli(&["export", "src", "x", "--max-shard-size", "lots"], dir);
    assert!(
        !o.status.success() && output_text(&o).contains("lots"),
        "{}",
        output_text(&o)
    );
}

#[test]
fn sampling_stops_at_any_listed_end_token() {
    let (tmp, dir) = common::temp_join("model");
    let cfg = tiny_llama(false);
    let params = hf_dir(&dir, &cfg, 8, WeightDtype::F32);
    let words: Vec<String> = (0..64).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    trainer::pretrained::word_level(&refs, &[])
        .unwrap()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    // The greedy continuation of `w1 w2`, without end tokens.
    let model = trainer::model::build(&cfg, &params).unwrap();
    let greedy = trainer::sample::SamplingConfig {
        temperature: 0.0,
        ..Default::default()
    };
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
    let full =
        trainer::sample::generate(model.as_ref(), &[1, 2], 12, greedy, &mut rng, &Device::Cpu)
            .unwrap();
    let gen = &full[2..];
    // The first generated id not generated before it, from the third on if there is one.
    let k = (2..gen.len())
        .find(|&j| !gen[..j].contains(&gen[j]))
        .unwrap_or(0);
    let stop = gen[k];
    assert!(
        k + 1 < gen.len(),
        "{gen:?}: stopping there would not be told from the end"
    );
    let unused: Vec<u32> = (0..64).filter(|i| !gen.contains(i)).take(2).collect();
    let sample = || {
        let args = [
            "sample",
            "model",
            "--prompt",
            "w1 w2",
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
        ];
        let o = run_cli(&args, tmp.path());
        assert!(o.status.success(), "{}", output_text(&o));
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .count()
    };
    assert_eq!(sample(), 14, "no end token: all 12 tokens");
    // generation_config.json lists several (instruction-tuned Llama 3 style).
    let list = serde_json::json!({"eos_token_id": [unused[0], stop, unused[1]]});
    fs::write(dir.join("generation_config.json"), list.to_string()).unwrap();
    let md = ModelDir::open(dir.to_str().unwrap()).unwrap();
    assert_eq!(
        md.eos_token_ids(&cfg).unwrap(),
        vec![unused[0], stop, unused[1]]
    );
    assert_eq!(sample(), 2 + k + 1, "stops at {stop} ({gen:?})");
    // Without it, config.json's list.
    fs::remove_file(dir.join("generation_config.json")).unwrap();
    let mut c = json(&dir.join("config.json"));
    c["eos_token_id"] = serde_json::json!([unused[1], stop]);
    fs::write(dir.join("config.json"), c.to_string()).unwrap();
    assert_eq!(sample(), 2 + k + 1);
    // A malformed list is named.
    fs::write(
        dir.join("generation_config.json"),
        "{\"eos_token_id\": [\"x\"]}",
    )
    .unwrap();
    let e = md.eos_token_ids(&cfg).unwrap_err().to_string();
    common::assert_mentions(&e, &["generation_config.json", "eos_token_id"]);
}

/// Mode bits of every file under `dir`, by path.
#[cfg(unix)]
fn modes(dir: &Path) -> Vec<(PathBuf, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        out.push((
            p.clone(),
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
        ));
    }
    out.sort();
    out
}

#[cfg(unix)]
#[test]
fn every_exported_file_gets_the_same_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    hf_dir(&src, &tiny_llama(false), 3, WeightDtype::F32);
    fs::write(src.join("tokenizer_config.json"), "{}").unwrap();
    // The mode any file created here gets (0666 less the umask).
    fs::write(tmp.path().join("plain"), "x").unwrap();
    let plain = modes(tmp.path())
        .into_iter()
        .find(|(p, _)| p.ends_with("plain"))
        .unwrap()
        .1;
    for (out, shard) in [(out.clone(), 0), (tmp.path().join("sharded"), 20_000)] {
        let options = ExportOptions {
            dtype: Some(WeightDtype::Bf16),
            max_shard_size: if shard > 0 {
                shard
            } else {
                export::DEFAULT_MAX_SHARD_SIZE
            },
            ..ExportOptions::default()
        };
        export_to(&src, &out, options);
        let m = modes(&out);
        assert!(
            m.iter()
                .any(|(p, _)| p.ends_with("model.safetensors")
                    || p.to_string_lossy().contains("-of-"))
        );
        assert!(m.iter().all(|(_, mode)| *mode == plain), "{plain:o}: {m:?}");
    }
}

#[cfg(unix)]
#[test]
fn exports_remove_what_killed_exports_left_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    hf_dir(&dir.join("src"), &tiny_llama(false), 7, WeightDtype::F32);
    // A process that has exited, and one that is alive (this test's parent).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let alive = std::os::unix::process::parent_id();
    let stale = [format!(".out.tmp-{dead}"), format!(".out.old-{dead}")];
    let kept = [format!(".out.tmp-{alive}"), format!(".other.tmp-{dead}")];
    for d in stale.iter().chain(&kept) {
        fs::create_dir_all(dir.join(d)).unwrap();
        fs::write(dir.join(d).join("model.safetensors"), vec![0u8; 4096]).unwrap();
    }
    // An empty output: a moved-aside old one is removed only while the output exists.
    fs::create_dir(dir.join("out")).unwrap();
    let o = run_cli(&["export", "src", "out"], dir);
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    for d in &stale {
        assert!(!dir.join(d).exists(), "{d} left: {text}");
        assert!(text.contains(d.as_str()), "{text}");
    }
    for d in &kept {
        assert!(dir.join(d).is_dir(), "{d} removed: {text}");
    }
    assert!(text.contains("no longer alive"), "{text}");
}

#[test]
fn a_cast_that_overflows_is_refused_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    hf_dir(&dir.join("src"), &tiny_llama(false), 7, WeightDtype::F32);
    let big = "model.layers.1.mlp.down_proj.weight";
    rewrite(&dir.join("src/model.safetensors"), |tensors| {
        let (_, t) = tensors.iter_mut().find(|(n, _)| n == big).unwrap();
        let mut v = values::<f32>(t);
        v[3] = -1.0e5;
        *t = Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap();
    });
    let o = run_cli(&["export", "src", "out", "--dtype", "f16"], dir);
    let text = output_text(&o);
    assert!(!o.status.success(), "{text}");
    common::assert_mentions(&text, &[big, "1e5", "65504", "bf16"]);
    assert!(!dir.join("out").exists());
    assert_no_hidden_files(dir);
    // Within the range of bf16, exported.
    let o = run_cli(&["export", "src", "out", "--dtype", "bf16"], dir);
    assert!(o.status.success(), "{}", output_text(&o));
    let o = run_cli(&["export", "src", "out32", "--dtype", "f32"], dir);
    assert!(o.status.success(), "{}", output_text(&o));
}
