//! A GPT-2 language model, written as a chain `embed -> blocks -> head` of plain structs.
//!
//! The names and layouts of the parameters are those of Hugging Face's `GPT2LMHeadModel`
//! (`transformer.h.{i}.attn.c_attn.weight` is a Conv1D weight of shape `[in, out]`), so a real
//! GPT-2 `model.safetensors` loads without renaming (see [`crate::checkpoint`]).
//!
//! Every operation has a backward in Candle: LayerNorm and softmax are written from primitive ops
//! because Candle's fused `layer_norm` / `softmax_last_dim` return detached outputs. Dropout draws
//! its masks from a seeded host RNG ([`Ctx`]) so that training is reproducible on every device and
//! a recomputed block (activation checkpointing) sees the same masks as the forward pass.

mod config;
mod kernels;
mod layers;
mod params;

use candle_core::{DType, Device, Module, Tensor};

pub use config::{GptConfig, GPT2_ENDOFTEXT};
pub use kernels::Kernels;
pub use layers::{causal_mask, chacha_dropout, dropout, stat_dtype, Conv1D, LayerNorm};
pub use params::Params;

use crate::Result;

/// LayerNorm epsilon of GPT-2.
pub const LN_EPS: f64 = 1e-5;

/// Per-call forward context: training mode, dropout seed, compute dtype and kernels.
///
/// Dropout masks are a pure function of `(seed, site)`, where the site is fixed per dropout
/// location in the network. The trainer derives `seed` from the run seed and the step, so a run
/// is reproducible, a resumed run needs no RNG state for dropout, and a recomputed block gets
/// the same masks.
#[derive(Clone, Copy, Debug)]
pub struct Ctx {
    /// Apply dropout (training) or not (evaluation).
    pub train: bool,
    /// Seed of this forward pass's dropout masks.
    pub seed: u64,
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
            dtype: DType::F32,
            kernels: Kernels::Fused,
        }
    }

    /// Training with dropout seeded by `seed`, f32.
    pub fn train(seed: u64) -> Self {
        Ctx {
            train: true,
            seed,
            dtype: DType::F32,
            kernels: Kernels::Fused,
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
    /// `[B, T, C] -> [B, T, C]`.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln_1.forward_ctx(x, ctx)?, ctx)?)?;
        &x + self.mlp.forward(&self.ln_2.forward_ctx(&x, ctx)?, ctx)?
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
    /// `[B, T, C] -> logits [B, T, vocab_size]` in f32 (f64 when computing in f64).
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let x = self.ln_f.forward_ctx(x, ctx)?;
        let w = self.wte.to_dtype(ctx.dtype)?;
        let logits = ctx.kernels.linear(&x, &w.t()?, None)?;
        logits.to_dtype(stat_dtype(logits.dtype()))
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

    /// Builds the model over existing parameters (which must have the HF names and shapes
    /// for `config`; see [`Params::check_gpt`]).
    pub fn from_params(config: &GptConfig, params: &Params) -> Result<Self> {
        config.validate()?;
        params.check_gpt(config)?;
        let p = |name: &str| params.tensor(name);
        let ln = |prefix: &str| -> Result<LayerNorm> {
            Ok(LayerNorm::new(
                p(&format!("{prefix}.weight"))?,
                if config.bias {
                    Some(p(&format!("{prefix}.bias"))?)
                } else {
                    None
                },
                LN_EPS,
            ))
        };
        let conv = |prefix: &str| -> Result<Conv1D> {
            Ok(Conv1D::new(
                p(&format!("{prefix}.weight"))?,
                if config.bias {
                    Some(p(&format!("{prefix}.bias"))?)
                } else {
                    None
                },
            ))
        };
        let wte = p("transformer.wte.weight")?;
        let embed = Embed {
            wte: wte.clone(),
            wpe: p("transformer.wpe.weight")?,
            dropout: config.dropout,
        };
        let mut blocks = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let h = format!("transformer.h.{i}");
            let site = 1 + 3 * i as u64;
            blocks.push(Block {
                ln_1: ln(&format!("{h}.ln_1"))?,
                attn: CausalSelfAttention {
                    c_attn: conv(&format!("{h}.attn.c_attn"))?,
                    c_proj: conv(&format!("{h}.attn.c_proj"))?,
                    n_head: config.n_head,
                    dropout: config.dropout,
                    site,
                },
                ln_2: ln(&format!("{h}.ln_2"))?,
                mlp: Mlp {
                    c_fc: conv(&format!("{h}.mlp.c_fc"))?,
                    c_proj: conv(&format!("{h}.mlp.c_proj"))?,
                    dropout: config.dropout,
                    site: site + 2,
                },
            });
        }
        let head = Head {
            ln_f: ln("transformer.ln_f")?,
            wte,
        };
        Ok(Gpt {
            config: config.clone(),
            embed,
            blocks,
            head,
        })
    }

    /// The model with every weight cast to `dtype` (differentiably: gradients flow back to the
    /// original, e.g. f32 master, weights). The trainer calls this once per step, so the
    /// forward and a remat recompute use the cast weights instead of casting at every use.
    /// Free (a clone of the handles) when the weights already have `dtype`.
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Self> {
        let ln = |l: &LayerNorm| -> candle_core::Result<LayerNorm> {
            Ok(LayerNorm::new(
                l.weight.to_dtype(dtype)?,
                l.bias.as_ref().map(|b| b.to_dtype(dtype)).transpose()?,
                l.eps(),
            ))
        };
        let conv = |c: &Conv1D| -> candle_core::Result<Conv1D> {
            Ok(Conv1D::new(
                c.weight.to_dtype(dtype)?,
                c.bias.as_ref().map(|b| b.to_dtype(dtype)).transpose()?,
            ))
        };
        // The tied embedding is cast once per link (embed, head): each link owns its cast, so
        // the two gradient contributions reach the f32 weight as two f32 terms, in the same
        // order in a plain backward and in a remat tape's separate passes (bit-identical).
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            blocks.push(Block {
                ln_1: ln(&b.ln_1)?,
                attn: CausalSelfAttention {
                    c_attn: conv(&b.attn.c_attn)?,
                    c_proj: conv(&b.attn.c_proj)?,
                    ..b.attn.clone()
                },
                ln_2: ln(&b.ln_2)?,
                mlp: Mlp {
                    c_fc: conv(&b.mlp.c_fc)?,
                    c_proj: conv(&b.mlp.c_proj)?,
                    ..b.mlp.clone()
                },
            });
        }
        Ok(Gpt {
            config: self.config.clone(),
            embed: Embed {
                wte: self.embed.wte.to_dtype(dtype)?,
                wpe: self.embed.wpe.to_dtype(dtype)?,
                dropout: self.embed.dropout,
            },
            blocks,
            head: Head {
                ln_f: ln(&self.head.ln_f)?,
                wte: self.head.wte.to_dtype(dtype)?,
            },
        })
    }

    /// Token ids `[B, T]` (u32, `T <= block_size`) to logits `[B, T, vocab_size]` (f32).
    pub fn forward(&self, idx: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let mut x = self.embed.forward(idx, ctx)?;
        for block in &self.blocks {
            x = block.forward(&x, ctx)?;
        }
        self.head.forward(&x, ctx)
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
