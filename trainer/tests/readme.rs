//! The README's commands run as written: every `trainer ...` (and `cargo run --release -p
//! trainer -- ...`) command of its `sh` blocks, read from README.md itself, runs in README
//! order in a fresh directory and exits 0.
//!
//! What is substituted, and why (everything else runs verbatim):
//!
//! | README | here | why |
//! |---|---|---|
//! | `MODEL` (and `MODEL/...`) | the committed tiny chat Llama `data/chat-base` | SmolLM2-135M is not committed and takes hours on 2 cores |
//! | `notes.txt`, `chats.jsonl`, `corpus/` | small files written under those names, in its vocabulary | the user's own data |
//! | `openai-community/gpt2` | a tiny GPT-2 under that id in a hub cache (`HF_HOME`) | nothing is downloaded |
//! | `--block-size N` above 32 | `--block-size 32` | the stand-in has 48 positions |
//! | `--max-iters N` | `--max-iters 4`; a fresh `train` without it gets `--max-iters 2` | minutes, not hours |
//! | a fresh `train` | `--eval-iters 1 --eval-problems 4 --chat-examples 200` appended where not given | the same |
//! | `step-0000600` | `step-0000004` | the shortened default run's last checkpoint |
//! | `...` ending a `train` (other flags) | `--data sft --data-path chats.jsonl --block-size 32 --out-dir runs/chat-adapter` | a placeholder |
//! | `cargo run --release -p trainer -- ARGS` | `trainer ARGS` | the binary under test |
//! | `export ... --format gguf` | `--gguf-no-tokenizer` appended | the stand-in's WordLevel vocabulary has no GGUF form (refused by name) |
//!
//! Not run: synopses (`[--flag ...]`), `cargo build/test/install` and `mpirun` (MPI builds are
//! checked by `.ci/mpi`).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The commands of README.md's `sh` blocks, continuation lines joined, split into words
/// (shell quoting and `#` comments as `sh` reads them).
fn readme_commands(text: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut block = String::new();
    for line in text.lines() {
        if !in_sh {
            in_sh = line.trim() == "```sh";
            continue;
        }
        if line.trim() == "```" {
            in_sh = false;
            for command in block.replace("\\\n", " ").lines() {
                let words = shlex::split(command)
                    .unwrap_or_else(|| panic!("README: cannot split `{command}`"));
                if !words.is_empty() {
                    commands.push(words);
                }
            }
            block.clear();
            continue;
        }
        block.push_str(line);
        block.push('\n');
    }
    commands
}

/// The arguments of `trainer` for a README command after the substitutions of the module's
/// table, or `None` for a command this test does not run.
fn substitute(words: &[String], model: &str) -> Option<Vec<String>> {
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let args: Vec<&str> = match words.as_slice() {
        ["trainer", rest @ ..] => rest.to_vec(),
        ["cargo", "run", "--release", "-p", "trainer", "--", rest @ ..] => rest.to_vec(),
        ["cargo", ..] | ["mpirun", ..] => return None,
        other => panic!("README: a command this test does not know: {other:?}"),
    };
    if args.iter().any(|a| a.starts_with('[')) {
        return None; // a synopsis
    }
    let mut out: Vec<String> = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(&a) = it.next() {
        match a {
            "MODEL" => out.push(model.to_string()),
            // The placeholder for other flags: the last word of a `train` command.
            "..." if args[0] == "train" && it.peek().is_none() => out.extend(
                [
                    "--data",
                    "sft",
                    "--data-path",
                    "chats.jsonl",
                    "--block-size",
                    "32",
                ]
                .into_iter()
                .chain(["--out-dir", "runs/chat-adapter"])
                .map(String::from),
            ),
            "--block-size" | "--max-iters" => {
                let v = it.next().expect("a value");
                let v = match (a, v.parse::<usize>()) {
                    ("--block-size", Ok(n)) if n > 32 => "32".to_string(),
                    ("--max-iters", _) => "4".to_string(),
                    _ => v.to_string(),
                };
                out.extend([a.to_string(), v]);
            }
            a if a.starts_with("MODEL/") => out.push(a.replacen("MODEL", model, 1)),
            a => out.push(a.replace("step-0000600", "step-0000004")),
        }
    }
    if out[0] == "export" && out.windows(2).any(|w| w[0] == "--format" && w[1] == "gguf") {
        out.push("--gguf-no-tokenizer".to_string());
    }
    if out[0] == "train" && !out.iter().any(|a| a == "--resume") {
        for (flag, value) in [
            ("--max-iters", "2"),
            ("--eval-iters", "1"),
            ("--eval-problems", "4"),
            ("--chat-examples", "200"),
        ] {
            if !out.iter().any(|a| a == flag) {
                out.extend([flag.to_string(), value.to_string()]);
            }
        }
    }
    Some(out)
}

/// The stand-in data, under the names the README uses, in the chat base's vocabulary.
fn write_data(cwd: &Path) {
    let letters: Vec<&str> = "a b c d e f g h i j k l m n o p q r s t u v w x y z"
        .split(' ')
        .collect();
    let text = |i: usize, n: usize| -> String {
        (0..n)
            .map(|j| letters[(i * 7 + j * 3) % letters.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let notes: String = (0..200)
        .map(|i| {
            format!(
                "Write the letter after {} : {}\n",
                text(i, 1),
                text(i + 1, 8)
            )
        })
        .collect();
    fs::write(cwd.join("notes.txt"), notes).unwrap();
    let chats: String = (0..60)
        .map(|i| {
            let q = serde_json::json!({"messages": [
                {"role": "user", "content": format!("Write each letter : {}", text(i, 4))},
                {"role": "assistant", "content": text(i, 4)},
            ]});
            format!("{q}\n")
        })
        .collect();
    fs::write(cwd.join("chats.jsonl"), chats).unwrap();
    fs::create_dir_all(cwd.join("corpus")).unwrap();
    for f in 0..2 {
        let docs: String = (0..200)
            .map(|i| format!("{}\n", serde_json::json!({"text": text(f * 200 + i, 40)})))
            .collect();
        fs::write(cwd.join(format!("corpus/part-{f}.jsonl")), docs).unwrap();
    }
}

#[test]
fn readme_commands_run_as_written() {
    let readme = fs::read_to_string(repo().join("README.md")).unwrap();
    let commands = readme_commands(&readme);
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    for dir in ["configs", "data", "trainer"] {
        std::os::unix::fs::symlink(repo().join(dir), cwd.join(dir)).unwrap();
    }
    write_data(cwd);
    let hf_home = cwd.join("home/hf");
    let gpt2 = common::hf::hf_model_dir(&cwd.join("gpt2-stand-in"), 256);
    common::hf::hub_cache(&hf_home, "openai-community/gpt2", &gpt2);
    let model = repo().join("data/chat-base");
    let model = model.to_str().unwrap();

    let mut ran = 0;
    let mut failed = Vec::new();
    for words in &commands {
        let Some(args) = substitute(words, model) else {
            continue;
        };
        let o = Command::new(env!("CARGO_BIN_EXE_trainer"))
            .args(&args)
            .current_dir(cwd)
            .env("HF_HOME", &hf_home)
            .env("XDG_CACHE_HOME", cwd.join("home/cache"))
            .output()
            .unwrap();
        ran += 1;
        if !o.status.success() {
            failed.push(format!(
                "README: `{}`\nran as: trainer {}\n{}",
                words.join(" "),
                args.join(" "),
                common::output_text(&o)
            ));
        }
    }
    // The README has about 25 commands to run: a parser that finds none passes nothing.
    assert!(ran >= 20, "only {ran} README commands found: {commands:?}");
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
