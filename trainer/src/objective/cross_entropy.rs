//! Next-token cross-entropy: the trainer's default objective.

use candle_core::Tensor;

use super::{HeadOutput, Objective};
use crate::config::RunKeys;
use crate::data::Batch;

/// Next-token cross-entropy, the mean over the counted targets (those the loss mask keeps):
/// the head's fused loss ([`HeadOutput::mean_cross_entropy`]). A row's units are its counted
/// targets, so micro-batches, pipeline microbatches and data-parallel shards weigh their share
/// of the step's counted tokens and the step's loss is the token mean over all its rows.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use trainer::data::Batch;
/// use trainer::objective::{CrossEntropy, Objective};
/// let dev = Device::Cpu;
/// let x = Tensor::zeros((2, 3), candle_core::DType::U32, &dev)?;
/// let mask = Tensor::new(&[[1f32, 1., 0.], [0., 0., 1.]], &dev)?;
/// let batch = Batch::new(x.clone(), x).with_mask(Some(mask));
/// assert_eq!(CrossEntropy.row_units(&batch)?, [2.0, 1.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct CrossEntropy;

impl CrossEntropy {
    /// The run's cross-entropy ([`super::build`]'s `cross-entropy`): it takes no
    /// `objective_options`.
    pub(crate) fn from_keys(run: &RunKeys) -> crate::Result<Box<dyn Objective>> {
        run.part("objective_options", "cross-entropy").finish()?;
        Ok(Box::new(CrossEntropy))
    }
}

impl Objective for CrossEntropy {
    fn name(&self) -> &str {
        "cross-entropy"
    }

    fn row_units(&self, batch: &Batch) -> candle_core::Result<Vec<f64>> {
        Ok(batch.row_counts()?.into_iter().map(f64::from).collect())
    }

    fn loss(&self, out: &HeadOutput<'_>) -> candle_core::Result<Tensor> {
        out.mean_cross_entropy()
    }
}
