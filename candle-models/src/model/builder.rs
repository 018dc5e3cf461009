//! Parameter names derived from the model's structure, the way candle-nn's `VarBuilder::pp`
//! derives them: each module asks its [`Builder`] for its tensors by leaf name, and a parent
//! hands each child a builder one path component deeper (`transformer` -> `h` -> `3` ->
//! `attn` -> `c_attn` -> `weight`). Building, shape listing and loading all walk this one
//! structure ([`super::ModelConfig::build`]), so no name is assembled anywhere else.

use std::fmt::Display;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_fused::nf4::Nf4Weight;

use super::{Layout, LinearAdapter};
use crate::Result;

/// Where a module's tensors come from: `(full name, shape) -> tensor`.
pub(crate) type Source<'a> = &'a dyn Fn(&str, &[usize]) -> Result<Tensor>;

/// What runs the linear layer at a module path, `in` -> `out` features with its weight stored
/// as the [`Layout`] says, if anything (see [`Builder::with_wrap`]).
pub(crate) type Wrap<'a> =
    &'a dyn Fn(&str, usize, usize, Layout) -> Result<Option<Arc<dyn LinearAdapter>>>;

/// The frozen 4-bit weight of the linear layer at a module path, `in` -> `out` features, if
/// the base holds it quantized (see [`Builder::with_quant`]).
pub type Quant<'a> = &'a dyn Fn(&str, usize, usize) -> Result<Option<Nf4Weight>>;

/// A path in the parameter namespace, the source of its tensors and, optionally, what wraps
/// the linear layers built under it and which of them are 4-bit.
#[derive(Clone)]
pub struct Builder<'a> {
    prefix: String,
    source: Source<'a>,
    wrap: Option<Wrap<'a>>,
    quant: Option<Quant<'a>>,
    quant_compute: Option<DType>,
}

impl<'a> Builder<'a> {
    /// The root of the namespace.
    pub fn root(source: Source<'a>) -> Self {
        Builder {
            prefix: String::new(),
            source,
            wrap: None,
            quant: None,
            quant_compute: None,
        }
    }

    /// The same builder, asking `quant` for every linear layer it builds (by module path, in
    /// and out features) whether its weight is a frozen 4-bit one (QLoRA); such a layer reads
    /// no `weight` from the source.
    pub fn with_quant(self, quant: Quant<'a>) -> Self {
        Builder {
            quant: Some(quant),
            ..self
        }
    }

    /// The same builder, its 4-bit layers dequantizing into `dtype` and computing in it
    /// (bitsandbytes' `bnb_4bit_compute_dtype`) instead of the context's dtype.
    pub fn with_quant_compute(self, dtype: Option<DType>) -> Self {
        Builder {
            quant_compute: dtype,
            ..self
        }
    }

    /// The dtype the 4-bit layers compute in, if not the context's.
    pub fn quant_compute(&self) -> Option<DType> {
        self.quant_compute
    }

    /// The 4-bit weight of the linear layer `fan_in -> fan_out` at this path, if any.
    pub fn quant(&self, fan_in: usize, fan_out: usize) -> Result<Option<Nf4Weight>> {
        self.quant
            .map_or(Ok(None), |q| q(&self.prefix, fan_in, fan_out))
    }

    /// The same builder, asking `wrap` for every linear layer it builds (by module path,
    /// `model.layers.0.self_attn.q_proj`, its in and out features and its weight's layout)
    /// whether an adapter runs it.
    pub fn with_wrap(self, wrap: Wrap<'a>) -> Self {
        Builder {
            wrap: Some(wrap),
            ..self
        }
    }

    /// The adapter that runs the linear layer `fan_in -> fan_out` (stored as `layout` says)
    /// at this path, if any.
    pub fn wrap(
        &self,
        fan_in: usize,
        fan_out: usize,
        layout: Layout,
    ) -> Result<Option<Arc<dyn LinearAdapter>>> {
        self.wrap
            .map_or(Ok(None), |w| w(&self.prefix, fan_in, fan_out, layout))
    }

    /// The builder one component deeper (`pp` as in "push prefix").
    pub fn pp(&self, component: impl Display) -> Self {
        let prefix = if self.prefix.is_empty() {
            component.to_string()
        } else {
            format!("{}.{component}", self.prefix)
        };
        Builder {
            prefix,
            source: self.source,
            wrap: self.wrap,
            quant: self.quant,
            quant_compute: self.quant_compute,
        }
    }

    /// This builder's path (`transformer.h.3.attn`; empty at the root).
    pub fn path(&self) -> &str {
        &self.prefix
    }

    /// The tensor `leaf` of this path, of `shape`.
    pub fn get(&self, shape: &[usize], leaf: &str) -> Result<Tensor> {
        (self.source)(&self.pp(leaf).prefix, shape)
    }

    /// The tensor `leaf` if `present` (an optional bias).
    pub fn get_if(&self, present: bool, shape: &[usize], leaf: &str) -> Result<Option<Tensor>> {
        present.then(|| self.get(shape, leaf)).transpose()
    }
}
