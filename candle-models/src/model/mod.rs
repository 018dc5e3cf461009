//! Models: the one interface the trainer knows ([`ModelConfig`], [`Model`], the chain of
//! [`Link`]s), the shared layers architectures are built from ([`layers`]) and the
//! architectures behind it ([`gpt2`], [`llama`], [`gemma3`]), one line each in the registry
//! ([`Arch`]).
//!
//! Adding an architecture: its module (config, `config.json` form, structure over the shared
//! layers, an [`Architecture`]), its `pub mod` line here and its line in the registry.
//!
//! A model is a chain `embed -> blocks -> head` of links, each owning its parameters (a tie,
//! such as GPT-2's head reading the token embedding, is declared). The plain forward,
//! activation-checkpointing plans, pipeline stages and data parallelism all run that one
//! list, and know nothing else of an architecture. Parameter names come from the structure
//! ([`Builder::pp`], as in candle-nn's `VarBuilder`): building, listing shapes and loading
//! walk the same code.
//!
//! Every operation has a backward: the ops come from `candle-fused` (or, with
//! `--kernels reference`, from its composite Candle expressions; Candle's own fused
//! `layer_norm` / `softmax_last_dim` return detached outputs). Dropout masks are a pure
//! function of a seed, a site and the element's index in the batch ([`Ctx`]), so training is
//! reproducible on every device and a recomputed block or a pipeline microbatch sees the same
//! masks as the plain forward pass.

/// [`LinkOps::params`] and [`LinkOps::map`] of a link that reads only its own weights: its
/// [`layers::Weights`] walk (inside an `impl LinkOps for ...`).
macro_rules! own_weights {
    () => {
        fn params(&self) -> Vec<candle_core::Tensor> {
            crate::model::layers::Weights::weights(self)
        }

        fn map(
            &self,
            f: crate::model::WeightMap,
        ) -> candle_core::Result<std::sync::Arc<dyn crate::model::LinkOps>> {
            Ok(std::sync::Arc::new(crate::model::layers::Weights::map(
                self, f,
            )?))
        }
    };
}

mod adapter;
mod arch;
mod builder;
mod chain;
mod ctx;
pub mod gemma3;
pub mod gpt2;
mod kernels;
pub mod layers;
mod linear;
pub mod llama;
mod params;
mod registry;

use candle_core::Tensor;

pub use adapter::{Layout, LinearAdapter};
pub use arch::{
    Architecture, CheckpointTensor, CloneConfig, Dims, KvCache, Model, ModelConfig, Shape,
    SpecialTokens,
};
pub use builder::{Builder, Quant};
pub use chain::{chain, run_links, Link, LinkOps, Loss, Role, WeightMap, IGNORE};
pub use ctx::{Ctx, HostTargets, HostTokens, Rows};
pub use kernels::Kernels;
pub(crate) use layers::LayerNorm;
pub use linear::Linear;
pub use params::Params;
pub use registry::{
    architecture, build, config_from_hf_json_file, init, register, Arch, MAX_LAYERS,
};

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
