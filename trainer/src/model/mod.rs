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
mod layers;
mod params;

use candle_core::{DType, Device, Module, Tensor, D};

pub use config::GptConfig;
pub use layers::{causal_mask, dropout, stat_dtype, Conv1D, LayerNorm};
pub use params::Params;

use crate::Result;

/// LayerNorm epsilon of GPT-2.
pub const LN_EPS: f64 = 1e-5;

/// Per-call forward context: training mode, dropout seed and compute dtype.
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
}

impl Ctx {
    /// Evaluation: no dropout, f32.
    pub fn eval() -> Self {
        Ctx {
            train: false,
            seed: 0,
            dtype: DType::F32,
        }
    }

    /// Training with dropout seeded by `seed`, f32.
    pub fn train(seed: u64) -> Self {
        Ctx {
            train: true,
            seed,
            dtype: DType::F32,
        }
    }

    /// The same context with another compute dtype.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Ctx { dtype, ..self }
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
        dropout(&x, self.dropout, ctx, 0)
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
        let (b, t, c) = x.dims3()?;
        let hd = c / self.n_head;
        let qkv = self.c_attn.forward_ctx(x, ctx)?;
        let heads = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(D::Minus1, i * c, c)?
                .reshape((b, t, self.n_head, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let sd = stat_dtype(att.dtype());
        let att = att
            .to_dtype(sd)?
            .broadcast_add(&causal_mask(t, x.device())?.to_dtype(sd)?)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?.to_dtype(ctx.dtype)?;
        let att = dropout(&att, self.dropout, ctx, self.site)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        let y = self.c_proj.forward_ctx(&y, ctx)?;
        dropout(&y, self.dropout, ctx, self.site + 1)
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
        let h = self.c_fc.forward_ctx(x, ctx)?.gelu()?;
        let y = self.c_proj.forward_ctx(&h, ctx)?;
        dropout(&y, self.dropout, ctx, self.site)
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
        let logits = x.broadcast_matmul(&w.t()?)?;
        logits.to_dtype(stat_dtype(logits.dtype()))
    }
}

/// A GPT-2 language model.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use trainer::model::{Ctx, Gpt, GptConfig};
/// let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, dropout: 0.1, bias: true };
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
/// least f32.
///
/// With a `mask [B, T]` (1.0 where the target counts, 0.0 elsewhere) the mean runs over the
/// counted positions only.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let v = logits.dim(D::Minus1)?;
    let logits = logits
        .to_dtype(stat_dtype(logits.dtype()))?
        .reshape(((), v))?;
    let targets = targets.flatten_all()?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let nll = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
    match mask {
        None => nll.mean_all(),
        Some(mask) => {
            let mask = mask.flatten_all()?.to_dtype(logp.dtype())?;
            // An all-zero mask gives loss 0 (and zero gradients), not 0/0.
            let count = mask.sum_all()?.maximum(1.0)?;
            (nll * &mask)?.sum_all()?.broadcast_div(&count)
        }
    }
}

impl Module for Gpt {
    fn forward(&self, idx: &Tensor) -> candle_core::Result<Tensor> {
        Gpt::forward(self, idx, &Ctx::eval())
    }
}
