//! The step's model in the compute dtype, cast once per step from the master weights.
//!
//! Cast differentiably (`w.to_dtype(bf16)`), every master weight gets a `ToDType` node whose
//! backward Candle runs as `zeros_like(w) + g.to_dtype(f32)`: an f32 buffer zero-filled and a
//! whole f32 add per weight and step, only to copy the cast gradient. Under the plain executor
//! the cast weights are leaves instead (`Var`s of their own), the backward stops at them, and
//! [`CastModel::to_masters`] casts their gradients to f32 onto the masters: the same values
//! without the zero fill and the add, and a step's gradients held in bf16 (half the bytes)
//! until the activations are freed. `0 + g` and `g` differ only in the sign of a zero
//! gradient, which nothing downstream can see (the gradient norm squares it; AdamW adds it to
//! a moment that is never `-0`, as `beta1 * m` is `-0` only when `m` is). Both casts, of the
//! weights and of their gradients, run on all threads (`candle_fused::cast`; Candle's
//! `to_dtype` runs on one), with `to_dtype`'s bits.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::cell::RefCell;

use crate::model::Model;

/// The model with its weights in the compute dtype, and the way their gradients go back to the
/// master weights.
pub(super) struct CastModel {
    model: Box<dyn Model>,
    /// `(master, cast)` for each weight cast to a leaf, in the order the model cast them (a
    /// tied weight may appear twice).
    leaves: Vec<(Tensor, Var)>,
}

impl CastModel {
    /// `model` with every weight in `dtype`: the master `Var`s whose dtype differs cast to
    /// leaves when `leaves` (the plain executor), otherwise cast differentiably
    /// ([`Model::to_dtype`]; an activation-checkpointing tape accumulates across segments on
    /// the masters, in f32).
    pub(super) fn new(model: &dyn Model, dtype: DType, leaves: bool) -> candle_core::Result<Self> {
        if !leaves {
            return Ok(CastModel {
                model: model.to_dtype(dtype)?,
                leaves: Vec::new(),
            });
        }
        let cast = RefCell::new(Vec::new());
        let model = model.map(&|w: &Tensor| {
            if w.dtype() == dtype || !w.is_variable() {
                return w.to_dtype(dtype);
            }
            let leaf = candle_fused::cast::cast_var(w, dtype)?;
            let t = leaf.as_tensor().clone();
            cast.borrow_mut().push((w.clone(), leaf));
            Ok(t)
        })?;
        Ok(CastModel {
            model,
            leaves: cast.into_inner(),
        })
    }

    /// The model in the compute dtype.
    pub(super) fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// Moves the gradients of the cast leaves in `grads` onto their master weights, cast to the
    /// masters' dtype (summed where a weight was cast twice: two terms, in either order the
    /// same bits, as Candle sums two `ToDType` backward terms).
    pub(super) fn to_masters(&self, grads: &mut GradStore) -> candle_core::Result<()> {
        for (master, leaf) in &self.leaves {
            let Some(g) = grads.remove(leaf.as_tensor()) else {
                continue;
            };
            let g = candle_fused::cast::cast(&g, master.dtype())?;
            let g = match grads.remove(master) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            grads.insert(master, g);
        }
        Ok(())
    }
}
