//! DPO against TRL 1.16's `DPOTrainer` (`tests/fixtures/dpo`, made by
//! `scripts/python/make_dpo_fixtures.py`; versions in its `cases.json`): a tiny Llama over the
//! `llama3` chat-fixture tokenizer, a non-zero LoRA adapter (reference: the base, adapters
//! off) and the same adapter merged for full fine-tuning (reference log-probabilities of the
//! base, computed once before the step, as `precompute_ref_log_probs`).
//!
//! For `sigmoid`, `ipo` and `robust` (label smoothing 0.1), with string, conversational and
//! implicit-prompt records (one record cut by `max_length`, one dropped because its prompt fills
//! it):
//! - the tokenisation equals TRL's (prompt length, chosen and rejected ids), and the dropped
//!   records are counted;
//! - the reference log-probabilities, the loss and the six logged metrics are within 1e-5
//!   relative + 1e-7 absolute (f32 on both sides: sums of up to ~130 log-probabilities over a
//!   325-way softmax in another order, a few ulps each), and the gradient of every trainable
//!   tensor within 1e-4 (max abs difference over max abs value: the backward's f32 sums in
//!   another order; `lora_peft.rs` uses the same bound);
//! - the fixtures catch the reference being the policy itself, prompt tokens counted and the EOS
//!   left off string completions: each moves the loss or `logps/chosen` past the tolerance.
//!
//! Bad records are refused naming `file:line`.
//!
//! A trainer run (`objective = dpo`, `data = preference`, LoRA over the fixture's base): its
//! first step's loss is log 2 (a fresh adapter is the reference), it learns and it resumes
//! bit-exactly; remat gives the plain run's steps bit for bit, bf16 runs, and accumulated
//! micro-batches and two data-parallel ranks give the one-batch run's losses (the step's mean
//! over pairs, and its metrics the means over every rank's pairs) within 1e-5 relative (f32
//! sums in another order), as does a pipeline; a batch that would split a pair and full
//! fine-tuning without a reference are refused. Full fine-tuning
//! with the reference values computed before training (`dpo_precompute_ref`) starts at log 2,
//! learns, keeps the values in the run directory keyed by record, resumes bit-exactly from
//! them, and refuses values computed for another length.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use candle_peft::Adapter;
use common::{load_dir, rel, with_adapter};
use serde_json::Value;
use trainer::config::TrainConfig;
use trainer::data::sft::{
    preference_batch, read_preferences, PreferencePair, Preferences, SftEncoder,
};
use trainer::data::DataKind;
use trainer::model::{run_links, Ctx, Model, Params};
use trainer::objective::{reference_log_probs, Dpo, DpoLoss, HeadOutput, DPO_METRICS};
use trainer::train::run_chain;
use trainer::train::Trainer;

use std::time::Duration;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture("dpo/cases.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

fn encoder() -> SftEncoder {
    SftEncoder::open(&fixture("chat/llama3/tokenizer.json")).unwrap()
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-5 * want.abs() + 1e-7
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// The case's records, tokenised and cut to its `max_length`.
fn pairs(case: &Value) -> Preferences {
    let path = fixture(&format!("dpo/{}.jsonl", case["data"].as_str().unwrap()));
    let records = read_preferences(&path).unwrap();
    let max = case["max_length"].as_u64().unwrap() as usize;
    Preferences::encode(&encoder(), &records, &path, max).unwrap()
}

fn objective(case: &Value) -> Dpo {
    let loss: DpoLoss = case["loss_type"].as_str().unwrap().parse().unwrap();
    let beta = case["beta"].as_f64().unwrap();
    Dpo::new(loss, beta, case["label_smoothing"].as_f64().unwrap()).unwrap()
}

/// The policy, its trainable tensors (by on-disk name) and the reference model (`None`: the
/// policy with its adapters off).
struct Setup {
    policy: Box<dyn Model>,
    trainable: Params,
    reference: Option<Box<dyn Model>>,
}

fn setup(tuning: &str) -> Setup {
    let dev = Device::Cpu;
    let (config, params) = load_dir(&fixture("dpo/base"));
    if tuning == "lora" {
        let adapter = Adapter::load(&fixture("dpo/adapter"), &dev).unwrap();
        let (policy, trainable) = with_adapter(config.as_ref(), &params, &adapter);
        return Setup {
            policy,
            trainable,
            reference: None,
        };
    }
    let reference = trainer::model::build(config.as_ref(), &params).unwrap();
    let (config, merged) = load_dir(&fixture("dpo/merged"));
    let policy = trainer::model::build(config.as_ref(), &merged).unwrap();
    Setup {
        policy,
        trainable: merged,
        reference: Some(reference),
    }
}

/// What we compute for a batch: the reference log-probs, the loss, the metrics and the
/// gradients of the trainable tensors (by name).
struct Ours {
    reference: Vec<f64>,
    loss: f64,
    metrics: Vec<(&'static str, f64)>,
    grads: Vec<(String, Tensor)>,
}

fn run(s: &Setup, dpo: &Dpo, pairs: &[PreferencePair], self_reference: bool) -> Ours {
    let refs: Vec<&PreferencePair> = pairs.iter().collect();
    let block = pairs
        .iter()
        .map(|p| p.chosen.len().max(p.rejected.len()))
        .max()
        .unwrap();
    let batch = preference_batch(&refs, block, 324, &Device::Cpu).unwrap();
    let ctx = Ctx::train(7);
    let reference = match (&s.reference, self_reference) {
        (_, true) => reference_log_probs(s.policy.as_ref(), &batch, &ctx).unwrap(),
        (Some(m), false) => reference_log_probs(m.as_ref(), &batch, &ctx).unwrap(),
        (None, false) => {
            let off = ctx.clone().without_adapters();
            reference_log_probs(s.policy.as_ref(), &batch, &off).unwrap()
        }
    };
    let ctx = ctx.with_reference(Some(reference.clone()));
    // the metrics from the terms of the head's outputs
    let links = s.policy.links();
    let (head, body) = links.split_last().unwrap();
    let targets = batch.targets().unwrap();
    let h = run_links(body, &batch.x, &ctx).unwrap();
    let terms = dpo
        .terms(&HeadOutput::new(head, &h, &targets, &ctx))
        .unwrap();
    let metrics = terms.metrics().unwrap();
    // the loss through the chain, as the executors run it
    let loss = run_chain(&links, &batch.x, &targets, &ctx, None, dpo).unwrap();
    let value = loss.mean.to_scalar::<f32>().unwrap();
    assert_eq!(value, terms.loss.to_scalar::<f32>().unwrap());
    let g = loss.mean.backward().unwrap();
    let grads = s
        .trainable
        .iter()
        .map(|(n, v)| (n.clone(), g.get(v.as_tensor()).unwrap().clone()))
        .collect();
    // pairs of rows -> chosen values then rejected ones, as TRL's batch
    let r = reference.to_vec1::<f32>().unwrap();
    let reference = (0..2)
        .flat_map(|side| r.iter().skip(side).step_by(2).map(|&x| f64::from(x)))
        .collect::<Vec<_>>();
    Ours {
        reference,
        loss: f64::from(value),
        metrics,
        grads,
    }
}

fn grads_of(case: &Value) -> std::collections::HashMap<String, Tensor> {
    let name = case["name"].as_str().unwrap();
    let path = fixture(&format!("dpo/grads.{name}.safetensors"));
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches("grad.").to_string(), v))
        .collect()
}

fn check_case(case: &Value) {
    let name = case["name"].as_str().unwrap();
    let max = case["max_length"].as_u64().unwrap() as usize;
    let p = pairs(case);
    // the tokenisation, cut as TRL's collator cuts it
    let kept = case["kept"].as_array().unwrap();
    assert_eq!(p.pairs.len(), kept.len(), "{name}: kept records");
    assert_eq!(
        p.dropped as u64,
        case["dropped"].as_u64().unwrap(),
        "{name}"
    );
    for (ours, trl) in p.pairs.iter().zip(kept) {
        let prompt = ids(&trl["prompt_ids"]);
        let cut = |side: &str| {
            let mut v = prompt.clone();
            v.extend(ids(&trl[side]));
            v.truncate(max);
            v
        };
        assert_eq!(ours.prompt_len, prompt.len(), "{name}: prompt length");
        assert_eq!(ours.chosen, cut("chosen_ids"), "{name}: chosen ids");
        assert_eq!(ours.rejected, cut("rejected_ids"), "{name}: rejected ids");
    }
    let s = setup(case["tuning"].as_str().unwrap());
    let ours = run(&s, &objective(case), &p.pairs, false);
    let mut want_ref = f64s(&case["ref_chosen_logps"]);
    want_ref.extend(f64s(&case["ref_rejected_logps"]));
    for (got, want) in ours.reference.iter().zip(&want_ref) {
        assert!(close(*got, *want), "{name}: reference {got} vs TRL {want}");
    }
    let want = case["loss"].as_f64().unwrap();
    assert!(
        close(ours.loss, want),
        "{name}: loss {} vs TRL {want}",
        ours.loss
    );
    for (metric, got) in &ours.metrics {
        let want = case["metrics"][metric].as_f64().unwrap();
        assert!(close(*got, want), "{name}: {metric} {got} vs TRL {want}");
    }
    let want = grads_of(case);
    assert_eq!(ours.grads.len(), want.len(), "{name}: trainable tensors");
    for (n, g) in &ours.grads {
        let r = rel(g, &want[n]);
        assert!(
            r <= 1e-4,
            "{name} {n}: gradient differs by {r:e} (relative)"
        );
    }
}

#[test]
fn lora_dpo_equals_trl() {
    for case in cases().iter().filter(|c| c["tuning"] == "lora") {
        check_case(case);
    }
}

#[test]
fn full_fine_tuning_dpo_with_precomputed_reference_equals_trl() {
    let full: Vec<Value> = cases()
        .into_iter()
        .filter(|c| c["tuning"] == "full")
        .collect();
    assert_eq!(full.len(), 3);
    for case in &full {
        check_case(case);
    }
}

#[test]
fn the_fixtures_catch_a_self_reference_counted_prompts_and_a_missing_eos() {
    let all = cases();
    let case = all
        .iter()
        .find(|c| c["name"] == "lora_strings_sigmoid")
        .unwrap();
    let (s, dpo, p) = (setup("lora"), objective(case), pairs(case));
    let want = case["loss"].as_f64().unwrap();
    let want_logps = case["metrics"]["logps/chosen"].as_f64().unwrap();
    // the policy as its own reference: every log-ratio 0, the loss log 2
    let selfref = run(&s, &dpo, &p.pairs, true);
    assert!(
        !close(selfref.loss, want),
        "self reference {}",
        selfref.loss
    );
    // prompt tokens counted (all but the first): the shared prompt cancels in the loss, not in
    // the logged log-probabilities
    let counted: Vec<PreferencePair> = p
        .pairs
        .iter()
        .map(|q| PreferencePair {
            prompt_len: 1,
            ..q.clone()
        })
        .collect();
    let logps = run(&s, &dpo, &counted, false).metrics[4];
    assert_eq!(logps.0, DPO_METRICS[4]);
    assert!(!close(logps.1, want_logps), "prompt counted {}", logps.1);
    // no EOS after the string completions
    let eos = encoder().tokenizer().token_to_id("<|eot_id|>").unwrap();
    let strip = |v: &[u32]| match v.last() {
        Some(&t) if t == eos => v[..v.len() - 1].to_vec(),
        _ => v.to_vec(),
    };
    let no_eos: Vec<PreferencePair> = p
        .pairs
        .iter()
        .map(|q| PreferencePair {
            prompt_len: q.prompt_len,
            chosen: strip(&q.chosen),
            rejected: strip(&q.rejected),
        })
        .collect();
    assert_ne!(no_eos, p.pairs, "the fixture's completions end in EOS");
    let l = run(&s, &dpo, &no_eos, false).loss;
    assert!(!close(l, want), "no EOS {l}");
}

#[test]
fn bad_preference_records_are_named_by_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n\n{\"prompt\": \"a\", \"chosen\": \"b\"}\n",
            ":3",
            "no `rejected`",
        ),
        (
            "{\"chosen\": \"yes\", \"rejected\": \"no\"}\n",
            ":1",
            "implicit prompt",
        ),
        (
            "{\"chosen\": [{\"role\": \"assistant\", \"content\": \"a\"}], \"rejected\": [{\"role\": \"assistant\", \"content\": \"b\"}]}\n",
            ":1",
            "implicit prompt",
        ),
        (
            "{\"prompt\": \"a\", \"chosen\": [{\"role\": \"assistant\", \"content\": \"b\"}], \"rejected\": \"c\"}\n",
            ":1",
            "strings or all lists of messages",
        ),
    ];
    for (i, (text, line, what)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("p{i}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let err = read_preferences(&path).unwrap_err().to_string();
        let at = format!("{}{line}", path.display());
        assert!(err.contains(&at) && err.contains(what), "{err}");
    }
}

/// A LoRA DPO run over the fixture's base on every record of the fixtures (the string one
/// whose prompt fills block_size + 1 = 65 tokens is dropped).
fn run_config(tmp: &Path) -> TrainConfig {
    let data = common::dpo::write_pairs(tmp);
    common::dpo::lora_dpo_config(tmp, DataKind::Preference, &data)
}

#[test]
fn a_lora_dpo_run_starts_at_log_2_learns_and_resumes_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = run_config(tmp.path());
    let (steps, end) = common::finish(Trainer::new(cfg).unwrap());
    // a fresh adapter (B = 0) is its base: every log-ratio 0, the sigmoid loss log 2
    assert!(
        (steps[0].loss - std::f32::consts::LN_2).abs() < 1e-7,
        "first loss {}",
        steps[0].loss
    );
    assert!(
        steps.last().unwrap().loss < steps[0].loss,
        "{:?}",
        steps.iter().map(|s| s.loss).collect::<Vec<_>>()
    );
    // TRL's metrics with every step, in metrics.jsonl too
    let mut names = DPO_METRICS.to_vec();
    names.sort_unstable();
    for s in &steps {
        let got: Vec<&str> = s.objective.keys().map(String::as_str).collect();
        assert_eq!(got, names, "step {}", s.step);
    }
    assert_eq!(steps[0].objective["rewards/margins"], 0.0);
    assert!(steps.last().unwrap().objective["rewards/margins"] > 0.0);
    let log = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl")).unwrap();
    assert!(log.contains("\"rewards/accuracies\""), "{log}");
    let tmp2 = tempfile::tempdir().unwrap();
    let half = TrainConfig {
        max_iters: 3,
        ..run_config(tmp2.path())
    };
    let (resumed, t) = common::split_run(half, 6);
    common::assert_same_steps(&steps, &resumed, "DPO resume");
    assert_eq!(end, common::weights(&t), "the same adapters after resuming");
}

#[test]
fn dpo_refuses_batches_that_split_pairs_and_full_fine_tuning_without_a_reference() {
    let odd = |c: &mut TrainConfig| c.batch_size = 3;
    let full = |c: &mut TrainConfig| c.lora_r = 0;
    for (change, want) in [
        (&odd as &dyn Fn(&mut TrainConfig), "keeps 2 rows together"),
        (&full, "reference"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = run_config(tmp.path());
        change(&mut cfg);
        let e = match Trainer::new(cfg) {
            Ok(mut t) => t.train_step().unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "{e}");
    }
}

fn losses(steps: &[trainer::metrics::StepStats]) -> Vec<f32> {
    steps.iter().map(|s| s.loss).collect()
}

fn assert_close_losses(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{what}: {a:?} vs {b:?}");
    }
}

#[test]
fn dpo_runs_under_remat_bf16_accumulation_and_data_parallel_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |name: &str, set: fn(&mut TrainConfig)| {
        let mut c = TrainConfig {
            max_iters: 3,
            lr_decay_iters: Some(3),
            eval_interval: 3,
            ..run_config(&tmp.path().join(name))
        };
        set(&mut c);
        c
    };
    let run = |name: &str, set: fn(&mut TrainConfig)| {
        common::finish(Trainer::new(cfg(name, set)).unwrap())
    };
    let plain = run("plain", |_| {});
    let remat = run("remat", |c| c.remat = "every:1".parse().unwrap());
    common::assert_same_steps(&plain.0, &remat.0, "remat");
    assert!(plain.1 == remat.1, "remat: the same adapters");
    let bf16 = run("bf16", |c| c.dtype = "bf16".parse().unwrap());
    assert_eq!(bf16.0[0].loss, std::f32::consts::LN_2);
    assert!(bf16.0.iter().all(|s| s.loss.is_finite()));
    let accum = run("accum", |c| {
        c.batch_size = 2;
        c.grad_accum = 2;
    });
    assert_close_losses(&losses(&accum.0), &losses(&plain.0), "accumulation");
    let ranks_cfg = cfg("ranks", |c| c.batch_size = 2);
    let ranks = candle_comm::run_threads(2, Duration::from_secs(120), move |comm| {
        let t = Trainer::new(ranks_cfg.clone())
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap();
        common::finish(t)
    });
    let ranks: Vec<_> = ranks
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")).0)
        .collect();
    for steps in &ranks {
        assert_close_losses(&losses(steps), &losses(&plain.0), "two ranks");
        // the metrics are the means over both ranks' pairs: the one-batch run's
        for (s, p) in steps.iter().zip(&plain.0) {
            let (got, want) = (s.objective["logps/chosen"], p.objective["logps/chosen"]);
            assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
        }
    }
    for (a, b) in ranks[0].iter().zip(&ranks[1]) {
        assert_eq!(a.objective, b.objective, "step {}", a.step);
    }
    // a pipeline of 2 stages, a pair a microbatch: each microbatch's loss reads its rows'
    // reference values
    let piped = run("pipe", |c| {
        c.pipeline_stages = 2;
        c.microbatches = 2;
    });
    assert_close_losses(&losses(&piped.0), &losses(&plain.0), "pipeline");
    for (s, p) in piped.0.iter().zip(&plain.0) {
        let (got, want) = (s.objective["logps/chosen"], p.objective["logps/chosen"]);
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "pipeline: {got} vs {want}"
        );
    }
}

#[test]
fn full_fine_tuning_with_precomputed_reference_values_resumes_bit_exactly() {
    let cfg = |dir: &Path, iters: usize| TrainConfig {
        lora_r: 0,
        dpo_precompute_ref: true,
        lr: 5e-3,
        max_iters: iters,
        ..run_config(dir)
    };
    let tmp = tempfile::tempdir().unwrap();
    let (steps, end) = common::finish(Trainer::new(cfg(tmp.path(), 6)).unwrap());
    // the reference is the initial model (computed a pair at a time: the same sums of other
    // batch shapes, a few ulps)
    assert!(
        (steps[0].loss - std::f32::consts::LN_2).abs() < 1e-6,
        "first loss {}",
        steps[0].loss
    );
    assert!(steps.last().unwrap().loss < steps[0].loss);
    let file = tmp.path().join("run/dpo_reference.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let lines: Vec<u64> = doc["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["line"].as_u64().unwrap())
        .collect();
    assert_eq!(
        lines,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        "every record, by line"
    );
    let tmp2 = tempfile::tempdir().unwrap();
    let run = tmp2.path().join("run");
    let (resumed, t) = common::split_run(cfg(tmp2.path(), 3), 6);
    common::assert_same_steps(&steps, &resumed, "DPO resume with precomputed reference");
    assert_eq!(end, common::weights(&t), "the same weights after resuming");
    // values for another length are refused, naming the file
    let path = run.join("dpo_reference.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("\"block_size\": 64", "\"block_size\": 32"),
    )
    .unwrap();
    let ckpt = run.join("checkpoints/step-0000003");
    let e = match Trainer::resume(&ckpt, |c| c.out_dir = tmp2.path().join("run")) {
        Ok(mut t) => t.train_step().unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    common::assert_mentions(&e, &["dpo_reference.json", "block_size 32"]);
}
