//! The embedded default task: multi-digit addition with reversed answers.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{decimal_f64, Batch, BatchRequest, DataSource, Fingerprint, Split, Task};
use crate::error::{Error, Result};
use crate::hash::{hash_bytes, splitmix64, Hasher64};

/// Token id of `+`.
const PLUS: u32 = 10;
/// Token id of `=`.
const EQUALS: u32 = 11;
/// Token id of the end-of-problem newline.
const NEWLINE: u32 = 12;
/// The vocabulary: ids 0-9 are the digits, then `+`, `=` and newline.
const VOCAB: &[u8; 13] = b"0123456789+=\n";
/// Name used in error messages (there is no file).
const SOURCE_NAME: &str = "embedded addition task";
/// Salt that separates the evaluation-problem stream from the split hash.
const EVAL_SALT: u64 = 0x6576_616c_5f61_6464; // "eval_add"

/// Multi-digit addition generated on the fly: the embedded default data source.
///
/// Each problem is `a+b=` with both operands zero-padded to `digits` digits, followed by the
/// sum written **reversed** (least-significant digit first) on `digits + 1` digits, and a
/// newline. For `digits = 3`, `12 + 459 = 471` is the 14-character line `012+459=1740\n`.
/// Writing the sum backwards lets the model produce each digit right after the digits (and
/// the carry) it depends on, which makes the task learnable by a small GPT within minutes.
///
/// Vocabulary (13 tokens): `'0'..='9'` are ids 0-9, `'+'` is 10, `'='` is 11, `'\n'` is 12.
///
/// Training batches are rows of whole problems laid end to end, each row starting at a problem
/// boundary; the [`Batch::mask`] keeps only targets that are answer tokens (the reversed sum
/// and its newline). The operands are uniformly random and cannot be predicted, so counting
/// them would only add a constant `ln 10` per operand digit to the loss and noise to the
/// gradient.
///
/// Held-out problems: an unordered operand pair `{a, b}` belongs to the held-out set when a
/// seeded hash of it falls below `val_fraction`, so `a+b` and `b+a` are always on the same
/// side and no held-out problem is ever trained on. [`Split::Val`] batches and
/// [`Task::eval_problems`] draw only held-out pairs.
#[derive(Clone, Debug)]
pub struct Addition {
    digits: usize,
    /// `10^digits`: operands are in `0..modulus`.
    modulus: u64,
    val_fraction: f64,
    seed: u64,
    /// `splitmix64(seed)`, mixed into the split hash.
    split_key: u64,
}

impl Addition {
    /// Default number of digits per operand.
    pub const DEFAULT_DIGITS: usize = 3;
    /// Largest supported number of digits per operand.
    pub const MAX_DIGITS: usize = 9;

    /// Builds the task with `digits`-digit operands, holding out `val_fraction` of the
    /// unordered operand pairs (chosen by a hash seeded with `seed`).
    ///
    /// Errors if `digits` is not in `1..=9`, `val_fraction` is not strictly between 0 and 1, or
    /// either side of the split would be (nearly) empty.
    pub fn new(digits: usize, val_fraction: f32, seed: u64) -> Result<Self> {
        if !(1..=Self::MAX_DIGITS).contains(&digits) {
            return Err(Error::Config(format!(
                "addition digits = {digits} must be between 1 and {}",
                Self::MAX_DIGITS
            )));
        }
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(Error::Config(format!(
                "addition val_fraction = {val_fraction} must be strictly between 0 and 1"
            )));
        }
        let modulus = 10u64.pow(digits as u32);
        let task = Addition {
            digits,
            modulus,
            val_fraction: decimal_f64(val_fraction),
            seed,
            split_key: splitmix64(seed),
        };
        let (train, val) = task.split_sizes();
        if train < 1.0 || val < 1.0 {
            return Err(Error::data(
                SOURCE_NAME,
                format!(
                    "with digits = {digits} and val_fraction = {val_fraction} a split would be \
                     empty ({train} train / {val} held-out unordered pairs); \
                     use more digits or a val_fraction closer to 0.5"
                ),
            ));
        }
        Ok(task)
    }

    /// Number of digits per operand.
    pub fn digits(&self) -> usize {
        self.digits
    }

    /// Length in tokens of the prompt `a+b=`.
    pub fn prompt_len(&self) -> usize {
        2 * self.digits + 2
    }

    /// Length in tokens of the expected answer (the reversed sum, without the newline).
    pub fn answer_len(&self) -> usize {
        self.digits + 1
    }

    /// Length in tokens of a whole problem line (prompt, answer and newline).
    pub fn problem_len(&self) -> usize {
        self.prompt_len() + self.answer_len() + 1
    }

    /// Whether the unordered pair `{a, b}` is held out (never used for training).
    pub fn is_held_out(&self, a: u64, b: u64) -> bool {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        let h = splitmix64((lo * self.modulus + hi) ^ self.split_key);
        // The top 53 bits as a uniform number in [0, 1).
        ((h >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < self.val_fraction
    }

    /// (train, held-out) counts of unordered pairs: exact for up to 3 digits, expected values
    /// above.
    fn split_sizes(&self) -> (f64, f64) {
        let m = self.modulus;
        if self.digits <= 3 {
            let mut val = 0u64;
            for a in 0..m {
                for b in a..m {
                    val += u64::from(self.is_held_out(a, b));
                }
            }
            let total = m * (m + 1) / 2;
            ((total - val) as f64, val as f64)
        } else {
            // Millions of pairs: only a val_fraction within ~1e-6 of 0 or 1 could empty a
            // side; require a comfortable expected count instead of enumerating.
            let total = (m as f64) * (m as f64 + 1.0) / 2.0;
            let val = total * self.val_fraction;
            let train = total - val;
            let ok = |n: f64| if n >= 1000.0 { n } else { 0.0 };
            (ok(train), ok(val))
        }
    }

    /// Draws an operand pair from `split` by rejection sampling (every draw comes from `rng`).
    fn sample_pair(&self, split: Split, rng: &mut ChaCha8Rng) -> (u64, u64) {
        let want_val = split == Split::Val;
        loop {
            let a = rng.random_range(0..self.modulus);
            let b = rng.random_range(0..self.modulus);
            if self.is_held_out(a, b) == want_val {
                return (a, b);
            }
        }
    }

    /// Appends the `digits` decimal digits of `v`, most significant first.
    fn push_number(&self, mut v: u64, width: usize, reversed: bool, out: &mut Vec<u32>) {
        let start = out.len();
        for _ in 0..width {
            out.push((v % 10) as u32);
            v /= 10;
        }
        if !reversed {
            out[start..].reverse();
        }
    }

    /// The prompt tokens of `a+b=`.
    pub fn prompt(&self, a: u64, b: u64) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.prompt_len());
        self.push_number(a, self.digits, false, &mut out);
        out.push(PLUS);
        self.push_number(b, self.digits, false, &mut out);
        out.push(EQUALS);
        out
    }

    /// The expected answer tokens for `a+b`: the sum on `digits + 1` digits, reversed.
    pub fn answer(&self, a: u64, b: u64) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.answer_len());
        self.push_number(a + b, self.digits + 1, true, &mut out);
        out
    }

    /// Appends one whole problem line to `tokens` and, in `is_answer`, whether each token is
    /// part of the answer (reversed sum or final newline).
    fn push_problem(&self, a: u64, b: u64, tokens: &mut Vec<u32>, is_answer: &mut Vec<bool>) {
        tokens.extend(self.prompt(a, b));
        is_answer.resize(tokens.len(), false);
        tokens.extend(self.answer(a, b));
        tokens.push(NEWLINE);
        is_answer.resize(tokens.len(), true);
    }

    fn check_block(&self, block_size: usize) -> Result<()> {
        // The last answer token of the first problem must be a target: T + 1 >= problem_len - 1.
        let need = self.problem_len() - 2;
        if block_size < need {
            return Err(Error::data(
                SOURCE_NAME,
                format!(
                    "block_size {block_size} is too small for {}-digit addition: a problem is {} \
                     tokens ({}), so block_size must be at least {need}",
                    self.digits,
                    self.problem_len(),
                    self.render(&self.prompt(0, 0), &self.answer(0, 0)),
                ),
            ));
        }
        Ok(())
    }

    fn render(&self, prompt: &[u32], answer: &[u32]) -> String {
        prompt
            .iter()
            .chain(answer)
            .map(|&t| VOCAB[t as usize] as char)
            .collect()
    }
}

impl DataSource for Addition {
    fn fingerprint(&self) -> Fingerprint {
        // The problem stream is a pure function of these values and the code.
        let mut h = Hasher64::new();
        h.update(b"addition");
        h.update(&(self.digits as u64).to_le_bytes());
        h.update(&self.val_fraction.to_bits().to_le_bytes());
        h.update(&self.seed.to_le_bytes());
        Fingerprint {
            tokens: format!("{:016x}", h.finish()),
            vocab: format!("{:016x}", hash_bytes(VOCAB)),
        }
    }

    fn vocab_size(&self) -> usize {
        VOCAB.len()
    }

    fn describe(&self) -> String {
        let (train, val) = self.split_sizes();
        let (a, b) = (12 % self.modulus, 459 % self.modulus);
        format!(
            "embedded addition: {d}-digit operands, reversed {e}-digit sums (e.g. {a}+{b} = {s} \
             is \"{line}\\n\"), vocab {v}, {approx}{train} train / {val} held-out operand pairs \
             (val_fraction {vf}, seed {seed}), loss on answer tokens only",
            d = self.digits,
            e = self.digits + 1,
            s = a + b,
            line = self.render(&self.prompt(a, b), &self.answer(a, b)),
            v = VOCAB.len(),
            approx = if self.digits > 3 { "~" } else { "" },
            vf = self.val_fraction,
            seed = self.seed,
        )
    }

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        let (split, batch_size, block_size) = (want.split, want.batch_size, want.block_size);
        // Any block size works here (a short one just cuts problems, e.g. to make a prompt);
        // `check_block_size` is what rejects one too short to train on.
        let w = block_size + 1;
        let mut rows = Vec::with_capacity(batch_size * w);
        let mut mask = Vec::with_capacity(batch_size * block_size);
        let mut tokens = Vec::with_capacity(w + self.problem_len());
        let mut is_answer = Vec::with_capacity(w + self.problem_len());
        for _ in 0..batch_size {
            tokens.clear();
            is_answer.clear();
            while tokens.len() < w {
                let (a, b) = self.sample_pair(split, rng);
                self.push_problem(a, b, &mut tokens, &mut is_answer);
            }
            rows.extend_from_slice(&tokens[..w]);
            // Target j is token j + 1 of the row.
            mask.extend(
                is_answer[1..w]
                    .iter()
                    .map(|&m| if m { 1.0f32 } else { 0.0 }),
            );
        }
        want.batch_of(&rows, Some(mask))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .map(|c| {
                VOCAB
                    .iter()
                    .position(|&v| v as char == c)
                    .map(|i| i as u32)
                    .ok_or_else(|| {
                        Error::data(
                            SOURCE_NAME,
                            format!(
                                "cannot encode {c:?}: the vocabulary is the digits, '+', '=' and \
                                 newline"
                            ),
                        )
                    })
            })
            .collect()
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        ids.iter()
            .map(|&id| {
                VOCAB.get(id as usize).map(|&b| b as char).ok_or_else(|| {
                    Error::data(
                        SOURCE_NAME,
                        format!("token id {id} is outside the vocabulary of {}", VOCAB.len()),
                    )
                })
            })
            .collect()
    }

    fn check_block_size(&self, block_size: usize) -> Result<()> {
        self.check_block(block_size)
    }

    fn task(&self) -> Option<&dyn Task> {
        Some(self)
    }
}

impl Task for Addition {
    fn name(&self) -> &str {
        "addition accuracy"
    }

    /// Held-out problems drawn with replacement from a generator seeded by the task seed
    /// (prefix-stable in `n`); the answer is the reversed sum without the newline.
    fn eval_problems(&self, n: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ EVAL_SALT);
        (0..n)
            .map(|_| {
                let (a, b) = self.sample_pair(Split::Val, &mut rng);
                (self.prompt(a, b), self.answer(a, b))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    /// Parses a decoded problem line `a+b=rev` back into (a, b, sum).
    fn parse(line: &str) -> (u64, u64, u64) {
        let (lhs, rev) = line.split_once('=').unwrap();
        let (a, b) = lhs.split_once('+').unwrap();
        let sum: String = rev.chars().rev().collect();
        (a.parse().unwrap(), b.parse().unwrap(), sum.parse().unwrap())
    }

    #[test]
    fn format_is_zero_padded_and_reversed() {
        let t = Addition::new(3, 0.1, 0).unwrap();
        let line = t.render(&t.prompt(12, 459), &t.answer(12, 459));
        assert_eq!(line, "012+459=1740");
        assert_eq!(t.prompt_len() + t.answer_len(), line.len());
        let enc = t.encode("012+459=1740\n").unwrap();
        assert_eq!(enc.len(), t.problem_len());
        assert_eq!(t.decode(&enc).unwrap(), "012+459=1740\n");
        assert!(t.encode("1-2").is_err());
        assert!(t.decode(&[13]).is_err());
    }

    #[test]
    fn batches_are_correct_sums_with_answer_mask() {
        for digits in [1, 2, 3, 5] {
            let t = Addition::new(digits, 0.2, 7).unwrap();
            let block = 3 * t.problem_len() + 2;
            let b = t
                .batch(Split::Train, 4, block, &mut rng(1), &Device::Cpu)
                .unwrap();
            let x = b.x.to_vec2::<u32>().unwrap();
            let y = b.y.to_vec2::<u32>().unwrap();
            let m = b.mask.unwrap().to_vec2::<f32>().unwrap();
            for i in 0..4 {
                assert_eq!(&x[i][1..], &y[i][..block - 1], "y is x shifted");
                let mut row = x[i].clone();
                row.push(*y[i].last().unwrap());
                let text = t.decode(&row).unwrap();
                let lines: Vec<&str> = text.split('\n').collect();
                // Every complete line is a correct problem.
                for line in &lines[..lines.len() - 1] {
                    let (a, bb, s) = parse(line);
                    assert_eq!(a + bb, s, "{line}");
                    assert!(!t.is_held_out(a, bb));
                }
                // The mask is 1 exactly on targets that are answer digits or newlines.
                let l = t.problem_len();
                for (j, &w) in m[i].iter().enumerate() {
                    let expect = (j + 1) % l >= t.prompt_len();
                    assert_eq!(w == 1.0, expect, "digits {digits} row {i} col {j}");
                }
            }
        }
    }

    #[test]
    fn split_is_disjoint_and_commutative() {
        let t = Addition::new(2, 0.25, 3).unwrap();
        let mut r = rng(5);
        let mut train = std::collections::HashSet::new();
        let mut val = std::collections::HashSet::new();
        for _ in 0..200 {
            let b = t.batch(Split::Train, 2, 30, &mut r, &Device::Cpu).unwrap();
            let v = t.batch(Split::Val, 2, 30, &mut r, &Device::Cpu).unwrap();
            for (batch, set) in [(b, &mut train), (v, &mut val)] {
                for row in batch.x.to_vec2::<u32>().unwrap() {
                    let text = t.decode(&row).unwrap();
                    for line in text.split('\n').filter(|l| l.len() == t.prompt_len() + 3) {
                        let (a, b, _) = parse(line);
                        set.insert((a.min(b), a.max(b)));
                    }
                }
            }
        }
        assert!(
            train.len() > 1000 && val.len() > 100,
            "{} {}",
            train.len(),
            val.len()
        );
        assert!(train.is_disjoint(&val));
        for (prompt, answer) in t.eval_problems(300) {
            let (a, b, s) = parse(&t.render(&prompt, &answer));
            assert_eq!(a + b, s);
            assert!(t.is_held_out(a, b));
            assert!(!train.contains(&(a.min(b), a.max(b))));
            assert_eq!(t.is_held_out(a, b), t.is_held_out(b, a));
        }
        // The held-out fraction is close to val_fraction (5050 unordered pairs).
        let (tr, va) = t.split_sizes();
        assert_eq!(tr + va, 5050.0);
        assert!((va / 5050.0 - 0.25).abs() < 0.03, "{va}");
    }

    #[test]
    fn batches_are_determined_by_rng_state() {
        let t = Addition::new(3, 0.1, 1337).unwrap();
        let mut r1 = rng(42);
        let _ = t.batch(Split::Train, 3, 40, &mut r1, &Device::Cpu).unwrap();
        let mut r2 = r1.clone();
        let a = t.batch(Split::Train, 3, 40, &mut r1, &Device::Cpu).unwrap();
        let b = t.batch(Split::Train, 3, 40, &mut r2, &Device::Cpu).unwrap();
        assert_eq!(a.x.to_vec2::<u32>().unwrap(), b.x.to_vec2::<u32>().unwrap());
        assert_eq!(r1.get_word_pos(), r2.get_word_pos());
        let c = t.batch(Split::Train, 3, 40, &mut r1, &Device::Cpu).unwrap();
        assert_ne!(a.x.to_vec2::<u32>().unwrap(), c.x.to_vec2::<u32>().unwrap());
    }

    #[test]
    fn eval_problems_are_fixed_shape_and_prefix_stable() {
        let t = Addition::new(3, 0.1, 9).unwrap();
        let p50 = t.eval_problems(50);
        let p20 = t.eval_problems(20);
        assert_eq!(&p50[..20], &p20[..]);
        assert!(p50
            .iter()
            .all(|(p, a)| p.len() == t.prompt_len() && a.len() == t.answer_len()));
        let other_seed = Addition::new(3, 0.1, 10).unwrap().eval_problems(20);
        assert_ne!(other_seed, p20);
    }

    #[test]
    fn bad_settings_are_rejected() {
        assert!(Addition::new(0, 0.1, 0).is_err());
        assert!(Addition::new(10, 0.1, 0).is_err());
        assert!(Addition::new(3, 0.0, 0).is_err());
        // One digit, tiny val_fraction: the held-out side of 55 pairs is empty.
        let err = Addition::new(1, 0.001, 0).unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
        let t = Addition::new(3, 0.1, 0).unwrap();
        let err = t.check_block_size(8).unwrap_err().to_string();
        assert!(err.contains("block_size 8"), "{err}");
        // A short batch is still served (e.g. a sampling prompt): the first prompt, cut.
        let short = t
            .batch(Split::Val, 1, 8, &mut rng(0), &Device::Cpu)
            .unwrap();
        let x = short.x.to_vec2::<u32>().unwrap().remove(0);
        assert_eq!((x[3], x[7]), (PLUS, EQUALS));
        assert_eq!(short.mask.unwrap().to_vec2::<f32>().unwrap()[0][7], 1.0);
        assert!(t.check_block_size(11).is_ok());
        assert!(t.check_block_size(10).is_err());
        assert!(t
            .batch(Split::Train, 0, 16, &mut rng(0), &Device::Cpu)
            .is_err());
    }
}
