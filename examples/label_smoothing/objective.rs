//! A custom objective: label-smoothed next-token cross-entropy, as PyTorch's
//! `CrossEntropyLoss(label_smoothing = eps)` (mean over the counted targets):
//!
//! ```text
//! loss = (1 - eps) ce + eps smooth,   smooth = mean over counted targets of -(1/V) Σ_j log p_j
//! ```
//!
//! `ce` is the head's own fused, chunked cross-entropy (the built-in objective's loss); the
//! smoothing term needs every class's log-probability, so it takes the whole logits. Rows
//! weigh their counted targets, as for the built-in cross-entropy. With `eps = 0` the loss,
//! its gradients and so a whole run are the built-in objective's bit for bit (`1 * ce` and
//! `ce + 0` are exact, and the smoothing term's gradients are exact zeros).

use candle_core::{Tensor, D};
use trainer::data::Batch;
use trainer::model::IGNORE;
use trainer::objective::{CrossEntropy, HeadOutput, Objective};

/// Label-smoothed cross-entropy with smoothing `eps` (in `[0, 1]`).
#[derive(Clone, Copy, Debug)]
pub struct LabelSmoothing {
    pub eps: f64,
}

impl Objective for LabelSmoothing {
    fn name(&self) -> &str {
        "label-smoothing"
    }

    fn row_units(&self, batch: &Batch) -> candle_core::Result<Vec<f64>> {
        CrossEntropy.row_units(batch)
    }

    fn loss(&self, out: &HeadOutput<'_>) -> candle_core::Result<Tensor> {
        let ce = out.mean_cross_entropy()?;
        let logits = out.logits()?;
        let v = logits.dim(D::Minus1)? as f64;
        // Σ_j log p_j of each position, summed over the counted ones
        let log_p = candle_nn::ops::log_softmax(&logits, D::Minus1)?.sum(D::Minus1)?;
        let counted = out.targets().ne(IGNORE)?.to_dtype(log_p.dtype())?;
        let n = counted.sum_all()?.maximum(1.0)?;
        let smooth = (log_p * counted)?
            .sum_all()?
            .div(&n)?
            .affine(-1.0 / v, 0.0)?;
        ce.affine(1.0 - self.eps, 0.0)? + smooth.affine(self.eps, 0.0)?
    }
}
