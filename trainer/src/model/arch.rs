//! The one door between the trainer and an architecture: [`ModelConfig`] (what a model is,
//! known before anything is allocated), [`Model`] (a built model: its chain of links and an
//! incremental forward for sampling) and [`Architecture`] (how a `config.json` names it).
//!
//! The executors, the step, checkpoints, evaluation, sampling and the CLI know a model only
//! through these traits. Adding an architecture means writing its module (structure, config,
//! initialisation) and adding it to [`BUILTIN`]; a program (or a test) can also
//! [`register`] one of its own.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::RwLock;

use candle_core::{DType, Device, Tensor};
use candle_remat::ChainCosts;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use super::{Builder, Ctx, Kernels, Link, Loss, Params, WeightMap};
use crate::{Error, Result};

/// A model's configuration: its shape, everything the trainer must know before building it
/// (parameter names and shapes, memory, FLOPs) and its Hugging Face `config.json` form.
pub trait ModelConfig: Send + Sync + fmt::Debug {
    /// The architecture's name, as [`Architecture::name`] (`"gpt2"`).
    fn architecture(&self) -> &'static str;

    /// A copy behind a new box.
    fn clone_box(&self) -> Box<dyn ModelConfig>;

    /// Checks that the values describe a model that can be built.
    fn validate(&self) -> Result<()>;

    /// Number of token ids the model embeds.
    fn vocab_size(&self) -> usize;

    /// The longest sequence the model can take (learned positions, or the context it was
    /// trained for).
    fn max_positions(&self) -> usize;

    /// The shape a run records (layers, heads, width, biases), so that a resumed run and its
    /// checkpoint can be checked against each other.
    fn shape(&self) -> Shape;

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

    /// Number of scalar parameters (tied ones counted once).
    fn num_params(&self) -> usize;

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

/// The beginning- and end-of-text token ids of a vocabulary (`None`: it has no such token).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token_id`.
    pub bos: Option<u32>,
    /// `eos_token_id`.
    pub eos: Option<u32>,
}

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

impl Clone for Box<dyn ModelConfig> {
    fn clone(&self) -> Self {
        self.clone_box()
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
}

/// The architectures the trainer knows: one line each.
pub const BUILTIN: &[&dyn Architecture] = &[
    &super::gpt2::Gpt2,
    &super::llama::LLAMA,
    &super::llama::MISTRAL,
    &super::llama::QWEN2,
    &super::llama::QWEN3,
];

static REGISTERED: RwLock<Vec<&'static dyn Architecture>> = RwLock::new(Vec::new());

/// Makes an architecture of the caller's known to every loading path (checkpoints, resume,
/// `--init-from`, eval, sample), after the built-in ones. Registering a name twice keeps the
/// first.
pub fn register(arch: &'static dyn Architecture) {
    let mut r = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    if !r.iter().any(|a| a.name() == arch.name()) {
        r.push(arch);
    }
}

/// The architecture called `name` (built in or registered).
pub fn architecture(name: &str) -> Option<&'static dyn Architecture> {
    let registered = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    BUILTIN
        .iter()
        .chain(registered.iter())
        .find(|a| a.name() == name)
        .copied()
}

/// Reads a Hugging Face `config.json` of any known architecture (by its `model_type`; a
/// GPT-2 config without one is read as `gpt2`, as `transformers` does for old checkpoints).
pub fn config_from_hf_json_file(path: &Path) -> Result<Box<dyn ModelConfig>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))?;
    let all = || {
        let registered = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
        BUILTIN
            .iter()
            .copied()
            .chain(registered.iter().copied())
            .collect::<Vec<_>>()
    };
    // `model_type` names the architecture; without one, `architectures[0]` (the class); a
    // config with neither is an old GPT-2 one, as transformers reads it.
    let class = json
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|x| x.as_str());
    let arch = match json.get("model_type").and_then(|x| x.as_str()) {
        Some(name) => architecture(name).ok_or(("model_type", name)),
        None => match class {
            Some(class) => all()
                .into_iter()
                .find(|a| a.class() == class)
                .ok_or(("architectures", class)),
            None => architecture("gpt2").ok_or(("model_type", "gpt2")),
        },
    };
    let arch = arch.map_err(|(key, name)| {
        let known: Vec<&str> = all().iter().map(|a| a.name()).collect();
        Error::checkpoint(
            path,
            format!(
                "`{key}` is `{name}`, which this trainer does not know (known model types: {})",
                known.join(", ")
            ),
        )
    })?;
    // Per-layer structures (a layer's attention window, its parameters' names) are built
    // while reading: their number is bounded before (the memory check comes later).
    for key in ["num_hidden_layers", "n_layer"] {
        if let Some(n) = json.get(key).and_then(|v| v.as_u64()) {
            if n > MAX_LAYERS as u64 {
                return Err(Error::checkpoint(
                    path,
                    format!(
                        "`{key}` is {n}: more than the {MAX_LAYERS} layers this trainer builds"
                    ),
                ));
            }
        }
    }
    arch.config_from_hf_json(&json, path)
}

/// The most transformer blocks a model may have (`n_layer`, `num_hidden_layers`): checked
/// before anything with one entry per layer is built, so that a mistyped count is an error,
/// not an allocation of its size. Far beyond any model a memory can hold.
pub const MAX_LAYERS: usize = 1 << 20;

/// Builds `config`'s model over `params` (which must have exactly its names and shapes).
pub fn build(config: &dyn ModelConfig, params: &Params) -> Result<Box<dyn Model>> {
    config.validate()?;
    params.check(config)?;
    config.build(&Builder::root(&|name, _| params.tensor(name)))
}

/// A freshly initialised model of `config` and its parameters: [`ModelConfig::init`] over
/// the parameters in sorted name order, from a ChaCha RNG seeded with `seed` (the same seed
/// gives the same weights on every device).
pub fn init(
    config: &dyn ModelConfig,
    seed: u64,
    device: &Device,
) -> Result<(Box<dyn Model>, Params)> {
    config.validate()?;
    let params = Params::init(config, seed, device)?;
    let model = build(config, &params)?;
    Ok((model, params))
}
