//! Text generation: temperature, top-k and top-p (nucleus) sampling, and batched greedy
//! decoding.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device, IndexOp, Tensor, D};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::model::{Kernels, KvCache, Model};
use crate::{Error, Result};

/// How to pick the next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (None: all).
    pub top_k: Option<usize>,
    /// Keep only the most likely tokens whose probabilities (after temperature and top-k)
    /// sum to at least `top_p` (nucleus sampling; 1.0: all).
    pub top_p: f64,
    /// Draw only ids below this (a tokenizer with fewer ids than the model's padded
    /// vocabulary; None: every id the model has).
    pub vocab: Option<usize>,
    /// The kernels the model runs while generating (default: fused; reference: the composite
    /// ops, as the model was checked against transformers).
    pub kernels: Kernels,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 0.8,
            top_k: Some(200),
            top_p: 1.0,
            vocab: None,
            kernels: Kernels::Fused,
        }
    }
}

/// Continues `prompt` by `max_new_tokens` tokens with the model's KV cache (the prompt in one
/// forward, then one token at a time). Rotary positions (the Llama family) continue past the
/// context the model was trained for, as transformers' `generate` does; learned positions
/// (GPT-2) cannot: past them, each step feeds the last `max_positions` tokens afresh.
/// Randomness comes from `rng` only.
///
/// ```
/// use candle_core::Device;
/// use rand::SeedableRng;
/// use trainer::model::gpt2::GptConfig;
/// use trainer::sample::{generate, SamplingConfig};
/// let cfg = GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 4, vocab_size: 10, ..GptConfig::default() };
/// let (model, _) = trainer::model::init(&cfg, 0, &Device::Cpu)?;
/// let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
/// let out = generate(model.as_ref(), &[1, 2, 3], 6, SamplingConfig::default(), &mut rng, &Device::Cpu)?;
/// assert_eq!(out.len(), 9);
/// assert!(out.iter().all(|&t| t < 10));
/// # Ok::<(), trainer::Error>(())
/// ```
pub fn generate(
    model: &dyn Model,
    prompt: &[u32],
    max_new_tokens: usize,
    sampling: SamplingConfig,
    rng: &mut ChaCha8Rng,
    device: &Device,
) -> Result<Vec<u32>> {
    generate_until(model, prompt, max_new_tokens, sampling, &[], rng, device)
}

/// [`generate`], stopping early after the first generated token that is one of `stop` (the
/// model's end tokens, e.g. instruction-tuned Llama 3's `[128001, 128008, 128009]`), which
/// ends the returned tokens. Tokens of the prompt do not stop it.
///
/// ```
/// use candle_core::Device;
/// use rand::SeedableRng;
/// use trainer::model::gpt2::GptConfig;
/// use trainer::sample::{generate, generate_until, SamplingConfig};
/// let cfg = GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 8, vocab_size: 10, ..GptConfig::default() };
/// let (model, _) = trainer::model::init(&cfg, 0, &Device::Cpu)?;
/// let greedy = SamplingConfig { temperature: 0.0, ..SamplingConfig::default() };
/// let rng = &mut rand_chacha::ChaCha8Rng::seed_from_u64(1);
/// let all = generate(model.as_ref(), &[1], 6, greedy, rng, &Device::Cpu)?;
/// let stop = all[3];
/// let cut = generate_until(model.as_ref(), &[1], 6, greedy, &[stop], rng, &Device::Cpu)?;
/// let first = 1 + all[1..].iter().position(|&t| t == stop).unwrap();
/// assert_eq!(cut, all[..=first]);
/// # Ok::<(), trainer::Error>(())
/// ```
pub fn generate_until(
    model: &dyn Model,
    prompt: &[u32],
    max_new_tokens: usize,
    sampling: SamplingConfig,
    stop: &[u32],
    rng: &mut ChaCha8Rng,
    device: &Device,
) -> Result<Vec<u32>> {
    let mut go_on = |_: &[u32]| true;
    generate_streaming(
        model,
        prompt,
        max_new_tokens,
        sampling,
        stop,
        rng,
        device,
        &mut go_on,
    )
}

/// [`generate_until`], calling `go_on` with the tokens so far (prompt included) after each
/// new token; generation ends when it returns false (its reader went away: `sample | head`).
#[allow(clippy::too_many_arguments)]
pub fn generate_streaming(
    model: &dyn Model,
    prompt: &[u32],
    max_new_tokens: usize,
    sampling: SamplingConfig,
    stop: &[u32],
    rng: &mut ChaCha8Rng,
    device: &Device,
    go_on: &mut dyn FnMut(&[u32]) -> bool,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(Error::Config(
            "the prompt must hold at least one token".into(),
        ));
    }
    let block = model.config().max_positions();
    let learned_positions = has_learned_positions(model.config());
    let mut tokens = prompt.to_vec();
    let mut cache = KvCache::new().with_kernels(sampling.kernels);
    let mut fed = 0; // tokens[..fed] are in the cache
    for _ in 0..max_new_tokens {
        if learned_positions && tokens.len() > block {
            // Past the model's positions: the last `block` tokens, afresh (a sliding window).
            cache = KvCache::new().with_kernels(sampling.kernels);
            fed = tokens.len() - block;
        }
        let new = &tokens[fed..];
        let idx = Tensor::new(new, device)?.unsqueeze(0)?;
        let logits = model.forward_cached(&idx, &mut cache)?;
        fed = tokens.len();
        let last = logits.i((0, new.len() - 1))?.to_dtype(DType::F32)?;
        let mut logits: Vec<f32> = last.to_vec1()?;
        logits.truncate(sampling.vocab.unwrap_or(usize::MAX).max(1));
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            return Err(Error::Config(format!(
                "the model computes a non-finite logit ({} for token id {i}) after {} tokens: \
                 its weights overflow the forward pass (a corrupt file or a diverged run); \
                 nothing is sampled from it",
                logits[i],
                tokens.len()
            )));
        }
        let next = pick(&logits, sampling, rng);
        tokens.push(next);
        if stop.contains(&next) || !go_on(&tokens) {
            break;
        }
    }
    Ok(tokens)
}

/// Whether the model's positions are learned embeddings (GPT-2's `wpe`), which end at
/// `max_positions`, rather than rotary ones, which go on.
pub fn has_learned_positions(config: &dyn crate::model::ModelConfig) -> bool {
    config.architecture() == "gpt2"
}

/// [`generate`], given up between tokens once `flag` is set (Ctrl-C, SIGTERM): `None`, so
/// that a signal during a long sample does not wait for its end.
pub(crate) fn generate_while(
    model: &dyn Model,
    prompt: &[u32],
    max_new_tokens: usize,
    sampling: SamplingConfig,
    rng: &mut ChaCha8Rng,
    device: &Device,
    flag: &AtomicBool,
) -> Result<Option<Vec<u32>>> {
    let stopped = || flag.load(Ordering::Relaxed);
    if stopped() {
        return Ok(None);
    }
    let mut go_on = |_: &[u32]| !stopped();
    let out = generate_streaming(
        model,
        prompt,
        max_new_tokens,
        sampling,
        &[],
        rng,
        device,
        &mut go_on,
    )?;
    Ok((!stopped()).then_some(out))
}

/// Chooses one token from `logits` according to `sampling`.
fn pick(logits: &[f32], sampling: SamplingConfig, rng: &mut ChaCha8Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if sampling.temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let k = sampling
        .top_k
        .unwrap_or(logits.len())
        .clamp(1, logits.len());
    order.truncate(k);
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / sampling.temperature).exp())
        .collect();
    let mut total: f64 = weights.iter().sum();
    if sampling.top_p < 1.0 {
        // The smallest prefix (in descending order) holding top_p of the mass; at least one.
        let mut kept = 0.0;
        let n = weights
            .iter()
            .position(|w| {
                kept += w;
                kept >= sampling.top_p * total
            })
            .map_or(weights.len(), |i| i + 1);
        order.truncate(n);
        total = weights[..n].iter().sum();
    }
    let mut u = rng.random::<f64>() * total;
    for (w, &i) in weights.iter().zip(&order) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    order[order.len() - 1] as u32
}

/// Greedily decodes `answer_len` tokens after each of `prompts` (all of the same length), as
/// one batch; returns the generated tokens per prompt. Rotary positions continue past the
/// model's `max_positions` (as in [`generate`]); learned ones refuse to.
pub fn greedy_batch(
    model: &dyn Model,
    prompts: &[Vec<u32>],
    answer_len: usize,
    device: &Device,
) -> Result<Vec<Vec<u32>>> {
    let Some(first) = prompts.first() else {
        return Ok(Vec::new());
    };
    let p = first.len();
    if prompts.iter().any(|x| x.len() != p) {
        return Err(Error::Config(
            "greedy_batch needs prompts of equal length".into(),
        ));
    }
    let block = model.config().max_positions();
    if has_learned_positions(model.config()) && p + answer_len > block + 1 {
        return Err(Error::Config(format!(
            "prompt ({p}) + answer ({answer_len}) tokens exceed the model's {block} learned \
             positions"
        )));
    }
    let flat: Vec<u32> = prompts.iter().flatten().copied().collect();
    let mut idx = Tensor::from_vec(flat, (prompts.len(), p), device)?;
    let mut cache = KvCache::new();
    let mut answer = Vec::with_capacity(answer_len);
    for _ in 0..answer_len {
        let logits = model.forward_cached(&idx, &mut cache)?;
        let t = idx.dim(1)?;
        idx = logits
            .i((.., t - 1))?
            .argmax(D::Minus1)?
            .unsqueeze(1)?
            .to_dtype(DType::U32)?;
        answer.push(idx.clone());
    }
    if answer.is_empty() {
        return Ok(vec![Vec::new(); prompts.len()]);
    }
    Ok(Tensor::cat(&answer, 1)?.to_vec2::<u32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Probabilities 0.5, 0.3, 0.15, 0.05 (at temperature 1): top-p 0.7 keeps the first two,
    /// 0.85 the first three, 1.0 all; top-p 0.1 keeps at least the most likely.
    #[test]
    fn top_p_keeps_the_smallest_prefix_holding_the_mass() {
        let logits: Vec<f32> = [0.05f32, 0.5, 0.15, 0.3].iter().map(|p| p.ln()).collect();
        let drawn = |top_p: f64| {
            let s = SamplingConfig {
                temperature: 1.0,
                top_k: None,
                top_p,
                vocab: None,
                ..SamplingConfig::default()
            };
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            let mut seen: Vec<u32> = (0..2000).map(|_| pick(&logits, s, &mut rng)).collect();
            seen.sort();
            seen.dedup();
            seen
        };
        assert_eq!(drawn(0.1), [1]);
        assert_eq!(drawn(0.7), [1, 3]);
        assert_eq!(drawn(0.85), [1, 2, 3]);
        assert_eq!(drawn(1.0), [0, 1, 2, 3]);
    }

    /// Weights finite one by one whose forward pass is not (the final norm's gain at 1e38, the
    /// embedding at 1e3: the logits overflow) sample nothing: an error, not tokens drawn from
    /// inf/NaN.
    #[test]
    fn non_finite_logits_are_an_error() {
        use crate::model::gpt2::GptConfig;
        use crate::model::Params;
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            block_size: 8,
            vocab_size: 10,
            ..GptConfig::default()
        };
        let params = Params::init(&cfg, 0, &Device::Cpu).unwrap();
        let huge = Params::from_tensors(params.iter().map(|(n, v)| {
            let k = match n {
                n if n.ends_with("ln_f.weight") => 1e38,
                n if n.ends_with("wte.weight") => 1e3,
                _ => 1.0,
            };
            (n.clone(), (v.as_tensor() * k).unwrap())
        }))
        .unwrap();
        let model = crate::model::build(&cfg, &huge).unwrap();
        let rng = &mut ChaCha8Rng::seed_from_u64(1);
        let e = generate(
            model.as_ref(),
            &[1, 2],
            3,
            SamplingConfig::default(),
            rng,
            &Device::Cpu,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("non-finite logit"), "{e}");
    }
}
