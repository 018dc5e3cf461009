//! A model as one chain of links, `embed -> blocks -> head`: the unit every executor runs
//! (plain backward, activation-checkpointing plans, pipeline stages, data parallel).
//!
//! Each link owns its parameters; a link may also read a parameter another link owns only
//! when it declares it tied ([`LinkOps::tied`]; GPT-2's head reads the token embedding). The
//! executors never see an architecture: they call [`Link::forward`] on every link but the last
//! and [`Link::loss`] on the last, and map parameters through [`Link::weights`].

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::Ctx;

pub use candle_data::IGNORE;

/// A weight map: cast to a dtype, copy to a device (differentiably).
pub type WeightMap<'a> = &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>;

/// What a link of the chain is: activation checkpointing plans over the blocks; the head ends
/// the chain and computes the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Token ids `[B, T]` to the residual stream (the first link).
    Embed,
    /// A transformer block, `[B, T, C] -> [B, T, C]`.
    Block,
    /// The residual stream to logits, and to the loss (the last link).
    Head,
}

/// The loss of a batch's counted targets: their mean (a scalar tensor, differentiable; 0 when
/// none counts; the executors put their objective's loss here) and the targets.
///
/// Computing a loss reads nothing back from the device; [`Loss::count`] does, when asked.
#[derive(Clone, Debug)]
pub struct Loss {
    /// Mean loss over the counted targets, f32 (f64 when computing in f64).
    pub mean: Tensor,
    /// The targets the mean is over (u32; [`IGNORE`] where a target does not count).
    pub targets: Tensor,
}

impl Loss {
    /// Number of counted targets (those not [`IGNORE`]): one read back from the device.
    pub fn count(&self) -> candle_core::Result<usize> {
        count_targets(&self.targets)
    }

    /// The sum of the counted targets' losses (on the device: nothing is read back).
    pub fn sum(&self) -> candle_core::Result<Tensor> {
        let count = counted(&self.targets)?.to_dtype(self.mean.dtype())?;
        self.mean.broadcast_mul(&count)
    }
}

/// What an architecture implements for each kind of link.
pub trait LinkOps: Send + Sync + fmt::Debug {
    /// Runs the link (for the head: hidden states to logits, f32).
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor>;

    /// The parameters this link owns (in the order its structure declares them).
    fn params(&self) -> Vec<Tensor>;

    /// Parameters owned by another link that this link also reads (declared ties).
    fn tied(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// The same link with every weight (owned and tied) mapped by `f`.
    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinkOps>>;

    /// The head's loss of hidden states `h` against `targets` (u32, [`IGNORE`] where a target
    /// does not count). The default computes the logits and the cross-entropy; an
    /// architecture may chunk the projection and the loss instead.
    fn loss(&self, h: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Loss> {
        let logits = self.forward(h, ctx)?;
        let mean =
            ctx.kernels
                .cross_entropy_ignoring(&logits, ctx.targets(targets, targets), IGNORE)?;
        Ok(Loss {
            mean,
            targets: targets.clone(),
        })
    }

    /// The head's loss of each target (`[B, T]`, f32; f64 computing in f64), 0 where the
    /// target is [`IGNORE`]: the cross-entropy before the mean, differentiable for any
    /// upstream gradient. The default computes the whole logits; an architecture may chunk
    /// the projection and the loss instead.
    fn token_losses(&self, h: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        token_losses_of_logits(&self.forward(h, ctx)?, targets)
    }
}

/// The cross-entropy of each target of `logits` (`[.., V]`) against `targets` (`[..]` u32),
/// 0 where a target is [`IGNORE`], in the logits' dtype widened to at least f32.
pub(crate) fn token_losses_of_logits(
    logits: &Tensor,
    targets: &Tensor,
) -> candle_core::Result<Tensor> {
    let acc = match logits.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let v = logits.dim(candle_core::D::Minus1)?;
    let lf = logits.to_dtype(acc)?.reshape(((), v))?;
    let t = targets.flatten_all()?;
    let keep = t.ne(IGNORE)?;
    let t = keep.where_cond(&t, &t.zeros_like()?)?;
    let ls = candle_nn::ops::log_softmax(&lf, candle_core::D::Minus1)?;
    let nll = ls.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
    (nll * keep.to_dtype(acc)?)?.reshape(targets.shape())
}

/// The number of targets that count (are not [`IGNORE`]): one read back from the device.
pub(crate) fn count_targets(targets: &Tensor) -> candle_core::Result<usize> {
    let n: f32 = candle_data::transfer::read_scalar(&counted(targets)?)?;
    Ok(n as usize)
}

/// The number of targets that count, as an f32 scalar on their device.
fn counted(targets: &Tensor) -> candle_core::Result<Tensor> {
    targets.ne(IGNORE)?.to_dtype(DType::F32)?.sum_all()
}

/// One link of a model's chain: its role and its operations.
#[derive(Clone, Debug)]
pub struct Link {
    role: Role,
    ops: Arc<dyn LinkOps>,
}

impl Link {
    /// A link of `role` running `ops`.
    pub fn new(role: Role, ops: Arc<dyn LinkOps>) -> Self {
        Link { role, ops }
    }

    /// The link's role in the chain.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Whether the link is a transformer block (what activation checkpointing plans over).
    pub fn is_block(&self) -> bool {
        self.role == Role::Block
    }

    /// Runs the link.
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        self.ops.forward(x, ctx)
    }

    /// The head's loss (see [`LinkOps::loss`]); an error for other links.
    pub fn loss(&self, h: &Tensor, targets: &Tensor, ctx: &Ctx) -> candle_core::Result<Loss> {
        if self.role != Role::Head {
            candle_core::bail!(
                "the loss is computed by the head, not by a {:?} link",
                self.role
            );
        }
        self.ops.loss(h, targets, ctx)
    }

    /// The head's loss of each target (see [`LinkOps::token_losses`]); an error for other
    /// links.
    pub fn token_losses(
        &self,
        h: &Tensor,
        targets: &Tensor,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        if self.role != Role::Head {
            candle_core::bail!(
                "the loss is computed by the head, not by a {:?} link",
                self.role
            );
        }
        self.ops.token_losses(h, targets, ctx)
    }

    /// The parameters the link owns.
    pub fn params(&self) -> Vec<Tensor> {
        self.ops.params()
    }

    /// The parameters the link reads but another link owns (declared ties).
    pub fn tied(&self) -> Vec<Tensor> {
        self.ops.tied()
    }

    /// Every weight the link reads: owned, then tied. [`super::Params::vars_of`] maps them to
    /// the parameters; a tied parameter's gradient is the sum over the links that read it.
    pub fn weights(&self) -> Vec<Tensor> {
        let mut w = self.ops.params();
        w.extend(self.ops.tied());
        w
    }

    /// The same link with its weights mapped by `f` (e.g. cast to a dtype or copied to a
    /// device, differentiably).
    pub fn map(&self, f: WeightMap) -> candle_core::Result<Link> {
        Ok(Link {
            role: self.role,
            ops: self.ops.map(f)?,
        })
    }
}

/// The chain `embed -> blocks -> head` of a model built from those three kinds of link.
pub fn chain<E, B, H>(embed: &E, blocks: &[B], head: &H) -> Vec<Link>
where
    E: LinkOps + Clone + 'static,
    B: LinkOps + Clone + 'static,
    H: LinkOps + Clone + 'static,
{
    std::iter::once(Link::new(Role::Embed, Arc::new(embed.clone())))
        .chain(
            blocks
                .iter()
                .map(|b| Link::new(Role::Block, Arc::new(b.clone()))),
        )
        .chain([Link::new(Role::Head, Arc::new(head.clone()))])
        .collect()
}

/// Runs `links` in order (no loss).
pub fn run_links(links: &[Link], x: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
    links.iter().try_fold(x.clone(), |h, l| l.forward(&h, ctx))
}
