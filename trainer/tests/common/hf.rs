//! Hugging Face-style fixtures built by the tests themselves (nothing is downloaded): a tiny
//! word-level `tokenizer.json`, a corpus in its words, model directories (`config.json` +
//! `model.safetensors` + `tokenizer.json`) and a local hub cache.

use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Device;
use trainer::checkpoint;
use trainer::model::gpt2::{Gpt, GptConfig};

/// The tiny vocabulary: ids 0..=9, with GPT-2's `<|endoftext|>` as the last one (id 9), so a
/// config that still says 50256 is caught.
pub const WORDS: [&str; 10] = [
    "<unk>",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "a",
    "dog",
    ".",
    "<|endoftext|>",
];

/// Id of `<|endoftext|>` in [`WORDS`].
pub const ENDOFTEXT: u32 = 9;

/// Writes a word-level `tokenizer.json` over [`WORDS`] into `dir` (whitespace pre-tokenizer,
/// `<|endoftext|>` an added special token) and returns its path.
pub fn tokenizer(dir: &Path) -> PathBuf {
    let tok = trainer::pretrained::word_level(&WORDS, &["<|endoftext|>"]).unwrap();
    fs::create_dir_all(dir).unwrap();
    let p = dir.join("tokenizer.json");
    tok.save(&p, false).unwrap();
    p
}

/// A corpus of ~600 words of the tiny vocabulary.
pub fn corpus(dir: &Path) -> PathBuf {
    let sentences = [
        "the cat sat on the mat .",
        "a dog sat on a mat .",
        "the dog sat on the cat .",
    ];
    let mut text = String::new();
    for i in 0..100 {
        text.push_str(sentences[i % 3]);
        text.push(if i % 5 == 4 { '\n' } else { ' ' });
    }
    fs::create_dir_all(dir).unwrap();
    let p = dir.join("corpus.txt");
    fs::write(&p, text).unwrap();
    p
}

/// A tiny GPT with `n_positions` learned positions over a vocabulary of `vocab_size` ids.
pub fn tiny_gpt(n_positions: usize, vocab_size: usize) -> GptConfig {
    let mut cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: n_positions,
        vocab_size,
        ..GptConfig::default()
    };
    cfg.dropout = 0.0;
    cfg
}

/// A Hugging Face model directory: `config.json` + `model.safetensors` of a fresh tiny GPT
/// (seed 7) and the tiny `tokenizer.json`.
pub fn hf_model_dir(dir: &Path, n_positions: usize) -> PathBuf {
    let cfg = tiny_gpt(n_positions, WORDS.len());
    let (_, params) = Gpt::new(&cfg, 7, &Device::Cpu).unwrap();
    checkpoint::save_model(dir, &cfg, &params).unwrap();
    tokenizer(dir);
    dir.to_path_buf()
}

/// Copies the files of model directory `src` into a hub cache under `hf_home/hub` as model
/// `id` (`models--org--name/snapshots/<commit>/`, `refs/main`); returns the snapshot directory.
pub fn hub_cache(hf_home: &Path, id: &str, src: &Path) -> PathBuf {
    let repo = hf_home
        .join("hub")
        .join(format!("models--{}", id.replace('/', "--")));
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snap = repo.join("snapshots").join(commit);
    fs::create_dir_all(&snap).unwrap();
    for e in fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            fs::copy(&p, snap.join(p.file_name().unwrap())).unwrap();
        }
    }
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), commit).unwrap();
    snap
}

/// The `config.json` of checkpoint or model directory `dir`.
pub fn config_json(dir: &Path) -> serde_json::Value {
    super::read_json(&dir.join("config.json"))
}
