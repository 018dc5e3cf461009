//! No poisoned state: non-finite options are refused, a checkpoint with NaN/Inf is never
//! saved, NaN/Inf or non-float tensors in a loaded checkpoint are errors naming the file and
//! tensor, a `config.json` that disagrees with its run is an error, and changed data or a
//! changed vocabulary is caught by the run's data fingerprint.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::{run_cli, snapshot, tiny_config, tiny_run, train, values};
use rand::{Rng, SeedableRng};
use trainer::checkpoint::io;
use trainer::config::TrainConfig;
use trainer::pretrained::{EvalRequest, ModelDir};
use trainer::train::Trainer;

/// The error of evaluating the run in `dir` as its run evaluates itself.
fn eval_err(dir: &Path) -> String {
    let model = ModelDir::open(dir.to_str().unwrap()).unwrap();
    let r = EvalRequest::default().evaluate(&model);
    r.err().unwrap().to_string()
}

fn resume_err(dir: &Path) -> String {
    match Trainer::resume(dir, |_| {}) {
        Ok(_) => panic!("resuming {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// `t` with `value` written at a random flat index other than 0 (Candle's `max_all` happens to
/// see a NaN at index 0, so that is where a careless check would still pass).
fn poisoned(t: &Tensor, value: f32, rng: &mut impl Rng) -> (Tensor, usize) {
    let mut v: Vec<f32> = values(t);
    let i = rng.random_range(1..v.len());
    v[i] = value;
    let out = Tensor::from_vec(v, t.dims(), t.device())
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap();
    (out, i)
}

/// Rewrites one tensor of a safetensors file, keeping the others and the metadata.
fn rewrite(path: &Path, name: &str, f: impl FnOnce(&Tensor) -> Tensor) {
    let loaded = io::load_safetensors(path, &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, Tensor)> = loaded.tensors.into_iter().collect();
    let slot = tensors.iter_mut().find(|(n, _)| n == name).unwrap();
    slot.1 = f(&slot.1);
    let meta: HashMap<String, String> = loaded.metadata;
    io::save_safetensors(path, &tensors, Some(meta)).unwrap();
}

fn checkpoint_of(run: &Path, step: usize) -> PathBuf {
    run.join(format!("checkpoints/step-{step:07}"))
}

#[test]
fn non_finite_options_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_config(&tmp.path().join("run"));
    type Set = fn(&mut TrainConfig, f64);
    let fields: [(&str, Set); 9] = [
        ("weight_decay", |c, v| c.weight_decay = v),
        ("grad_clip", |c, v| c.grad_clip = v as f32),
        ("lr", |c, v| c.lr = v),
        ("min_lr", |c, v| c.min_lr = v),
        ("beta1", |c, v| c.beta1 = v),
        ("beta2", |c, v| c.beta2 = v),
        ("dropout", |c, v| c.dropout = v as f32),
        ("val_fraction", |c, v| c.val_fraction = v as f32),
        ("peak_flops", |c, v| c.peak_flops = v),
    ];
    for (name, set) in fields {
        for v in [f64::NAN, f64::INFINITY] {
            let mut cfg = base.clone();
            set(&mut cfg, v);
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{name} = {v}: {e}");
        }
    }
}

#[test]
fn a_non_finite_checkpoint_is_never_saved() {
    let (_tmp, dir, mut t) = tiny_run(|c| c.max_iters = 4);
    let before = snapshot(&dir.join("checkpoints"));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let name = "transformer.h.1.mlp.c_fc.weight";
    let var = t.params.get(name).unwrap().clone();
    let (bad, _) = poisoned(var.as_tensor(), f32::NAN, &mut rng);
    var.set(&bad).unwrap();
    let e = t.save_checkpoint().unwrap_err().to_string();
    assert!(e.contains(name) && e.contains("NaN"), "{e}");
    assert_eq!(
        snapshot(&dir.join("checkpoints")),
        before,
        "a refused save changed the checkpoints"
    );
}

#[test]
fn non_finite_or_non_float_tensors_in_a_checkpoint_are_named() {
    let (_tmp, dir, _) = tiny_run(|c| c.max_iters = 4);
    let ck = checkpoint_of(&dir, 4);
    let model = ck.join("model.safetensors");
    let optim = ck.join("optimizer.safetensors");
    let pristine = (fs::read(&model).unwrap(), fs::read(&optim).unwrap());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let cases: [(&Path, &str, f32); 3] = [
        (&model, "transformer.h.0.attn.c_attn.weight", f32::NAN),
        (&model, "transformer.wpe.weight", f32::INFINITY),
        (
            &optim,
            "transformer.h.1.mlp.c_proj.weight.exp_avg_sq",
            f32::NAN,
        ),
    ];
    for (file, name, value) in cases {
        rewrite(file, name, |t| poisoned(t, value, &mut rng).0);
        let e = resume_err(&dir);
        let file_name = file.file_name().unwrap().to_string_lossy();
        assert!(
            e.contains(file_name.as_ref()) && e.contains(name),
            "{name}: {e}"
        );
        fs::write(&model, &pristine.0).unwrap();
        fs::write(&optim, &pristine.1).unwrap();
    }
    // A u8 tensor where an f32 weight belongs (same shape) is an error, not zeros or 0..255.
    let name = "transformer.h.0.ln_1.weight";
    rewrite(&model, name, |t| t.to_dtype(DType::U8).unwrap());
    let e = resume_err(&dir);
    assert!(e.contains(name) && e.contains("U8"), "{e}");
    fs::write(&model, &pristine.0).unwrap();
    Trainer::resume(&dir, |_| {}).unwrap();
}

#[test]
fn a_config_json_that_disagrees_with_the_run_is_refused() {
    let (_tmp, dir, _) = tiny_run(|c| c.max_iters = 4);
    let path = checkpoint_of(&dir, 4).join("config.json");
    let text = fs::read_to_string(&path).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Same parameter shapes (32 = 4 x 8 = 2 x 16), different model.
    json["n_head"] = 4.into();
    fs::write(&path, json.to_string()).unwrap();
    let e = resume_err(&dir);
    assert!(e.contains("config.json") && e.contains("n_head"), "{e}");
}

fn corpus(extra: &str) -> String {
    let mut s = String::new();
    for i in 0..120 {
        s.push_str(&format!("line {i}: the quick brown fox jumps.\n"));
    }
    s.push_str(extra);
    s
}

#[test]
fn changed_data_or_vocabulary_is_caught_by_the_fingerprint() {
    let (tmp, data) = common::temp_join("corpus.txt");
    fs::write(&data, corpus("")).unwrap();
    let dir = tmp.path().join("run");
    train(TrainConfig {
        data: "char".parse().unwrap(),
        data_path: Some(data.clone()),
        max_iters: 4,
        ..tiny_config(&dir)
    });
    Trainer::resume(&dir, |_| {}).unwrap();

    // Same characters, different text: the token stream changed. Resume and eval (of the
    // run's own data) refuse it; eval of text given explicitly measures that text.
    fs::write(&data, corpus("fox quick the")).unwrap();
    let e = resume_err(&dir);
    assert!(e.contains("corpus") && e.contains("--init-from"), "{e}");
    let e = eval_err(&dir);
    assert!(e.contains("corpus"), "{e}");
    let model = ModelDir::open(dir.to_str().unwrap()).unwrap();
    let other = EvalRequest {
        data_path: Some(data.clone()),
        ..EvalRequest::default()
    };
    assert!(other.evaluate(&model).unwrap().val_loss.is_finite());

    // A new character: every id after it shifts.
    fs::write(&data, corpus("Zebra!")).unwrap();
    let e = resume_err(&dir);
    assert!(e.contains("vocabulary"), "{e}");
    let run = dir.to_str().unwrap();
    for args in [
        &["sample", run, "--max-new-tokens", "5"][..],
        &["eval", run],
    ] {
        let out = run_cli(args, tmp.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("vocabulary"), "{err}");
    }

    fs::write(&data, corpus("")).unwrap();
    Trainer::resume(&dir, |_| {}).unwrap();
}

#[test]
fn a_config_json_that_disagrees_with_its_run_is_refused_by_eval_and_inspect() {
    let (tmp, dir, _) = tiny_run(|_| {});
    let ckpt = trainer::checkpoint::resolve(&dir).unwrap();
    let cfg = ckpt.join("config.json");
    let text = fs::read_to_string(&cfg).unwrap();
    // 4 heads instead of the run's 2: the weights still fit config.json (same shapes), so
    // only the run's recorded state can tell that this is another model.
    let edited = text.replace("\"n_head\": 2", "\"n_head\": 4");
    assert_ne!(edited, text);
    fs::write(&cfg, edited).unwrap();
    let e = eval_err(&dir);
    assert!(e.contains("config.json") && e.contains("n_head 4"), "{e}");
    let out = run_cli(&["inspect", ckpt.to_str().unwrap()], tmp.path());
    let text = common::output_text(&out);
    assert!(!out.status.success(), "{text}");
    common::assert_mentions(&text, &["config.json", "disagrees"]);
}
