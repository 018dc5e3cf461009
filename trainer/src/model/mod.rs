//! A GPT-2 language model, written as a chain `embed -> blocks -> head` of plain structs.
//!
//! The names and layouts of the parameters are those of Hugging Face's `GPT2LMHeadModel`
//! (`transformer.h.{i}.attn.c_attn.weight` is a Conv1D weight of shape `[in, out]`), so a real
//! GPT-2 `model.safetensors` loads without renaming (see [`crate::checkpoint`]).
//!
//! Parameter names come from the structure ([`Builder::pp`], as in candle-nn's `VarBuilder`),
//! and the model exposes its chain as [`Link`]s ([`Gpt::links`]), each with the weights it
//! reads: the plain forward, activation-checkpointing plans and pipeline stages all run that one
//! list.
//!
//! Every operation has a backward: the ops come from `candle-fused` (or, with
//! `--kernels reference`, from primitive Candle ops; Candle's own fused `layer_norm` /
//! `softmax_last_dim` return detached outputs). Dropout masks are a pure function of a seed, a
//! site and the element's index in the batch ([`Ctx`]), so training is reproducible on every
//! device and a recomputed block or a pipeline microbatch sees the same masks as the plain
//! forward pass.

mod config;
mod kernels;
mod layers;
mod params;
mod scope;

use candle_core::{DType, Device, Module, Tensor};

pub use config::{GptConfig, GPT2_ENDOFTEXT};
pub use kernels::Kernels;
pub use layers::{dropout, stat_dtype, Conv1D, LayerNorm};
pub use params::Params;
pub use scope::{Builder, Source};

use crate::Result;

/// LayerNorm epsilon of GPT-2.
pub const LN_EPS: f64 = 1e-5;

/// Per-call forward context: training mode, dropout seed, compute dtype and kernels.
///
/// Dropout masks are a pure function of `(seed, site)` and the element's index in the batch,
/// where the site is fixed per dropout location in the network. The trainer derives `seed`
/// from the run seed and the step, so a run is reproducible, a resumed run needs no RNG state
/// for dropout, a recomputed block gets the same masks, and a slice of the batch's rows (a
/// pipeline microbatch, a data-parallel shard) gets exactly those rows of the batch's masks.
#[derive(Clone, Copy, Debug)]
pub struct Ctx {
    /// Apply dropout (training) or not (evaluation).
    pub train: bool,
    /// Seed of this forward pass's dropout masks.
    pub seed: u64,
    /// Index of the input's first row in the batch the masks are drawn for (0 for a whole
    /// batch; `r` for rows `r..` of it).
    pub row: usize,
    /// Dtype of the computation (weights are cast to it at use, so f32 master weights receive
    /// f32 gradients). Softmax, LayerNorm statistics and the loss always run in f32.
    pub dtype: DType,
    /// Which implementation of the ops runs (fused kernels by default).
    pub kernels: Kernels,
}

impl Ctx {
    /// Evaluation: no dropout, f32.
    pub fn eval() -> Self {
        Ctx {
            train: false,
            seed: 0,
            row: 0,
            dtype: DType::F32,
            kernels: Kernels::Fused,
        }
    }

    /// Training with dropout seeded by `seed`, f32.
    pub fn train(seed: u64) -> Self {
        Ctx {
            train: true,
            seed,
            ..Ctx::eval()
        }
    }

    /// The same context with another compute dtype.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Ctx { dtype, ..self }
    }

    /// The same context with other kernels.
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Ctx { kernels, ..self }
    }

    /// The same context for rows `row..` of the batch (see [`Ctx::row`]).
    pub fn with_row(self, row: usize) -> Self {
        Ctx { row, ..self }
    }
}

/// Token and position embeddings (`transformer.wte`, `transformer.wpe`) plus embedding dropout.
#[derive(Clone, Debug)]
pub struct Embed {
    /// Token embedding `[vocab_size, n_embd]`, shared with the head.
    pub wte: Tensor,
    /// Position embedding `[block_size, n_embd]`.
    pub wpe: Tensor,
    dropout: f32,
}

impl Embed {
    /// `b.wte.weight` and `b.wpe.weight` (`b` is the `transformer` path).
    pub fn build(b: &Builder, cfg: &GptConfig) -> Result<Self> {
        Ok(Embed {
            wte: b.pp("wte").get(&[cfg.vocab_size, cfg.n_embd], "weight")?,
            wpe: b.pp("wpe").get(&[cfg.block_size, cfg.n_embd], "weight")?,
            dropout: cfg.dropout,
        })
    }

    /// The same embedding with its tables mapped by `f` (cast, copied to a device).
    pub fn map(
        &self,
        f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(Embed {
            wte: f(&self.wte)?,
            wpe: f(&self.wpe)?,
            dropout: self.dropout,
        })
    }

    /// Maps token ids `[B, T]` (u32) to the residual stream `[B, T, n_embd]`.
    pub fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let block_size = self.wpe.dim(0)?;
        if t > block_size {
            candle_core::bail!("sequence length {t} exceeds block_size {block_size}");
        }
        let wte = self.wte.to_dtype(ctx.dtype)?;
        let tok = wte.embedding(&idx.flatten_all()?)?.reshape((b, t, ()))?;
        let pos = self.wpe.narrow(0, 0, t)?.to_dtype(ctx.dtype)?;
        let x = tok.broadcast_add(&pos)?;
        ctx.kernels.dropout(&x, self.dropout, ctx, 0)
    }
}

/// Causal multi-head self-attention (`attn.c_attn`, `attn.c_proj`).
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    /// Fused q, k, v projection, Conv1D `[n_embd, 3 n_embd]`.
    pub c_attn: Conv1D,
    /// Output projection, Conv1D `[n_embd, n_embd]`.
    pub c_proj: Conv1D,
    n_head: usize,
    dropout: f32,
    site: u64,
}

impl CausalSelfAttention {
    /// `[B, T, C] -> [B, T, C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let qkv = self.c_attn.forward_ctx(x, ctx)?;
        let y = ctx
            .kernels
            .causal_attention(&qkv, self.n_head, self.dropout, ctx, self.site)?;
        let y = self.c_proj.forward_ctx(&y, ctx)?;
        ctx.kernels.dropout(&y, self.dropout, ctx, self.site + 1)
    }
}

/// The 4x feed-forward network with GELU (tanh approximation), `mlp.c_fc`, `mlp.c_proj`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Conv1D `[n_embd, 4 n_embd]`.
    pub c_fc: Conv1D,
    /// Conv1D `[4 n_embd, n_embd]`.
    pub c_proj: Conv1D,
    dropout: f32,
    site: u64,
}

impl Mlp {
    /// `[B, T, C] -> [B, T, C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let h = self.c_fc.forward_gelu(x, ctx)?;
        let y = self.c_proj.forward_ctx(&h, ctx)?;
        ctx.kernels.dropout(&y, self.dropout, ctx, self.site)
    }
}

/// A pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Clone, Debug)]
pub struct Block {
    /// LayerNorm before attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm,
    /// Feed-forward network.
    pub mlp: Mlp,
}

impl Block {
    /// Block `i` (`b` is the `transformer.h.{i}` path). Its dropout sites are `1 + 3i ..= 3 + 3i`
    /// (site 0 is the embedding's).
    pub fn build(b: &Builder, cfg: &GptConfig, i: usize) -> Result<Self> {
        let (c, bias) = (cfg.n_embd, cfg.bias);
        let site = 1 + 3 * i as u64;
        let (attn, mlp) = (b.pp("attn"), b.pp("mlp"));
        Ok(Block {
            ln_1: LayerNorm::build(&b.pp("ln_1"), c, bias, LN_EPS)?,
            attn: CausalSelfAttention {
                c_attn: Conv1D::build(&attn.pp("c_attn"), c, 3 * c, bias)?,
                c_proj: Conv1D::build(&attn.pp("c_proj"), c, c, bias)?,
                n_head: cfg.n_head,
                dropout: cfg.dropout,
                site,
            },
            ln_2: LayerNorm::build(&b.pp("ln_2"), c, bias, LN_EPS)?,
            mlp: Mlp {
                c_fc: Conv1D::build(&mlp.pp("c_fc"), c, 4 * c, bias)?,
                c_proj: Conv1D::build(&mlp.pp("c_proj"), 4 * c, c, bias)?,
                dropout: cfg.dropout,
                site: site + 2,
            },
        })
    }

    /// `[B, T, C] -> [B, T, C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln_1.forward_ctx(x, ctx)?, ctx)?)?;
        &x + self.mlp.forward(&self.ln_2.forward_ctx(&x, ctx)?, ctx)?
    }

    /// The same block with its weights mapped by `f` (cast, copied to a device).
    pub fn map(
        &self,
        f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(Block {
            ln_1: self.ln_1.map(f)?,
            attn: CausalSelfAttention {
                c_attn: self.attn.c_attn.map(f)?,
                c_proj: self.attn.c_proj.map(f)?,
                ..self.attn.clone()
            },
            ln_2: self.ln_2.map(f)?,
            mlp: Mlp {
                c_fc: self.mlp.c_fc.map(f)?,
                c_proj: self.mlp.c_proj.map(f)?,
                ..self.mlp.clone()
            },
        })
    }

    fn weights(&self) -> Vec<Tensor> {
        self.ln_1
            .weights()
            .chain(self.attn.c_attn.weights())
            .chain(self.attn.c_proj.weights())
            .chain(self.ln_2.weights())
            .chain(self.mlp.c_fc.weights())
            .chain(self.mlp.c_proj.weights())
            .cloned()
            .collect()
    }
}

/// Final LayerNorm and the language-model head, tied to the token embedding.
#[derive(Clone, Debug)]
pub struct Head {
    /// `transformer.ln_f`.
    pub ln_f: LayerNorm,
    /// The token embedding `[vocab_size, n_embd]` (tied weights: `lm_head.weight == wte`).
    pub wte: Tensor,
}

impl Head {
    /// `b.ln_f` over the tied embedding `wte` (`b` is the `transformer` path).
    pub fn build(b: &Builder, cfg: &GptConfig, wte: Tensor) -> Result<Self> {
        Ok(Head {
            ln_f: LayerNorm::build(&b.pp("ln_f"), cfg.n_embd, cfg.bias, LN_EPS)?,
            wte,
        })
    }

    /// The same head with its weights mapped by `f` (cast, copied to a device).
    pub fn map(
        &self,
        f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(Head {
            ln_f: self.ln_f.map(f)?,
            wte: f(&self.wte)?,
        })
    }

    /// `[B, T, C] -> logits [B, T, vocab_size]` in f32 (f64 when computing in f64).
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let x = self.ln_f.forward_ctx(x, ctx)?;
        let w = self.wte.to_dtype(ctx.dtype)?;
        let logits = ctx.kernels.linear(&x, &w.t()?, None)?;
        logits.to_dtype(stat_dtype(logits.dtype()))
    }
}

/// One link of the model's chain `embed -> blocks -> head`: the unit that remat plans
/// checkpoint and pipeline stages are cut from.
#[derive(Clone, Debug)]
pub enum Link {
    /// Token ids `[B, T]` to the residual stream.
    Embed(Embed),
    /// A transformer block, `[B, T, C] -> [B, T, C]`.
    Block(Block),
    /// The residual stream to logits.
    Head(Head),
}

impl Link {
    /// Runs the link.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        match self {
            Link::Embed(e) => e.forward(x, ctx),
            Link::Block(b) => b.forward(x, ctx),
            Link::Head(h) => h.forward(x, ctx),
        }
    }

    /// The weights the link reads (the tied embedding is read by the embedding and the head,
    /// and listed by both). [`Params::vars_of`] maps them to the parameters.
    pub fn weights(&self) -> Vec<Tensor> {
        match self {
            Link::Embed(e) => vec![e.wte.clone(), e.wpe.clone()],
            Link::Block(b) => b.weights(),
            Link::Head(h) => h.ln_f.weights().chain([&h.wte]).cloned().collect(),
        }
    }

    /// The same link with its weights mapped by `f` (e.g. cast to a dtype or copied to a
    /// device, differentiably).
    pub fn map(
        &self,
        f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Link> {
        Ok(match self {
            Link::Embed(e) => Link::Embed(e.map(f)?),
            Link::Block(b) => Link::Block(b.map(f)?),
            Link::Head(h) => Link::Head(h.map(f)?),
        })
    }

    /// Whether the link is a transformer block (what activation checkpointing plans over).
    pub fn is_block(&self) -> bool {
        matches!(self, Link::Block(_))
    }
}

/// A GPT-2 language model.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use trainer::model::{Ctx, Gpt, GptConfig};
/// let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, dropout: 0.1, ..GptConfig::default() };
/// let (model, params) = Gpt::new(&cfg, 42, &Device::Cpu)?;
/// let idx = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
/// let logits = model.forward(&idx, &Ctx::train(7))?;
/// assert_eq!(logits.dims(), &[2, 3, 11]);
/// let loss = trainer::model::cross_entropy(&logits, &idx, None)?;
/// let grads = loss.backward()?;
/// assert!(params.iter().all(|(_, v)| grads.get(v).is_some()));
/// // The chain: embedding, 2 blocks, head; each link knows the parameters it reads.
/// let links = model.links();
/// assert_eq!(links.len(), 4);
/// assert_eq!(params.vars_of(&links[0].weights()).len(), 2); // wte, wpe
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Gpt {
    /// The model's hyper-parameters.
    pub config: GptConfig,
    /// Embeddings (first link of the chain).
    pub embed: Embed,
    /// Transformer blocks (`transformer.h.{i}`).
    pub blocks: Vec<Block>,
    /// Final LayerNorm and tied head (last link of the chain).
    pub head: Head,
}

impl Gpt {
    /// Creates a freshly initialised model (GPT-2 initialisation, seeded: the same seed gives
    /// the same weights on every device) and its parameters.
    pub fn new(config: &GptConfig, seed: u64, device: &Device) -> Result<(Self, Params)> {
        config.validate()?;
        let params = Params::init_gpt(config, seed, device)?;
        let model = Self::from_params(config, &params)?;
        Ok((model, params))
    }

    /// Builds the model's structure, taking every tensor from `b` by its Hugging Face name
    /// (`transformer.h.{i}.attn.c_attn.weight`, ...), derived from the structure itself.
    pub fn build(config: &GptConfig, b: &Builder) -> Result<Self> {
        let t = b.pp("transformer");
        let embed = Embed::build(&t, config)?;
        let blocks = (0..config.n_layer)
            .map(|i| Block::build(&t.pp("h").pp(i), config, i))
            .collect::<Result<Vec<_>>>()?;
        let head = Head::build(&t, config, embed.wte.clone())?;
        Ok(Gpt {
            config: config.clone(),
            embed,
            blocks,
            head,
        })
    }

    /// Builds the model over existing parameters (which must have the HF names and shapes
    /// for `config`; see [`Params::check_gpt`]).
    pub fn from_params(config: &GptConfig, params: &Params) -> Result<Self> {
        config.validate()?;
        params.check_gpt(config)?;
        Self::build(config, &Builder::root(&|name, _| params.tensor(name)))
    }

    /// The chain: the embedding, every block, the head (clones of the handles).
    pub fn links(&self) -> Vec<Link> {
        std::iter::once(Link::Embed(self.embed.clone()))
            .chain(self.blocks.iter().cloned().map(Link::Block))
            .chain([Link::Head(self.head.clone())])
            .collect()
    }

    /// The model with every weight cast to `dtype` (differentiably: gradients flow back to the
    /// original, e.g. f32 master, weights). The trainer calls this once per step, so the
    /// forward and a remat recompute use the cast weights instead of casting at every use.
    /// Free (a clone of the handles) when the weights already have `dtype`.
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Self> {
        let cast = |t: &Tensor| t.to_dtype(dtype);
        // The tied embedding is cast once per link (embed, head): each link owns its cast, so
        // the two gradient contributions reach the f32 weight as two f32 terms, in the same
        // order in a plain backward and in a remat tape's separate passes (bit-identical).
        Ok(Gpt {
            config: self.config.clone(),
            embed: self.embed.map(&cast)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| b.map(&cast))
                .collect::<candle_core::Result<_>>()?,
            head: self.head.map(&cast)?,
        })
    }

    /// Token ids `[B, T]` (u32, `T <= block_size`) to logits `[B, T, vocab_size]` (f32).
    pub fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.links()
            .iter()
            .try_fold(idx.clone(), |x, link| link.forward(&x, ctx))
    }
}

/// Mean cross-entropy of `logits [B, T, V]` against `targets [B, T]` (u32), computed in at
/// least f32, with the fused kernel (see [`Kernels::cross_entropy`] for the choice).
///
/// With a `mask [B, T]` (1.0 where the target counts, 0.0 elsewhere) the mean runs over the
/// counted positions only; an all-zero mask gives 0.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    Kernels::Fused.cross_entropy(logits, targets, mask)
}

impl Module for Gpt {
    fn forward(&self, idx: &Tensor) -> candle_core::Result<Tensor> {
        Gpt::forward(self, idx, &Ctx::eval())
    }
}
