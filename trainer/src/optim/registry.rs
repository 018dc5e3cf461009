//! The optimisers a run can use (AdamW, the only one today).

use super::{AdamW, AdamWConfig, Optimizer};
use crate::model::{Kernels, Params};
use crate::Result;

/// The optimiser a run asks for, over `params`: AdamW with the hyper-parameters `adamw`
/// (a run's `TrainConfig::adamw_config`) on `kernels`.
pub fn build(adamw: AdamWConfig, kernels: Kernels, params: &Params) -> Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, adamw)?.with_kernels(kernels)))
}
