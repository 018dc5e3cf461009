//! Philox4x32-10, the counter-based random number generator of Salmon et al. (SC'11,
//! "Parallel random numbers: as easy as 1, 2, 3"), as used by cuRAND and JAX.
//!
//! A random number is a pure function of a key and a counter, so any element of any dropout
//! mask can be drawn on its own: the same bits on every device, for every thread count and
//! work split, and again in a recomputed forward (activation checkpointing) or a backward.
//!
//! Here the key is the 64-bit `seed`, and the 128-bit counter is `(index / 4, site)`: element
//! `index` of the mask at dropout site `site` uses lane `index % 4` of that block.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// The Philox4x32 bijection with 10 rounds: 4 random 32-bit words for `counter` under `key`.
///
/// ```
/// // Known-answer vector of the Random123 distribution (counter 0, key 0).
/// let r = candle_fused::philox::philox4x32_10([0; 4], [0; 2]);
/// assert_eq!(r, [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
/// ```
#[inline(always)]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c0);
        let (hi1, lo1) = mulhilo(M1, c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// Where a dropout mask comes from: the step's `seed` and the dropout `site` (a fixed number
/// per dropout location in a network).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RngKey {
    /// Seed of this forward pass (e.g. derived from the run seed, step and micro-batch).
    pub seed: u64,
    /// The dropout location.
    pub site: u64,
    /// Index of this tensor's first element in a larger tensor the mask is drawn for: element
    /// `i` draws the uniform of element `offset + i`. A slice of rows (a pipeline microbatch)
    /// then gets exactly the rows of the whole batch's mask.
    pub offset: u64,
}

impl RngKey {
    /// A key for `seed` at `site`.
    pub fn new(seed: u64, site: u64) -> Self {
        RngKey {
            seed,
            site,
            offset: 0,
        }
    }

    /// The same key for a tensor whose first element is element `offset` of the tensor the
    /// mask is drawn for (e.g. rows `r..` of a `[B, ...]` batch: `offset = r * row_len`).
    ///
    /// ```
    /// use candle_fused::RngKey;
    /// let key = RngKey::new(3, 1);
    /// assert_eq!(key.with_offset(10).uniform(2), key.uniform(12));
    /// ```
    pub fn with_offset(self, offset: u64) -> Self {
        RngKey { offset, ..self }
    }

    /// The 4 words of block `block` (elements `4 * block .. 4 * block + 4` of the whole
    /// tensor: the offset is not applied).
    #[inline(always)]
    pub fn block(&self, block: u64) -> [u32; 4] {
        philox4x32_10(
            [
                block as u32,
                (block >> 32) as u32,
                self.site as u32,
                (self.site >> 32) as u32,
            ],
            [self.seed as u32, (self.seed >> 32) as u32],
        )
    }

    /// The uniform number in `[0, 1)` of element `index` (24 random bits, exact in f32).
    #[inline(always)]
    pub fn uniform(&self, index: u64) -> f32 {
        let index = self.offset + index;
        to_unit(self.block(index / 4)[(index % 4) as usize])
    }

    /// Fills `out` with the uniforms of elements `start .. start + out.len()`.
    pub fn fill_uniform(&self, start: u64, out: &mut [f32]) {
        let mut i = 0usize;
        while i < out.len() {
            let idx = self.offset + start + i as u64;
            let lane = (idx % 4) as usize;
            let words = self.block(idx / 4);
            let take = (4 - lane).min(out.len() - i);
            for j in 0..take {
                out[i + j] = to_unit(words[lane + j]);
            }
            i += take;
        }
    }
}

/// The top 24 bits of `x` as a float in `[0, 1)`.
#[inline(always)]
pub fn to_unit(x: u32) -> f32 {
    (x >> 8) as f32 * (1.0 / 16_777_216.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // Random123 kat_vectors for philox4x32_10.
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn fill_matches_pointwise_and_is_uniform() {
        let key = RngKey::new(0x1234_5678_9abc_def0, 7);
        let mut out = vec![0f32; 1001];
        key.fill_uniform(3, &mut out);
        for (i, u) in out.iter().enumerate() {
            assert_eq!(*u, key.uniform(3 + i as u64));
        }
        let mut big = vec![0f32; 100_000];
        key.fill_uniform(0, &mut big);
        let mean = big.iter().map(|&u| u as f64).sum::<f64>() / big.len() as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        let below = big.iter().filter(|&&u| u < 0.1).count() as f64 / big.len() as f64;
        assert!((below - 0.1).abs() < 0.005, "P(u < 0.1) = {below}");
        // Another site or seed gives other numbers.
        assert_ne!(RngKey::new(key.seed, 8).uniform(0), key.uniform(0));
        assert_ne!(RngKey::new(key.seed + 1, 7).uniform(0), key.uniform(0));
    }
}
