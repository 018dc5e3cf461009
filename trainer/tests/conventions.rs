//! Conventions shared with transformers and PEFT: where the hub cache is, how an adapter's
//! relative base is found, what `sample` draws from and how far it goes, how `eval` prints its
//! losses, and that every subcommand's help describes every flag.

mod common;

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Device;
use common::{hf, output_text};
use rand::SeedableRng;
use trainer::load::{Checks, ModelDir};
use trainer::sample::{generate, greedy_batch, SamplingConfig};

/// Runs the `trainer` binary in `cwd` with exactly the hub variables `env` (the others
/// removed, so that the caller's environment does not leak in).
fn run_with(args: &[&str], cwd: &Path, env: &[(&str, &Path)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_trainer"));
    cmd.args(args).current_dir(cwd);
    for v in [
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
    ] {
        cmd.env_remove(v);
    }
    cmd.env("HOME", cwd.join("home"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the trainer binary")
}

#[test]
fn the_hub_cache_is_where_transformers_looks() {
    let env = |vars: &[(&str, &str)]| {
        let vars: Vec<(String, OsString)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        trainer::hub::cache_dir_in(move |name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    };
    let all = [
        ("HOME", "/home/u"),
        ("XDG_CACHE_HOME", "/xdg"),
        ("HF_HOME", "/hf"),
        ("HUGGINGFACE_HUB_CACHE", "/old"),
        ("HF_HUB_CACHE", "/new"),
    ];
    // Each variable wins over those after it (huggingface_hub's constants.py).
    let want = [
        "/new",
        "/old",
        "/hf/hub",
        "/xdg/huggingface/hub",
        "/home/u/.cache/huggingface/hub",
    ];
    for (i, w) in want.iter().enumerate() {
        let set: Vec<(&str, &str)> = all[..all.len() - i].to_vec();
        assert_eq!(env(&set), PathBuf::from(w), "with {set:?}");
    }
    // `~` is the home directory; an empty variable is unset.
    assert_eq!(
        env(&[("HOME", "/h"), ("HF_HUB_CACHE", "~/c")]),
        PathBuf::from("/h/c")
    );
    assert_eq!(
        env(&[("HOME", "/h"), ("HF_HUB_CACHE", ""), ("HF_HOME", "/hf")]),
        PathBuf::from("/hf/hub")
    );

    // The binary finds a model id through HF_HUB_CACHE, then through HUGGINGFACE_HUB_CACHE,
    // whatever HF_HOME says.
    let tmp = tempfile::tempdir().unwrap();
    let src = hf::hf_model_dir(&tmp.path().join("src"), 16);
    let cache = tmp.path().join("elsewhere");
    hf::hub_cache(&cache, "org/tiny", &src);
    let other_home = tmp.path().join("hf-home");
    for var in ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"] {
        let env = [(var, cache.join("hub")), ("HF_HOME", other_home.clone())];
        let env: Vec<(&str, &Path)> = env.iter().map(|(k, v)| (*k, v.as_path())).collect();
        let o = run_with(&["inspect", "org/tiny"], tmp.path(), &env);
        assert!(o.status.success(), "{var}: {}", output_text(&o));
    }
    let env = [("HF_HOME", other_home.as_path())];
    let o = run_with(&["inspect", "org/tiny"], tmp.path(), &env);
    assert!(!o.status.success());
    let text = output_text(&o);
    assert!(text.contains("HF_HUB_CACHE"), "{text}");
}

/// The fixture's PEFT adapter copied to `to`, naming its base `base`.
fn adapter(to: &Path, base: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/adapter_plain");
    fs::create_dir_all(to).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        fs::copy(src.join(f), to.join(f)).unwrap();
    }
    let path = to.join("adapter_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    cfg["base_model_name_or_path"] = base.into();
    fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    to.to_path_buf()
}

/// Copies the fixture's base model to `to`.
fn base_copy(to: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/base");
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// A relative `base_model_name_or_path` is read from the working directory, as
/// `AutoPeftModelForCausalLM.from_pretrained` hands it to transformers; found nowhere, the
/// error names the key and `--init-from`, which then gives the base.
#[test]
fn a_relative_adapter_base_is_read_as_peft_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    base_copy(&root.join("models/base"));
    adapter(&root.join("adapters/a"), "models/base");
    // Beside the adapter, a directory of the same name that PEFT would not look at.
    fs::create_dir_all(root.join("adapters/a/models/base")).unwrap();
    let o = run_with(&["inspect", "adapters/a"], root, &[]);
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("models/base/model.safetensors"), "{text}");
    assert!(!text.contains("adapters/a/models/base"), "{text}");
    fs::remove_dir_all(root.join("adapters/a/models")).unwrap();

    let elsewhere = root.join("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    let o = run_with(&["inspect", "../adapters/a"], &elsewhere, &[]);
    let text = common::refusal_text(&o);
    common::assert_mentions(
        &text,
        &[
            "base_model_name_or_path `models/base`",
            "--init-from",
            "adapter_config.json",
        ],
    );
    let o = run_with(
        &["inspect", "../adapters/a", "--init-from", "../models/base"],
        &elsewhere,
        &[],
    );
    assert!(o.status.success(), "{}", output_text(&o));
    // --init-from names the base of adapters only.
    let o = run_with(
        &["inspect", "../models/base", "--init-from", "../models/base"],
        &elsewhere,
        &[],
    );
    assert!(
        output_text(&o).contains("holds no adapters"),
        "{}",
        output_text(&o)
    );
}

/// A tiny GPT of `vocab` ids under the 10-word tokenizer (its padded embedding), in `dir`.
fn padded_gpt(dir: &Path, vocab: usize) -> PathBuf {
    let cfg = hf::tiny_gpt(64, vocab);
    let (_, params) = trainer::model::gpt2::Gpt::new(&cfg, 3, &Device::Cpu).unwrap();
    trainer::checkpoint::save_model(dir, &cfg, &params).unwrap();
    hf::tokenizer(dir);
    dir.to_path_buf()
}

/// The ids `text` shows as `<id:N>`.
fn marked_ids(text: &str) -> Vec<u32> {
    text.split("<id:")
        .skip(1)
        .map(|s| s[..s.find('>').unwrap()].parse().unwrap())
        .collect()
}

/// Sampling a GPT past its learned positions crops the context as nanoGPT does, and says so
/// (transformers would refuse); within them nothing is said.
#[test]
fn sampling_past_learned_positions_says_the_context_is_cropped() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = padded_gpt(&tmp.path().join("m"), 64);
    let m = dir.to_str().unwrap();
    let sample = |n: &str| {
        let args = ["sample", m, "--prompt-ids", "1,2", "--max-new-tokens", n];
        let o = run_with(&args, tmp.path(), &[]);
        assert!(o.status.success(), "{}", output_text(&o));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let past = sample("80");
    common::assert_mentions(&past, &["64 learned positions", "nanoGPT's crop"]);
    let within = sample("8");
    assert!(!within.contains("positions"), "{within}");
}

/// `sample` draws over the model's whole vocabulary (as transformers), showing ids past the
/// tokenizer as `<id:N>`, unless `--tokenizer-ids-only`; `--prompt-ids` gives the prompt as
/// ids; `--ignore-eos` goes past the end token.
#[test]
fn sample_draws_over_the_whole_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = padded_gpt(&tmp.path().join("m"), 64);
    let model = ModelDir::open(dir.to_str().unwrap())
        .unwrap()
        .load_with(&Checks::default(), &Device::Cpu)
        .unwrap()
        .build()
        .unwrap();
    let greedy = SamplingConfig {
        temperature: 0.0,
        ..SamplingConfig::default()
    };
    let rng = &mut rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let all = generate(model.as_ref(), &[1, 2], 8, greedy, rng, &Device::Cpu).unwrap();
    let past: Vec<u32> = all[2..].iter().copied().filter(|&t| t >= 10).collect();
    assert!(
        !past.is_empty(),
        "the model never picks a padded id: {all:?}"
    );
    let m = dir.to_str().unwrap();
    let args = [
        "sample",
        m,
        "--prompt-ids",
        "1,2",
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
    ];
    let o = run_with(&args, tmp.path(), &[]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(text.starts_with("the cat"), "{text}");
    assert_eq!(marked_ids(&text), past, "{text}");

    let mut only = args.to_vec();
    only.push("--tokenizer-ids-only");
    let o = run_with(&only, tmp.path(), &[]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && marked_ids(&text).is_empty(), "{text}");
    let mut within = SamplingConfig {
        vocab: Some(10),
        ..greedy
    };
    within.top_k = None;
    let words = generate(model.as_ref(), &[1, 2], 8, within, rng, &Device::Cpu).unwrap();

    // The first word generated made the end token: the sample ends there, unless --ignore-eos.
    fs::write(
        dir.join("generation_config.json"),
        format!("{{\"eos_token_id\": {}}}", words[2]),
    )
    .unwrap();
    let count = |extra: &[&str]| {
        let mut a = only.clone();
        a.extend(extra);
        let o = run_with(&a, tmp.path(), &[]);
        assert!(o.status.success(), "{}", output_text(&o));
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .count()
    };
    assert_eq!(count(&[]), 3);
    assert_eq!(count(&["--ignore-eos"]), 10);

    let o = run_with(&["sample", m, "--prompt-ids", "1,64"], tmp.path(), &[]);
    let text = output_text(&o);
    assert!(
        text.contains("id 64 is not below the model's vocab_size 64"),
        "{text}"
    );
}

/// Past its 128 positions, the tiny Llama goes on as transformers' `generate` does (rotary
/// positions extended, the context kept whole): the same greedy tokens, one by one and as a
/// batch; GPT-2's learned positions refuse a batch that would pass them.
#[test]
fn rotary_positions_continue_past_the_trained_context() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let t = candle_core::safetensors::load(
        root.join("sample/llama_past_positions.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids = |name: &str| -> Vec<u32> {
        let v: Vec<i64> = t[name].squeeze(0).unwrap().to_vec1().unwrap();
        v.into_iter().map(|x| x as u32).collect()
    };
    let (prompt, want) = (ids("prompt"), ids("greedy"));
    let model = ModelDir::open(root.join("llama/llama").to_str().unwrap())
        .unwrap()
        .load_with(&Checks::default(), &Device::Cpu)
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(model.config().max_positions(), 128);
    let greedy = SamplingConfig {
        temperature: 0.0,
        ..SamplingConfig::default()
    };
    let rng = &mut rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let new = want.len() - prompt.len();
    let got = generate(model.as_ref(), &prompt, new, greedy, rng, &Device::Cpu).unwrap();
    assert_eq!(got, want);
    let batch = greedy_batch(model.as_ref(), &[prompt], new, &Device::Cpu).unwrap();
    assert_eq!(batch[0], want[want.len() - new..]);

    let gpt = trainer::model::build(
        &hf::tiny_gpt(8, 10),
        &trainer::model::gpt2::Gpt::new(&hf::tiny_gpt(8, 10), 1, &Device::Cpu)
            .unwrap()
            .1,
    )
    .unwrap();
    let e = greedy_batch(gpt.as_ref(), &[vec![1, 2, 3]], 7, &Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("learned positions"), "{e}");
}

/// `eval` prints each loss as the shortest text that reads back as the same f32.
#[test]
fn eval_prints_losses_in_full() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = hf::hf_model_dir(&tmp.path().join("m"), 16);
    let corpus = hf::corpus(tmp.path());
    let o = run_with(
        &[
            "eval",
            dir.to_str().unwrap(),
            "--data-path",
            corpus.to_str().unwrap(),
            "--block-size",
            "8",
            "--eval-iters",
            "2",
        ],
        tmp.path(),
        &[],
    );
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", output_text(&o));
    let model = ModelDir::open(dir.to_str().unwrap()).unwrap();
    let req = trainer::pretrained::EvalRequest {
        data_path: Some(corpus.clone()),
        block_size: Some(8),
        eval_iters: Some(2),
        ..Default::default()
    };
    let e = req.evaluate(&model).unwrap();
    for (name, v) in [("train loss", e.train_loss), ("val loss", e.val_loss)] {
        let line = text.lines().find(|l| l.starts_with(name)).unwrap();
        let shown = line[name.len()..].trim();
        assert_eq!(shown, v.to_string(), "{line}");
        assert_eq!(shown.parse::<f32>().unwrap().to_bits(), v.to_bits());
    }
}

/// Every subcommand's `--help` describes each of its flags, and those taking a data kind list
/// every kind.
#[test]
fn every_subcommand_help_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let help = |args: &[&str]| {
        let o = run_with(args, tmp.path(), &[]);
        assert!(o.status.success(), "{args:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let top = help(&["--help"]);
    let commands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 8, "{commands:?}");
    let kinds = [
        "addition",
        "char",
        "byte",
        "tokenizer",
        "sft",
        "chat-task",
        "shards",
    ];
    for c in &commands {
        let text = help(&[c, "--help"]);
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let flag = l.trim_start();
            if !(flag.starts_with("--") || flag.starts_with("-h")) || l.len() - flag.len() > 6 {
                continue;
            }
            let described = flag.split("  ").filter(|s| !s.trim().is_empty()).count() > 1
                || lines
                    .get(i + 1)
                    .is_some_and(|n| n.len() - n.trim_start().len() > 6 && !n.trim().is_empty());
            assert!(described, "`trainer {c} --help`: {flag} has no description");
        }
        if let Some(i) = lines
            .iter()
            .position(|l| l.trim_start().starts_with("--data <"))
        {
            let entry: String = lines[i + 1..]
                .iter()
                .take_while(|l| !l.trim_start().starts_with('-'))
                .copied()
                .collect();
            for k in kinds {
                assert!(
                    entry.contains(k),
                    "`trainer {c} --help`: --data does not list {k}"
                );
            }
        }
    }
}
