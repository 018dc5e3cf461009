//! A stable, fast, non-cryptographic 64-bit hash: data fingerprints, cache keys and the
//! identity of a checkpoint's files.

/// SplitMix64 finaliser: a fast, well-mixed 64-bit hash of one word.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A streaming 64-bit hash (FNV-style over 8-byte words, SplitMix finalised). Stable across
/// Rust versions and platforms, unlike `DefaultHasher`; not cryptographic.
#[derive(Clone, Debug)]
pub struct Hasher64 {
    state: u64,
    len: u64,
}

impl Default for Hasher64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Hasher64 {
    /// A hasher with nothing fed yet.
    pub fn new() -> Self {
        Hasher64 {
            state: 0xcbf2_9ce4_8422_2325,
            len: 0,
        }
    }

    /// Feeds bytes. Chunk boundaries matter (each call pads its tail), which is fine for the
    /// fixed call sequences used here.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            self.state = (self.state ^ v).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut buf = [0u8; 8];
            buf[..rest.len()].copy_from_slice(rest);
            let v = u64::from_le_bytes(buf);
            self.state = (self.state ^ v).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.len = self.len.wrapping_add(bytes.len() as u64);
    }

    /// The hash of everything fed so far.
    pub fn finish(&self) -> u64 {
        splitmix64(self.state ^ splitmix64(self.len))
    }
}

/// Hash of a byte string with [`Hasher64`].
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = Hasher64::new();
    h.update(bytes);
    h.finish()
}
