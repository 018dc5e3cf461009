//! What a newcomer sees: numbers written as typed, honest MFU, plain logs off a terminal,
//! progress with an ETA, `sample` streaming and stopping when its reader goes away, and a
//! tokenizer that is not the run's refused.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{hf, output_text, run_cli};
use trainer::config::TrainConfig;
use trainer::data::DataKind;
use trainer::mfu::{flops_per_token, training_flops_per_token, Ceiling};
use trainer::model::gpt2::GptConfig;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// f32 options are written as typed (`0.1`), not widened (`0.10000000149011612`), by every
/// writer: the config's TOML (`run.toml`, `--print-config`, `inspect`) and JSON
/// (`trainer_state.json`), and PEFT's `adapter_config.json`.
#[test]
fn f32_options_are_written_as_their_shortest_decimal() {
    let cfg = TrainConfig {
        dropout: 0.1,
        lora_dropout: 0.05,
        val_fraction: 0.3,
        ..TrainConfig::default()
    };
    let toml = cfg.to_toml();
    for line in [
        "dropout = 0.1\n",
        "lora_dropout = 0.05\n",
        "val_fraction = 0.3\n",
    ] {
        assert!(toml.contains(line), "no `{}` in\n{toml}", line.trim());
    }
    let back: TrainConfig = toml::from_str(&toml).unwrap();
    assert_eq!(back, cfg, "the TOML reads back to the same config");
    let json = serde_json::to_string(&cfg).unwrap();
    assert!(json.contains("\"dropout\":0.1,"), "{json}");
    let peft = candle_peft::LoraConfig::new(8, 16.0)
        .with_dropout(0.05)
        .to_peft_json()
        .to_string();
    assert!(peft.contains("\"lora_dropout\":0.05,"), "{peft}");
}

/// LoRA's frozen base has no weight gradient: 4 FLOPs a token per frozen weight, 6 per adapter
/// or saved-module weight, attention as for full training.
#[test]
fn lora_flops_count_frozen_weights_four_times() {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: 100,
        ..GptConfig::default()
    };
    let full = training_flops_per_token(&cfg, 32, None);
    assert_eq!(full, flops_per_token(&cfg, 32));
    let n = flops_per_token(&cfg, 0) / 6.0;
    let attention = full - 6.0 * n;
    assert!(attention > 0.0);
    let lora = training_flops_per_token(&cfg, 32, Some((1000, 0)));
    assert!((lora - (4.0 * n + 6.0 * 1000.0 + attention)).abs() < 1e-6 * full);
    // A saved module (say the 6400-weight head) trains in place of its frozen original.
    let saved = training_flops_per_token(&cfg, 32, Some((1000, 6400)));
    let expected = 4.0 * (n - 6400.0) + 6.0 * (1000.0 + 6400.0) + attention;
    assert!((saved - expected).abs() < 1e-6 * full);
    assert!(lora < full);
}

/// The ceiling rises to any rate a step reached: MFU never exceeds 100%, whatever the
/// start-up measurement read.
#[test]
fn mfu_never_exceeds_one_against_a_low_ceiling() {
    let mut c = Ceiling::new(1e9, false);
    assert_eq!(c.utilisation(5e8), 0.5);
    assert_eq!(c.utilisation(2e9), 1.0);
    assert_eq!(c.flops, 2e9);
    assert!(c.raised);
    assert_eq!(c.utilisation(1e9), 0.5);
}

/// A LoRA run off a terminal: the banner gives the model's total and trainable parameters,
/// progress lines carry an ETA, the log has no colour codes, and against a `--peak-flops` far
/// below what a step reaches the MFU stays at most 100%.
#[test]
fn lora_run_off_a_terminal_reports_honestly() {
    let (tmp, run) = common::temp_join("run");
    let (config, base) = (
        repo().join("configs/lora_chat.toml"),
        repo().join("data/chat-base"),
    );
    let o = run_cli(
        &[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--init-from",
            base.to_str().unwrap(),
            "--out-dir",
            run.to_str().unwrap(),
            "--max-iters",
            "2",
            "--chat-examples",
            "200",
            "--eval-interval",
            "1000",
            "--eval-problems",
            "4",
            "--eval-iters",
            "1",
            "--batch-size",
            "4",
            "--peak-flops",
            "1000",
        ],
        tmp.path(),
    );
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("0.86M parameters, 0.0"),
        "the banner gives total and trainable parameters:\n{text}"
    );
    assert!(text.contains("ETA"), "no ETA off a terminal:\n{text}");
    assert!(!text.contains('\x1b'), "colour codes in a pipe:\n{text}");
    let mfu: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MFU"))
        .and_then(|l| l.trim().split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no MFU line:\n{text}"));
    assert!(mfu <= 100.0, "MFU {mfu}%:\n{text}");
}

/// `sample` of a bf16 model (data/chat-base) with stderr in a pipe: no colour codes, and no
/// word of training.
#[test]
fn sample_logs_are_plain_and_say_nothing_of_training() {
    let tmp = tempfile::tempdir().unwrap();
    let base = repo().join("data/chat-base");
    let o = run_cli(
        &[
            "sample",
            base.to_str().unwrap(),
            "--prompt",
            "a",
            "--max-new-tokens",
            "2",
        ],
        tmp.path(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(err.contains("BF16"), "the cast is reported: {err}");
    assert!(!err.contains('\x1b'), "colour codes in a pipe: {err:?}");
    assert!(!err.contains("training"), "`sample` trains nothing: {err}");
}

/// A run trained on the tiny word-level tokenizer, in `tmp/run`; the tokenizer's path.
fn tokenizer_run(tmp: &Path) -> (PathBuf, PathBuf) {
    let tok = hf::tokenizer(&tmp.join("tok"));
    let corpus = hf::corpus(tmp);
    let (_t, run, _trainer) = common::tiny_run(|c| {
        c.data = DataKind::Tokenizer;
        c.data_path = Some(corpus.clone());
        c.tokenizer_path = Some(tok.clone());
        c.max_iters = 2;
        c.lr_decay_iters = Some(2);
    });
    let kept = tmp.join("run");
    copy_dir(&run, &kept);
    (kept, tok)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

/// `sample RUN --tokenizer-path T`: a tokenizer whose vocabulary is not the run's (the same
/// words in another order, or fewer of them) is refused naming it and the run; the run's own
/// is accepted.
#[test]
fn sample_refuses_a_tokenizer_that_is_not_the_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, tok) = tokenizer_run(tmp.path());
    let mut shuffled: Vec<&str> = hf::WORDS.to_vec();
    shuffled.swap(0, 1);
    let shrunk = &hf::WORDS[..hf::WORDS.len() - 1];
    let sample = |tok: &Path| {
        let (run, tok) = (run.to_str().unwrap(), tok.to_str().unwrap());
        let args = [
            "sample",
            run,
            "--tokenizer-path",
            tok,
            "--max-new-tokens",
            "3",
        ];
        run_cli(&args, tmp.path())
    };
    for (name, words) in [("shuffled", &shuffled[..]), ("shrunk", shrunk)] {
        let t = trainer::pretrained::word_level(words, &["<|endoftext|>"]).unwrap();
        let path = tmp.path().join(format!("{name}.json"));
        t.save(&path, false).unwrap();
        let o = sample(&path);
        let text = output_text(&o);
        assert!(!o.status.success(), "{name} tokenizer accepted:\n{text}");
        assert!(
            text.contains(&format!("{name}.json")) && text.contains("not the vocabulary"),
            "{name}: {text}"
        );
    }
    let o = sample(&tok);
    assert!(o.status.success(), "{}", output_text(&o));
}

/// `trainer sample ... | head -c 20`: once the reader has gone, sampling stops (it streams its
/// output and ends at the first write that fails) instead of generating every token asked for.
#[test]
fn sample_stops_when_stdout_closes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = hf::hf_model_dir(&tmp.path().join("model"), 16);
    let mut child = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args([
            "sample",
            model.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "100000000",
            "--temperature",
            "1",
        ])
        .current_dir(tmp.path())
        .env("HF_HOME", tmp.path().join("hf"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    // Read a little in a thread (the old binary writes nothing until the end), then hang up.
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 20];
        let n = out.read(&mut buf).unwrap_or(0);
        drop(out);
        n
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = reader.join().unwrap();
    assert!(read > 0, "nothing streamed");
    assert!(
        status.is_some(),
        "still generating 60 s after stdout closed"
    );
}

/// `sample --chat`: the prompt is a user message in the model's chat template (data/chat-base:
/// ChatML from its tokenizer_config.json) with the generation prompt; the reply alone is
/// printed and ends at the template's end of turn (`<|im_end|>`). The base answers the
/// questions it was pretrained on.
#[test]
fn sample_chat_applies_the_models_template() {
    let tmp = tempfile::tempdir().unwrap();
    let base = repo().join("data/chat-base");
    let ask = |question: &str, extra: &[&str]| {
        let mut args = vec![
            "sample",
            base.to_str().unwrap(),
            "--chat",
            "--prompt",
            question,
            "--temperature",
            "0",
        ];
        args.extend(extra);
        let o = run_cli(&args, tmp.path());
        assert!(o.status.success(), "{}", output_text(&o));
        String::from_utf8(o.stdout).unwrap()
    };
    assert_eq!(ask("Write each letter : c a d b", &[]), "c a d b\n");
    assert_eq!(ask("Write the letter after c", &[]), "d\n");
    assert_eq!(ask("Write the letter before c", &[]), "b\n");
    // A system message goes first; the reply still ends at the end of the turn, alone.
    let reply = ask("Write the letter after c", &["--system", "a"]);
    assert!(!reply.contains("<|im"), "{reply:?}");
    // Without --chat the same text is continued as it is (no template, no reply cut).
    let o = run_cli(
        &[
            "sample",
            base.to_str().unwrap(),
            "--prompt",
            "Write the letter after c",
            "--temperature",
            "0",
            "--max-new-tokens",
            "3",
        ],
        tmp.path(),
    );
    let plain = String::from_utf8(o.stdout).unwrap();
    assert!(plain.starts_with("Write the letter after c"), "{plain:?}");
}

/// `prepare` reports the end-of-text id as a number (`eos 39`), not `eos Some(39)`.
#[test]
fn prepare_reports_eos_as_a_number() {
    let (tmp, corpus) = common::temp_join("corpus.txt");
    std::fs::write(&corpus, "Write the letter after c\n".repeat(50)).unwrap();
    let tok = repo().join("data/chat-base/tokenizer.json");
    let out = tmp.path().join("shards");
    let o = run_cli(
        &[
            "prepare",
            corpus.to_str().unwrap(),
            "--out-dir",
            out.to_str().unwrap(),
            "--tokenizer",
            tok.to_str().unwrap(),
        ],
        tmp.path(),
    );
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains(", eos 39)"), "{text}");
}

/// `sample` prints as it generates, a few tokens' text at a time: what it prints is exactly
/// the decoded sample, also when characters span several tokens (bytes of `é`, `✓`).
#[test]
fn sample_streams_exactly_the_decoded_sample() {
    let (tmp, corpus) = common::temp_join("corpus.txt");
    std::fs::write(&corpus, "éè✓".repeat(300)).unwrap();
    let (_t, run, t) = common::tiny_run(|c| {
        c.data = DataKind::Byte;
        c.data_path = Some(corpus.clone());
        c.max_iters = 60;
        c.lr_decay_iters = Some(60);
        c.eval_interval = 60;
        c.lr = 1e-2;
    });
    let greedy = trainer::sample::SamplingConfig {
        temperature: 0.0,
        vocab: Some(t.data.vocab_size()),
        ..Default::default()
    };
    let prompt = t.data.encode("é").unwrap();
    let mut rng = rand::SeedableRng::seed_from_u64(0);
    let tokens = trainer::sample::generate(
        t.model.as_ref(),
        &prompt,
        60,
        greedy,
        &mut rng,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let expected = t.data.decode(&tokens).unwrap();
    let o = run_cli(
        &[
            "sample",
            run.to_str().unwrap(),
            "--prompt",
            "é",
            "--temperature",
            "0",
            "--max-new-tokens",
            "60",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{expected}\n"));
}
