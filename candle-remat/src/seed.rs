//! Deterministic randomness for recomputation.
//!
//! A checkpointed segment runs twice: once in the forward pass and once in the backward pass.
//! Any random op inside it (dropout) must draw the *same* numbers both times, or the gradients
//! belong to a different function than the loss. Candle's CPU RNG cannot be seeded, so the crate
//! draws on the host from a [`ChaCha8Rng`] whose seed is derived from
//! `(tape seed, segment/scope key, draw index)` and uploads the mask to the tensor's device
//! (device-generic, like TensorFlow's `recompute_grad` seeding).
//!
//! The current seed context lives in a thread-local stack that [`crate::Tape`] pushes while it
//! runs a segment or a scope, so a model's `forward(&self, x)` can call [`dropout`] without
//! receiving the tape.

use crate::error::{RematError, Result};
use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cell::RefCell;

/// SplitMix64 finaliser: a cheap bijective mixer for deriving seeds.
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_add(0x9E37_79B9_7F4A_7C15).rotate_left(17);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One level of the seed context: a seed, how many random draws were made at this level and how
/// many child scopes were opened (each child derives its seed from the parent seed and its index).
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    pub seed: u64,
    pub path: String,
    pub children: u64,
    pub draws: u64,
}

impl Ctx {
    pub(crate) fn new(seed: u64, path: String) -> Self {
        Self {
            seed,
            path,
            children: 0,
            draws: 0,
        }
    }

    fn next_draw_seed(&mut self) -> u64 {
        let s = mix(self.seed, mix(0xD5A1_0000, self.draws));
        self.draws += 1;
        s
    }
}

thread_local! {
    static STACK: RefCell<Vec<Ctx>> = const { RefCell::new(Vec::new()) };
}

/// Pops the context pushed by [`push`] when dropped (also on early return with `?`).
pub(crate) struct CtxGuard(());

pub(crate) fn push(ctx: Ctx) -> CtxGuard {
    STACK.with(|s| s.borrow_mut().push(ctx));
    CtxGuard(())
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        STACK.with(|s| {
            s.borrow_mut().pop();
        });
    }
}

/// Derives the context of the next child scope of the innermost active context, if any.
pub(crate) fn child_of_current() -> Option<(u64, String)> {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        let top = s.last_mut()?;
        let idx = top.children;
        top.children += 1;
        Some((
            mix(top.seed, mix(0xC41D_0000, idx)),
            format!("{}/{}", top.path, idx),
        ))
    })
}

/// Seed for the next draw of the innermost active context, or `None` outside any scope.
pub(crate) fn next_draw_seed() -> Option<u64> {
    STACK.with(|s| s.borrow_mut().last_mut().map(Ctx::next_draw_seed))
}

pub(crate) fn in_scope() -> bool {
    STACK.with(|s| !s.borrow().is_empty())
}

/// A host RNG seeded from the current segment/scope seed and a per-scope draw counter.
///
/// Use it for any random op inside a checkpointed segment (noise injection, random masking,
/// stochastic depth): the recompute in the backward pass gets the same stream. Returns
/// [`RematError::NoSeedContext`] outside a [`crate::Tape`] scope.
///
/// ```
/// use candle_remat::{seeded_rng, Tape};
/// use rand::Rng;
/// let tape = Tape::new(7);
/// let a: u32 = tape.scope(0, || Ok(seeded_rng()?.random()))?;
/// let b: u32 = Tape::new(7).scope(0, || Ok(seeded_rng()?.random()))?;
/// assert_eq!(a, b);
/// # Ok::<(), candle_remat::RematError>(())
/// ```
pub fn seeded_rng() -> Result<ChaCha8Rng> {
    let seed = next_draw_seed().ok_or(RematError::NoSeedContext)?;
    Ok(ChaCha8Rng::seed_from_u64(seed))
}

/// Builds an inverted-dropout mask (values `0` or `1/(1-p)`) of `like`'s shape, dtype and device.
pub(crate) fn dropout_mask(like: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = like.elem_count();
    let scale = 1.0 / (1.0 - p);
    let dtype = like.dtype();
    let mask = if dtype == DType::F64 {
        let v: Vec<f64> = (0..n)
            .map(|_| if rng.random::<f64>() >= p { scale } else { 0.0 })
            .collect();
        Tensor::from_vec(v, like.shape(), like.device())?
    } else {
        let s = scale as f32;
        let v: Vec<f32> = (0..n)
            .map(|_| if rng.random::<f64>() >= p { s } else { 0.0 })
            .collect();
        Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(dtype)?
    };
    Ok(mask)
}

pub(crate) fn check_p(p: f64) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(RematError::Candle(candle_core::Error::Msg(format!(
            "dropout probability must be in [0, 1), got {p}"
        ))));
    }
    Ok(())
}

/// Inverted dropout whose mask is reproducible under recomputation.
///
/// The mask is drawn from a host [`ChaCha8Rng`] seeded by the innermost active tape scope
/// (checkpointed segment, [`crate::Tape::scope`] or a block run by [`crate::Plan::forward`]) and
/// the number of draws already made in that scope, then uploaded to `x`'s device. Calling it
/// outside any scope returns [`RematError::NoSeedContext`]; use [`crate::Tape::dropout`] for glue
/// code between segments. `p = 0` returns `x` unchanged (but still consumes a draw index, so
/// masks do not shift when a rate is toggled).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_remat::{dropout, Tape};
/// let x = Tensor::ones((4, 8), candle_core::DType::F32, &Device::Cpu)?;
/// let tape = Tape::new(1);
/// let y = tape.scope(3, || dropout(&x, 0.5))?;
/// let z = Tape::new(1).scope(3, || dropout(&x, 0.5))?;
/// assert_eq!(y.to_vec2::<f32>()?, z.to_vec2::<f32>()?);
/// # Ok::<(), candle_remat::RematError>(())
/// ```
pub fn dropout(x: &Tensor, p: f64) -> Result<Tensor> {
    check_p(p)?;
    let seed = next_draw_seed().ok_or(RematError::NoSeedContext)?;
    if p == 0.0 {
        return Ok(x.clone());
    }
    let mask = dropout_mask(x, p, seed)?;
    Ok(x.mul(&mask)?)
}
