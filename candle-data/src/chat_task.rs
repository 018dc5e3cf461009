//! Generated chat tasks on letter strings ([`DataKind::ChatTask`](super::DataKind::ChatTask)):
//! supervised fine-tuning data that needs no download, trained through the same path as
//! `sft` data (records rendered with the model directory's chat template, loss on the
//! assistant's tokens, packing), with a held-out exact-match [`Task`].
//!
//! Two tasks share one small word-level vocabulary ([`write_tokenizer`]: the letters `a`-`z`,
//! a few words and the ChatML tokens):
//!
//! - [`ChatTaskKind::Basics`], what the embedded base (`data/chat-base`) is pretrained on:
//!   copying a string of letters (`Write each letter : c a d b` → `c a d b`) and naming the
//!   letter after or before one letter (`Write the letter after c` → `d`; `z` wraps to `a`).
//!   Its score is the copy accuracy.
//! - [`ChatTaskKind::AfterEach`], the fine-tuning task: the letter after each letter of a
//!   string (`Write the letter after each letter : c a d b` → `d b e c`). The base knows every
//!   word of the question and both skills it combines, but has never seen them combined.
//!
//! Strings are `LETTERS` (4) letters long, so every question of a task has the same number of
//! tokens, and so has every answer. The strings of a task are distinct, so the train /
//! held-out split of the examples (by [`DataSpec::seed`], as `sft` data) never puts the same
//! question on both sides.

use std::collections::HashSet;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::sft::{LineRecord, Message, Record, Role, SftEncoder, SftSource};
pub use super::spec::{ChatTaskKind, DEFAULT_EXAMPLES};
use super::{Batch, BatchRequest, DataSource, DataSpec, Fingerprint, Split, Task};
use crate::error::{Error, Result};
use crate::tokenizer::{word_level, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};

/// Letters in each string of the copy and after-each questions.
pub(crate) const LETTERS: usize = 4;

/// The vocabulary's words (id `i` is `WORDS[i]`, `<unk>` first); the special tokens follow.
pub(crate) const WORDS: [&str; 37] = [
    "<unk>",
    "system",
    "user",
    "assistant",
    "Write",
    "the",
    "letter",
    "after",
    "before",
    "each",
    ":",
    "a",
    "b",
    "c",
    "d",
    "e",
    "f",
    "g",
    "h",
    "i",
    "j",
    "k",
    "l",
    "m",
    "n",
    "o",
    "p",
    "q",
    "r",
    "s",
    "t",
    "u",
    "v",
    "w",
    "x",
    "y",
    "z",
];

/// The special tokens: padding, then ChatML's turn markers.
pub(crate) const SPECIAL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// ChatML, with `{% generation %}` around the assistant's turn and its `<|im_end|>` (what the
/// loss covers).
pub(crate) const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + \
    message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}{% generation %}{{ \
    message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}{{ \
    message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt \
    %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The letter after `c` (`z` wraps to `a`).
fn next(c: u8) -> u8 {
    b'a' + (c - b'a' + 1) % 26
}

/// The letter before `c` (`a` wraps to `z`).
fn prev(c: u8) -> u8 {
    b'a' + (c - b'a' + 25) % 26
}

/// Letters separated by spaces: `c a d b`.
fn spaced(s: &[u8]) -> String {
    let mut out = String::with_capacity(2 * s.len());
    for (i, &c) in s.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push(c as char);
    }
    out
}

/// Which family of question an example is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Copy,
    AfterOne,
    BeforeOne,
    AfterEach,
}

impl Family {
    /// The (question, answer) for `s` (one letter for the single-letter families).
    fn chat(self, s: &[u8]) -> (String, String) {
        match self {
            Family::Copy => (format!("Write each letter : {}", spaced(s)), spaced(s)),
            Family::AfterOne => (
                format!("Write the letter after {}", s[0] as char),
                (next(s[0]) as char).to_string(),
            ),
            Family::BeforeOne => (
                format!("Write the letter before {}", s[0] as char),
                (prev(s[0]) as char).to_string(),
            ),
            Family::AfterEach => {
                let after: Vec<u8> = s.iter().map(|&c| next(c)).collect();
                (
                    format!("Write the letter after each letter : {}", spaced(s)),
                    spaced(&after),
                )
            }
        }
    }
}

/// The generated conversations of `kind`: `n` examples drawn with a generator seeded by
/// `seed`, with the family of each. String questions are distinct; the single-letter
/// questions of [`ChatTaskKind::Basics`] (26 of each) repeat.
fn generate(kind: ChatTaskKind, n: usize, seed: u64) -> Vec<(Family, Vec<Message>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6368_6174_5f74_736b); // "chat_tsk"
    let mut seen: HashSet<(u8, Vec<u8>)> = HashSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let family = match kind {
            ChatTaskKind::AfterEach => Family::AfterEach,
            ChatTaskKind::Basics => match rng.random_range(0..4u8) {
                0 | 1 => Family::Copy,
                2 => Family::AfterOne,
                _ => Family::BeforeOne,
            },
        };
        let len = match family {
            Family::Copy | Family::AfterEach => LETTERS,
            Family::AfterOne | Family::BeforeOne => 1,
        };
        let s: Vec<u8> = (0..len).map(|_| b'a' + rng.random_range(0..26u8)).collect();
        if len > 1 && !seen.insert((family as u8, s.clone())) {
            continue;
        }
        let (q, a) = family.chat(&s);
        out.push((
            family,
            vec![
                Message::new(Role::User, &q),
                Message::new(Role::Assistant, &a),
            ],
        ));
    }
    out
}

/// Writes the chat tasks' tokenizer into `dir` (created if needed): a word-level
/// `tokenizer.json` over `WORDS` and `SPECIAL`, and a `tokenizer_config.json` with the
/// ChatML with `{% generation %}` marks, `<|im_end|>` as EOS and `<|endoftext|>` as padding.
pub fn write_tokenizer(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tok = word_level(&WORDS, &SPECIAL)?;
    let path = dir.join(TOKENIZER_FILE);
    tok.save(&path, true)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 64,
        "chat_template": CHAT_TEMPLATE,
    });
    let path = dir.join(TOKENIZER_CONFIG_FILE);
    let text = serde_json::to_string_pretty(&config).unwrap_or_default() + "\n";
    std::fs::write(&path, text).map_err(|e| Error::io(&path, e))
}

/// A generated chat task: its conversations tokenised as `sft` data ([`SftSource`]), and the
/// held-out questions of the scored family as an exact-match [`Task`].
pub struct ChatTask {
    kind: ChatTaskKind,
    sft: SftSource,
    /// Held-out (prompt, answer) token ids of the scored family, in generation order.
    problems: Vec<(Vec<u32>, Vec<u32>)>,
    name: String,
    description: String,
}

impl ChatTask {
    /// Generates `spec.chat_examples` conversations of `spec.chat_task` (seeded by
    /// `spec.seed`) and tokenises them with `spec.tokenizer` and the chat template beside it
    /// (a directory made by [`write_tokenizer`], such as `data/chat-base`).
    pub fn open(spec: &DataSpec) -> Result<Self> {
        spec.validate()?;
        let tok = spec.tokenizer.clone().ok_or_else(|| {
            Error::Config(
                "data = chat-task needs --tokenizer-path (a tokenizer.json with a chat \
                 template beside it, e.g. data/chat-base/tokenizer.json; \
                 `trainer chat-tokenizer DIR` writes one)"
                    .into(),
            )
        })?;
        let encoder = SftEncoder::open(&tok)?;
        Self::with_encoder(spec, encoder)
    }

    /// As [`ChatTask::open`], with the encoder given.
    pub fn with_encoder(spec: &DataSpec, encoder: SftEncoder) -> Result<Self> {
        let kind = spec.chat_task;
        let n = spec.chat_examples;
        if n < 10 {
            return Err(Error::Config(format!(
                "chat_examples = {n}: a chat task needs at least 10 examples"
            )));
        }
        let name = format!("embedded chat task {kind}");
        let chats = generate(kind, n, spec.seed);
        let unk = encoder.tokenizer().token_to_id(WORDS[0]);
        let records: Vec<LineRecord> = chats
            .iter()
            .enumerate()
            .map(|(i, (_, m))| LineRecord {
                line: i + 1,
                record: Record::Messages(m.clone()),
            })
            .collect();
        let sft = SftSource::from_records(Path::new(&name), encoder, &records, spec)?;
        if sft.len() != records.len() {
            return Err(Error::data(
                &name,
                "some generated conversations have no assistant tokens: the tokenizer's chat \
                 template is not the chat tasks' ChatML one",
            ));
        }
        if unk.is_some()
            && sft
                .all_examples()
                .iter()
                .any(|e| e.tokens.contains(&unk.unwrap()))
        {
            return Err(Error::data(
                &name,
                format!(
                    "the tokenizer {} does not know every word of the chat tasks (it produced \
                     <unk>); use one written by `trainer chat-tokenizer`",
                    sft.encoder().path().display()
                ),
            ));
        }
        let scored = match kind {
            ChatTaskKind::Basics => Family::Copy,
            ChatTaskKind::AfterEach => Family::AfterEach,
        };
        let mut problems = Vec::new();
        for &i in sft.indices(Split::Val) {
            if chats[i].0 != scored {
                continue;
            }
            let ex = sft.example(i);
            let (Some(first), Some(last)) = (
                ex.counted.iter().position(|&c| c),
                ex.counted.iter().rposition(|&c| c),
            ) else {
                continue;
            };
            problems.push((
                ex.tokens[..first].to_vec(),
                ex.tokens[first..=last].to_vec(),
            ));
        }
        let shapes: HashSet<(usize, usize)> =
            problems.iter().map(|(p, a)| (p.len(), a.len())).collect();
        if problems.is_empty() || shapes.len() != 1 {
            return Err(Error::data(
                &name,
                format!(
                    "the held-out questions must all have one prompt and one answer length, \
                     found {shapes:?} (the tokenizer splits them differently)"
                ),
            ));
        }
        let (ex_q, ex_a) = scored.chat(b"cadb");
        let description = format!(
            "{name} (\"{ex_q}\" -> \"{ex_a}\"), {} held-out questions scored; {}",
            problems.len(),
            sft.describe()
        );
        Ok(ChatTask {
            kind,
            sft,
            problems,
            name: match kind {
                ChatTaskKind::Basics => "copy accuracy".into(),
                ChatTaskKind::AfterEach => "after-each accuracy".into(),
            },
            description,
        })
    }

    /// Which task this is.
    pub fn kind(&self) -> ChatTaskKind {
        self.kind
    }

    /// The tokenised conversations.
    pub fn sft(&self) -> &SftSource {
        &self.sft
    }
}

impl DataSource for ChatTask {
    source_methods!(wraps sft);

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        self.sft.draw(want, rng)
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        let (p, a) = &self.problems[0];
        if block_size + 1 < p.len() + a.len() {
            return Err(Error::data(
                &self.name,
                format!(
                    "block_size {block_size} is too small: a question and its answer are {} \
                     tokens, so block_size must be at least {}",
                    p.len() + a.len(),
                    p.len() + a.len() - 1
                ),
            ));
        }
        self.sft.check_block_size(block_size)
    }

    fn task(&self) -> Option<&dyn Task> {
        Some(self)
    }

    fn fingerprint(&self) -> Fingerprint {
        self.sft.fingerprint()
    }
}

impl Task for ChatTask {
    fn name(&self) -> &str {
        &self.name
    }

    /// The first `n` held-out questions of the scored family (all of them if fewer): the
    /// rendered conversation up to the assistant's generation prompt, and the assistant's
    /// tokens with its end-of-turn token.
    fn eval_problems(&self, n: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
        self.problems.iter().take(n).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataKind;

    fn spec(dir: &Path, kind: ChatTaskKind, n: usize, seed: u64) -> DataSpec {
        DataSpec {
            kind: DataKind::ChatTask,
            tokenizer: Some(dir.join(TOKENIZER_FILE)),
            chat_task: kind,
            chat_examples: n,
            seed,
            ..DataSpec::default()
        }
    }

    fn tokenizer_dir() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        write_tokenizer(tmp.path()).unwrap();
        tmp
    }

    #[test]
    fn questions_and_answers() {
        assert_eq!(
            Family::AfterEach.chat(b"cazb"),
            (
                "Write the letter after each letter : c a z b".to_string(),
                "d b a c".to_string()
            )
        );
        assert_eq!(Family::Copy.chat(b"cazb").1, "c a z b");
        assert_eq!(Family::AfterOne.chat(b"z").1, "a");
        assert_eq!(Family::BeforeOne.chat(b"a").1, "z");
    }

    #[test]
    fn generation_is_deterministic_and_strings_distinct() {
        let a = generate(ChatTaskKind::AfterEach, 500, 7);
        let b = generate(ChatTaskKind::AfterEach, 500, 7);
        let c = generate(ChatTaskKind::AfterEach, 500, 8);
        let text = |v: &[(Family, Vec<Message>)]| -> Vec<String> {
            v.iter().map(|(_, m)| m[0].content().unwrap()).collect()
        };
        assert_eq!(text(&a), text(&b));
        assert_ne!(text(&a), text(&c));
        let distinct: HashSet<String> = text(&a).into_iter().collect();
        assert_eq!(distinct.len(), 500);
        let basics = generate(ChatTaskKind::Basics, 400, 7);
        for f in [Family::Copy, Family::AfterOne, Family::BeforeOne] {
            assert!(basics.iter().filter(|(g, _)| *g == f).count() > 50);
        }
        assert!(basics.iter().all(|(f, _)| *f != Family::AfterEach));
    }

    #[test]
    fn held_out_questions_are_fixed_length_and_never_trained_on() {
        let dir = tokenizer_dir();
        let task = ChatTask::open(&spec(dir.path(), ChatTaskKind::AfterEach, 600, 3)).unwrap();
        let problems = task.eval_problems(1000);
        assert_eq!(problems.len(), 60, "val_fraction 0.1 of 600");
        assert_eq!(task.eval_problems(10), problems[..10].to_vec());
        // `<|im_start|> user Write the letter after each letter : c a d b <|im_end|>
        // <|im_start|> assistant` and `d b e c <|im_end|>`.
        for (p, a) in &problems {
            assert_eq!((p.len(), a.len()), (16, LETTERS + 1));
        }
        let (p, a) = &problems[0];
        let text = task.decode(&[p.clone(), a.clone()].concat()).unwrap();
        assert!(text.starts_with("<|im_start|> user Write the letter after each letter :"));
        let letters: Vec<u8> = text
            .split_whitespace()
            .filter(|w| w.len() == 1 && w.as_bytes()[0].is_ascii_lowercase())
            .map(|w| w.as_bytes()[0])
            .collect();
        let n = letters.len();
        let (q, ans) = (
            &letters[n - 2 * LETTERS..n - LETTERS],
            &letters[n - LETTERS..],
        );
        assert!(q.iter().zip(ans).all(|(&x, &y)| next(x) == y), "{text}");
        // Held-out prompts never appear among the training examples.
        let train: HashSet<Vec<u32>> = task
            .sft()
            .examples(Split::Train)
            .map(|e| e.tokens.clone())
            .collect();
        assert_eq!(train.len(), 540);
        for (p, a) in &problems {
            assert!(!train.contains(&[p.clone(), a.clone()].concat()));
            assert!(!train.iter().any(|t| t.starts_with(p)));
        }
        // The loss covers the answer and its <|im_end|>.
        let ex = task.sft().examples(Split::Train).next().unwrap();
        assert_eq!(ex.counted.iter().filter(|&&c| c).count(), LETTERS + 1);
    }

    #[test]
    fn basics_score_copying_and_bad_tokenizers_are_rejected() {
        let dir = tokenizer_dir();
        let task = ChatTask::open(&spec(dir.path(), ChatTaskKind::Basics, 400, 1)).unwrap();
        assert_eq!(task.task().unwrap().name(), "copy accuracy");
        let (p, a) = &task.eval_problems(1)[0];
        assert_eq!((p.len(), a.len()), (13, LETTERS + 1));
        assert!(task.check_block_size(17).is_ok());
        assert!(task.check_block_size(16).is_err());
        // A tokenizer without the letters.
        let other = tempfile::tempdir().unwrap();
        write_tokenizer(other.path()).unwrap();
        word_level(&WORDS[..11], &SPECIAL)
            .unwrap()
            .save(other.path().join(TOKENIZER_FILE), false)
            .unwrap();
        let err = ChatTask::open(&spec(other.path(), ChatTaskKind::Basics, 400, 1))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("<unk>"), "{err}");
        assert!(ChatTask::open(&spec(dir.path(), ChatTaskKind::Basics, 5, 1)).is_err());
    }
}
