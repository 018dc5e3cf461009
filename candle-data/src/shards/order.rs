//! Which windows a batch reads: random windows weighted by shard size, or one pass over
//! non-overlapping windows per epoch in a seeded order.
//!
//! Both orders are pure functions of the [`ChaCha8Rng`] the trainer checkpoints:
//!
//! - [`DataOrder::Random`] draws each window's start uniformly over every valid start of every
//!   shard (so a shard is drawn in proportion to its size), one `random_range` call a window:
//!   with one shard this is exactly the text sources' historical sampling.
//! - [`DataOrder::Epoch`] cuts every shard into `⌊n / (block_size + 1)⌋` non-overlapping
//!   windows, numbers them across shards, and visits them in a permutation that is a pure
//!   function of (the generator's seed and stream, the epoch, the split). The **cursor** (how
//!   many windows the run has read) is the generator's word position: window `g` of the run
//!   is read when the generator stands at word `WORDS_PER_WINDOW`` · g`, and drawing `k`
//!   windows moves it forward by `k` windows' words. Saving the generator (which every
//!   checkpoint does) therefore saves the epoch and the position in it, bit-exactly, with no
//!   new checkpoint field; and a separately seeded generator (an evaluation's) reads its own
//!   fixed windows without moving the run's cursor.
//!
//! The permutation is a keyed Feistel network over the next power of four with cycle walking:
//! a bijection of `0..n` evaluated in O(1) memory, so an epoch over billions of tokens keeps no
//! shuffled index array in memory.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::hash::splitmix64;

/// The order windows are read in (`--data-order`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataOrder {
    /// Random windows of `block_size + 1` tokens anywhere in the split, each shard weighted
    /// by its size (windows may overlap and repeat).
    #[default]
    Random,
    /// One pass per epoch over non-overlapping windows in a seeded order; data-parallel ranks
    /// take disjoint rows of each global batch, so within an epoch no token position is read
    /// twice.
    Epoch,
}

named_enum!(DataOrder, "data_order must be random or epoch", {
    Random => "random",
    Epoch => "epoch",
});

/// Generator words one epoch-order window advances the cursor by (one `u64`).
pub(crate) const WORDS_PER_WINDOW: u128 = 2;

/// A keyed bijection of `0..n` (a balanced Feistel network with cycle walking).
#[derive(Clone, Debug)]
pub(crate) struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

impl Permutation {
    /// The permutation of `0..n` selected by `key`.
    pub(crate) fn new(n: u64, key: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2);
        let mut keys = [0u64; 4];
        let mut k = key;
        for slot in &mut keys {
            k = splitmix64(k);
            *slot = k;
        }
        Permutation { n, half_bits, keys }
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for &k in &self.keys {
            let f = splitmix64(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The image of `i < n`.
    pub(crate) fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = i;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }
}

/// Where one window lies: shard index and first token.
pub type Window = (usize, usize);

/// Cumulative counts of places (window starts, whole windows) over shards, by shard.
struct Ends(Vec<u64>);

impl Ends {
    /// The counts of `places(len)` places in each shard of `lens`; `None` if there are none.
    fn new(lens: &[usize], places: impl Fn(usize) -> usize) -> Option<Self> {
        let mut total = 0u64;
        let ends: Vec<u64> = lens
            .iter()
            .map(|&n| {
                total += places(n) as u64;
                total
            })
            .collect();
        (total > 0).then_some(Ends(ends))
    }

    /// Places in all shards.
    fn total(&self) -> u64 {
        self.0.last().copied().unwrap_or(0)
    }

    /// The shard holding place `r` of all, and the place in it.
    fn locate(&self, r: u64) -> (usize, u64) {
        let shard = self.0.partition_point(|&e| e <= r);
        let before = if shard == 0 { 0 } else { self.0[shard - 1] };
        (shard, r - before)
    }
}

/// `count` random windows of `w` tokens over shards of `lens` tokens (each start uniform over
/// every valid start of every shard). `None` if no shard holds a window.
pub(crate) fn random_windows(
    lens: &[usize],
    w: usize,
    count: usize,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<Window>> {
    // Cumulative number of valid starts, by shard.
    let ends = Ends::new(lens, |n| (n + 1).saturating_sub(w))?;
    let total = ends.total();
    let windows = (0..count)
        .map(|_| {
            let (shard, start) = ends.locate(rng.random_range(0..=total - 1));
            (shard, start as usize)
        })
        .collect();
    Some(windows)
}

/// The next `count` windows of `w` tokens in epoch order over shards of `lens` tokens, at the
/// cursor `rng` stands at, moving it past them. `split_key` tells the splits' permutations
/// apart. `None` if no shard holds a window.
pub(crate) fn epoch_windows(
    lens: &[usize],
    w: usize,
    count: usize,
    split_key: u64,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<Window>> {
    let ends = Ends::new(lens, |n| n / w)?;
    let total = ends.total();
    let first = cursor(rng);
    let key = run_key(rng, split_key);
    let mut perm: Option<(u128, Permutation)> = None;
    let windows = (0..count as u128)
        .map(|k| {
            let g = first + k;
            let epoch = g / u128::from(total);
            let i = (g % u128::from(total)) as u64;
            let p = match &perm {
                Some((e, p)) if *e == epoch => p,
                _ => {
                    let p = Permutation::new(total, splitmix64(key ^ epoch as u64));
                    &perm.insert((epoch, p)).1
                }
            };
            let (shard, k) = ends.locate(p.apply(i));
            (shard, k as usize * w)
        })
        .collect();
    rng.set_word_pos((first + count as u128) * WORDS_PER_WINDOW);
    Some(windows)
}

/// The epoch-order cursor `rng` stands at: the number of windows read before (a generator
/// that drew other words is rounded up to the next whole window).
pub fn cursor(rng: &ChaCha8Rng) -> u128 {
    rng.get_word_pos().div_ceil(WORDS_PER_WINDOW)
}

/// The permutations' key: the generator's seed and stream (fixed for a run; the word position
/// is the cursor) and the split.
fn run_key(rng: &ChaCha8Rng, split_key: u64) -> u64 {
    let mut h = crate::hash::Hasher64::new();
    h.update(&rng.get_seed());
    h.update(&rng.get_stream().to_le_bytes());
    h.update(&split_key.to_le_bytes());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn permutations_are_bijections() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            for key in [0u64, 7, 12345] {
                let p = Permutation::new(n, key);
                let mut seen = vec![false; n as usize];
                for i in 0..n {
                    let j = p.apply(i) as usize;
                    assert!(!seen[j], "n {n} key {key}: {j} twice");
                    seen[j] = true;
                }
            }
        }
        // Different keys give different orders.
        let a: Vec<u64> = (0..100)
            .map(|i| Permutation::new(100, 1).apply(i))
            .collect();
        let b: Vec<u64> = (0..100)
            .map(|i| Permutation::new(100, 2).apply(i))
            .collect();
        assert_ne!(a, b);
    }

    #[test]
    fn one_epoch_reads_every_window_once_then_reshuffles() {
        let lens = [50usize, 7, 33]; // windows of 5: 10 + 1 + 6 = 17
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut epoch0 = Vec::new();
        for count in [4, 6, 7] {
            epoch0.extend(epoch_windows(&lens, 5, count, 0, &mut rng).unwrap());
        }
        let mut sorted = epoch0.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 17);
        assert!(sorted.iter().all(|&(s, t)| t % 5 == 0 && t + 5 <= lens[s]));
        assert_eq!(cursor(&rng), 17);
        let epoch1 = epoch_windows(&lens, 5, 17, 0, &mut rng).unwrap();
        assert_ne!(epoch0, epoch1);
        // A batch straddling the epoch boundary is the end of one and the start of the next.
        let mut again = ChaCha8Rng::seed_from_u64(3);
        epoch_windows(&lens, 5, 15, 0, &mut again).unwrap();
        let straddle = epoch_windows(&lens, 5, 4, 0, &mut again).unwrap();
        assert_eq!(&straddle[..2], &epoch0[15..]);
        assert_eq!(&straddle[2..], &epoch1[..2]);
    }

    #[test]
    fn random_windows_cover_every_shard_in_bounds() {
        let lens = [10usize, 3, 40];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let ws = random_windows(&lens, 4, 2000, &mut rng).unwrap();
        assert!(ws.iter().all(|&(s, t)| t + 4 <= lens[s]));
        assert!(
            ws.iter().all(|&(s, _)| s != 1),
            "a too-short shard is never drawn"
        );
        let from0 = ws.iter().filter(|w| w.0 == 0).count();
        // 7 of the 44 starts are in shard 0.
        assert!((200..450).contains(&from0), "{from0}");
        assert!(random_windows(&[3, 2], 4, 1, &mut rng).is_none());
    }
}
