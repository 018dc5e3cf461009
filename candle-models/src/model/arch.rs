//! The one door between the trainer and an architecture: [`ModelConfig`] (what a model is,
//! known before anything is allocated), [`Model`] (a built model: its chain of links and an
//! incremental forward for sampling) and [`Architecture`] (how a `config.json` names it).
//!
//! The executors, the step, checkpoints, evaluation, sampling and the CLI know a model only
//! through these traits. Adding an architecture means writing its module (structure, config,
//! initialisation) and one line of the registry ([`super::Arch`]); a program (or a test) can
//! also [`register`](super::register) one of its own. This module imports no architecture.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_remat::ChainCosts;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use super::{Builder, Ctx, Kernels, Link, Loss, WeightMap};
use crate::{Error, Result};

/// A model's configuration: its shape, everything the trainer must know before building it
/// (parameter names and shapes, memory, FLOPs) and its Hugging Face `config.json` form.
pub trait ModelConfig: Send + Sync + fmt::Debug + CloneConfig {
    /// The architecture's name, as [`Architecture::name`] (`"gpt2"`).
    fn architecture(&self) -> &'static str;

    /// Checks that the values describe a model that can be built.
    fn validate(&self) -> Result<()>;

    /// The model's dimensions: the one place a config states them (the accessors below
    /// follow from it).
    fn dims(&self) -> Dims;

    /// Number of token ids the model embeds.
    fn vocab_size(&self) -> usize {
        self.dims().vocab
    }

    /// The longest sequence the model can take (learned positions, or the context it was
    /// trained for).
    fn max_positions(&self) -> usize {
        self.dims().positions
    }

    /// The shape a run records (layers, heads, width, biases), so that a resumed run and its
    /// checkpoint can be checked against each other.
    fn shape(&self) -> Shape {
        let Dims {
            layers,
            heads,
            hidden,
            bias,
            ..
        } = self.dims();
        let (n_layer, n_head, n_embd) = (layers, heads, hidden);
        Shape {
            n_layer,
            n_head,
            n_embd,
            bias,
        }
    }

    /// Beginning- and end-of-text token ids of the model's vocabulary, if it has them.
    fn special_tokens(&self) -> SpecialTokens;

    /// The same config with another dropout probability and special tokens (a run's own
    /// settings over a pretrained model's).
    fn with_run_settings(&self, dropout: f32, tokens: SpecialTokens) -> Box<dyn ModelConfig>;

    /// The model's structure over tensors taken from `b` by their Hugging Face names. Building
    /// must ask `b` for every parameter exactly once (that walk also lists names and shapes).
    fn build(&self, b: &Builder) -> Result<Box<dyn Model>>;

    /// The initial value of parameter `name` of `shape` (fresh training), drawn from `rng`
    /// when random. Called in sorted name order.
    fn init(&self, name: &str, shape: &[usize], rng: &mut ChaCha8Rng) -> Result<Vec<f32>>;

    /// Number of scalar parameters (tied ones counted once). The default counts
    /// [`ModelConfig::shapes`].
    fn num_params(&self) -> usize {
        let sizes = self.shapes().into_values();
        sizes.map(|s| s.into_iter().product::<usize>()).sum()
    }

    /// FLOPs of one forward + backward pass over one token at context `seq_len` (for MFU).
    fn flops_per_token(&self, seq_len: usize) -> f64;

    /// Activation memory and relative compute of the blocks for one micro-batch of `batch`
    /// rows of `seq` tokens (what remat plans and memory estimates use).
    fn chain_costs(&self, batch: usize, seq: usize, dtype: DType, kernels: Kernels) -> ChainCosts;

    /// What a tensor called `name` in a Hugging Face checkpoint of this architecture is (its
    /// parameter name, a buffer to skip, a tied copy to check). The default: a parameter of
    /// that name.
    fn checkpoint_tensor(&self, name: &str) -> CheckpointTensor {
        CheckpointTensor::Param(name.to_string())
    }

    /// The Hugging Face `config.json` of this model.
    fn to_hf_json(&self) -> serde_json::Value;

    /// A one-line description for banners (`gpt2 4 layers x 128 wide, 4 heads`).
    fn describe(&self) -> String;

    /// Names and shapes of the model's parameters, in sorted order: the names its structure
    /// asks for ([`ModelConfig::build`]), without allocating anything.
    fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        let shapes = std::cell::RefCell::new(BTreeMap::new());
        let record = |name: &str, shape: &[usize]| -> Result<Tensor> {
            shapes.borrow_mut().insert(name.to_string(), shape.to_vec());
            // A stand-in that allocates nothing: only the names and shapes are wanted.
            Ok(Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(shape)?)
        };
        if let Err(e) = self.build(&Builder::root(&record)) {
            unreachable!("recording names and shapes cannot fail: {e}");
        }
        shapes.into_inner()
    }
}

pub use candle_data::tokenizer::SpecialTokens;

/// What a tensor of a Hugging Face checkpoint is to the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointTensor {
    /// The parameter of this name.
    Param(String),
    /// A buffer that is not a parameter (e.g. a causal-mask or rotary buffer): skipped.
    Buffer,
    /// A copy of the tied parameter of this name (e.g. `lm_head.weight`): must equal it.
    TiedCopy(String),
}

/// A model's dimensions: one plain struct for every architecture. A built config reports them
/// ([`ModelConfig::dims`]); a run's settings shape a fresh model by them
/// ([`Architecture::fresh`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dims {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Attention (query) heads per block.
    pub heads: usize,
    /// Key/value heads per block (`heads` without grouped-query attention).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Width of the MLP's hidden layer.
    pub mlp: usize,
    /// Token ids embedded.
    pub vocab: usize,
    /// The longest sequence (learned positions, or the context it was trained for).
    pub positions: usize,
    /// Whether the head reads the token embedding.
    pub tied: bool,
    /// Whether the projections (GPT-2: and norms) have biases.
    pub bias: bool,
}

/// The dimensions a run's config records of its model (`n_layer`, `n_head`, `n_embd`,
/// `bias` in `run.toml`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Attention (query) heads per block.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Whether the projections and norms have biases.
    pub bias: bool,
}

/// A copy of a [`ModelConfig`] behind a new box (what `Box<dyn ModelConfig>`'s `Clone`
/// calls): implemented here for every config that is `Clone`, so an architecture's config
/// only derives `Clone`.
pub trait CloneConfig {
    /// A copy behind a new box.
    fn clone_box(&self) -> Box<dyn ModelConfig>;
}

impl<T: ModelConfig + Clone + 'static> CloneConfig for T {
    fn clone_box(&self) -> Box<dyn ModelConfig> {
        Box::new(self.clone())
    }
}

impl Clone for Box<dyn ModelConfig> {
    fn clone(&self) -> Self {
        (**self).clone_box()
    }
}

/// A key/value cache for incremental decoding: per block, candle-nn's preallocated
/// [`candle_nn::kv_cache::KvCache`] over the sequence dimension of `[B, H, T, D]` keys and
/// values (it grows by [`KvCache::CHUNK`] positions when full).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<candle_nn::kv_cache::KvCache>,
    /// Number of tokens already in the cache.
    pub len: usize,
    /// The kernels the cached forward runs (default: fused).
    pub kernels: Kernels,
}

impl KvCache {
    /// Positions allocated at a time per block.
    pub const CHUNK: usize = 512;

    /// An empty cache.
    pub fn new() -> Self {
        KvCache::default()
    }

    /// The same cache, its forward passes running `kernels` (e.g. [`Kernels::Reference`],
    /// the composite ops a model was checked against).
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        KvCache { kernels, ..self }
    }

    /// Appends `k`, `v` (`[B, H, T_new, D]`) to block `i`'s entries; returns all of them.
    pub fn append(
        &mut self,
        i: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        while self.layers.len() <= i {
            self.layers
                .push(candle_nn::kv_cache::KvCache::new(2, Self::CHUNK));
        }
        self.layers[i].append(&k.contiguous()?, &v.contiguous()?)
    }

    /// [`KvCache::append`] for a layer attending within `window` tokens: returns the entries
    /// the new queries see (the last `window - 1 + T_new`) and keeps only those the next
    /// token can see, moved to the front of the layer's buffer once `window` more have come
    /// (so the cache holds at most about twice the window, whatever the length).
    pub fn append_window(
        &mut self,
        i: usize,
        k: &Tensor,
        v: &Tensor,
        window: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (ka, va) = self.append(i, k, v)?;
        let (n, keep) = (ka.dim(2)?, window.saturating_sub(1));
        let seen = (keep + k.dim(2)?).min(n);
        let out = (ka.narrow(2, n - seen, seen)?, va.narrow(2, n - seen, seen)?);
        if n > keep + window {
            let tail_k = ka.narrow(2, n - keep, keep)?.contiguous()?;
            let tail_v = va.narrow(2, n - keep, keep)?.contiguous()?;
            let layer = &mut self.layers[i];
            layer.reset();
            if keep > 0 {
                layer.append(&tail_k, &tail_v)?;
            }
        }
        Ok(out)
    }
}

/// A built model: its configuration, its chain and an incremental forward.
pub trait Model: Send + Sync + fmt::Debug {
    /// The model's configuration.
    fn config(&self) -> &dyn ModelConfig;

    /// The chain: the embedding, every block, the head (cheap handles).
    fn links(&self) -> Vec<Link>;

    /// The same model with every weight mapped by `f` (cast, copied to a device), each link
    /// mapping its own (a tied weight is mapped once per link that reads it, so its gradient
    /// contributions arrive in the same order in every executor).
    fn map(&self, f: WeightMap) -> candle_core::Result<Box<dyn Model>>;

    /// Logits `[B, T_new, V]` (f32) of `idx` (`[B, T_new]`), the tokens that follow the
    /// `cache.len` ones already in `cache` (which this call extends). Evaluation only.
    fn forward_cached(&self, idx: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor>;
}

impl<'a> dyn Model + 'a {
    /// Token ids `[B, T]` (u32, `T <= max_positions`) to logits `[B, T, vocab_size]` (f32).
    pub fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        super::run_links(&self.links(), idx, ctx)
    }

    /// The loss of `targets` (u32, [`super::IGNORE`] where a target does not count) after
    /// `idx`: every link's forward, then the head's loss.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Loss> {
        let links = self.links();
        let Some((head, body)) = links.split_last() else {
            candle_core::bail!("a model needs at least one link");
        };
        head.loss(&super::run_links(body, idx, ctx)?, targets, ctx)
    }

    /// The model with every weight cast to `dtype` (differentiably: gradients flow back to
    /// the original, e.g. f32 master, weights). Free when they already have it.
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Box<dyn Model>> {
        self.map(&|t: &Tensor| t.to_dtype(dtype))
    }
}

/// An architecture: how its `config.json` is recognised and read.
pub trait Architecture: Sync {
    /// The `model_type` of its `config.json` (`"gpt2"`).
    fn name(&self) -> &'static str;

    /// Its transformers class, as `config.json`'s `architectures` names it
    /// (`"GPT2LMHeadModel"`).
    fn class(&self) -> &'static str;

    /// Reads its `config.json` (already parsed; `path` is for error messages).
    fn config_from_hf_json(&self, json: &Value, path: &Path) -> Result<Box<dyn ModelConfig>>;

    /// A fresh model's config shaped by a run's settings: `dims` as the run gives them (a 0
    /// `kv_heads`, `head_dim` or `mlp` takes the architecture's default), its dropout and
    /// RoPE base. The default: this architecture is only loaded, never made fresh.
    fn fresh(&self, dims: &Dims, dropout: f32, rope_theta: f64) -> Result<Box<dyn ModelConfig>> {
        let _ = (dims, dropout, rope_theta);
        Err(Error::Config(format!(
            "architecture `{}` is loaded from a config.json, not made fresh",
            self.name()
        )))
    }
}
