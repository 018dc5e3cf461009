//! A decoder model: its config and its chain `embed -> blocks -> head`, with the walk over
//! its weights and the cached forward written once for every architecture.

use candle_core::Tensor;

use super::super::{chain, Ctx, KvCache, Link, LinkOps, Model, ModelConfig, WeightMap};
use super::head::Head;
use super::{Cached, Weights};

/// A decoder-only language model: a config `C`, an embedding `E`, blocks `B` and a head
/// (the architectures name it: [`crate::model::gpt2::Gpt`], [`crate::model::llama::Llama`]).
#[derive(Clone, Debug)]
pub struct Decoder<C, E, B> {
    /// The model's hyper-parameters.
    pub config: C,
    pub(crate) embed: E,
    pub(crate) blocks: Vec<B>,
    pub(crate) head: Head,
}

impl<C: Clone, E: Weights, B: Weights> Weights for Decoder<C, E, B> {
    /// The embedding, every block, the head. Each link maps its own reads: a tied embedding
    /// is mapped once for the embedding and once for the head, so its two gradient
    /// contributions reach the f32 weight as two terms, in the same order in a plain backward
    /// and in a remat tape's separate passes.
    fn map(&self, f: WeightMap) -> candle_core::Result<Self> {
        Ok(Decoder {
            config: self.config.clone(),
            embed: self.embed.map(f)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| b.map(f))
                .collect::<candle_core::Result<Vec<_>>>()?,
            head: Weights::map(&self.head, f)?,
        })
    }
}

impl<C, E, B> Model for Decoder<C, E, B>
where
    C: ModelConfig + Clone + 'static,
    E: LinkOps + Weights + Cached + Clone + 'static,
    B: LinkOps + Weights + Cached + Clone + 'static,
{
    fn config(&self) -> &dyn ModelConfig {
        &self.config
    }

    fn links(&self) -> Vec<Link> {
        chain(&self.embed, &self.blocks, &self.head)
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Box<dyn Model>> {
        Ok(Box::new(Weights::map(self, f)?))
    }

    fn forward_cached(&self, idx: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let ctx = Ctx::eval().with_kernels(cache.kernels);
        let t = idx.dim(1)?;
        let mut x = self.embed.cached(idx, cache, &ctx)?;
        for b in &self.blocks {
            x = b.cached(&x, cache, &ctx)?;
        }
        cache.len += t;
        self.head.forward(&x, &ctx)
    }
}
