//! What a training step needs in memory, estimated from the configuration alone (before
//! anything is allocated), and the refusal of runs that cannot fit.

use candle_core::DType;
use candle_remat::{Plan, Policy};

use crate::config::{Parallelism, TrainConfig};
use crate::model::ModelConfig;
use crate::{Error, Result};

/// Estimated peak bytes of one training step: f32 weights, gradients and both AdamW moments
/// (plus a compute-dtype copy of the weights in mixed precision), the activations of one
/// micro-batch as the remat planner models them (`plan`'s predicted peak, or every block's
/// activations without checkpointing; with pipeline stages, the microbatches a stage holds at
/// once, or nothing when stages recompute), and the f32 logits with their gradient.
///
/// A lower bound more than a prediction: it is used to refuse runs that cannot fit (e.g. a
/// `block_size` of 100000) before they allocate, not to size runs that can.
pub fn estimate_step_bytes(
    config: &TrainConfig,
    model: &dyn ModelConfig,
    dtype: DType,
    plan: Option<&Plan>,
) -> u64 {
    let n_params = model.num_params() as u64;
    let cast_copy = if dtype == DType::F32 {
        0
    } else {
        n_params * dtype.size_in_bytes() as u64
    };
    let all_blocks = |rows: usize| {
        let costs = model.chain_costs(rows, config.block_size, dtype, config.kernels);
        costs
            .blocks
            .iter()
            .map(|b| b.act_bytes)
            .fold(costs.input_bytes, u64::saturating_add)
    };
    let activations = match (plan, config.parallelism()) {
        (Some(p), _) => p.predicted_peak_bytes,
        // Stages recompute their blocks: at least nothing (a lower bound).
        (None, Parallelism::Pipeline { .. }) if config.remat != Policy::None => 0,
        // Every block holds up to min(microbatches, stages) microbatches at once (1F1B's
        // first worker; GPipe holds more).
        (
            None,
            Parallelism::Pipeline {
                stages,
                microbatches,
                ..
            },
        ) => all_blocks(config.batch_size.div_ceil(microbatches))
            .saturating_mul(microbatches.min(stages) as u64),
        (None, Parallelism::None) => all_blocks(config.batch_size),
    };
    let tokens = (config.batch_size as u64).saturating_mul(config.block_size as u64);
    let logits = tokens
        .saturating_mul(model.vocab_size() as u64)
        .saturating_mul(4 * 2);
    (n_params * 4 * 4 + cast_copy)
        .saturating_add(activations)
        .saturating_add(logits)
}

/// Errors if the estimate of [`estimate_step_bytes`] exceeds the memory available to this
/// process (RAM, or the cgroup's limit in a container). Only checked on the CPU.
pub fn check_memory_fits(
    config: &TrainConfig,
    model: &dyn ModelConfig,
    estimate: u64,
) -> Result<()> {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    let sys = System::new_with_specifics(
        RefreshKind::nothing().with_memory(MemoryRefreshKind::nothing().with_ram()),
    );
    let mut available = sys.available_memory();
    if let Some(cg) = sys.cgroup_limits() {
        available = available.min(cg.free_memory);
    }
    if available == 0 || estimate <= available {
        return Ok(()); // unknown (0), or it fits
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    Err(Error::Config(format!(
        "this run needs at least an estimated {:.1} GiB per step (batch_size {} x block_size {}, \
         {}) but only {:.1} GiB of memory is available: lower batch_size or block_size, or use \
         --remat",
        gib(estimate),
        config.batch_size,
        config.block_size,
        model.describe(),
        gib(available)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_stages_hold_fewer_activations() {
        let config = TrainConfig {
            n_layer: 8,
            block_size: 256,
            batch_size: 32,
            ..TrainConfig::default()
        };
        let gpt = config.gpt_config(64);
        let est = |c: &TrainConfig| estimate_step_bytes(c, &gpt, DType::F32, None);
        let plain = est(&config);
        let piped = TrainConfig {
            pipeline_stages: 2,
            microbatches: 8,
            ..config.clone()
        };
        let recompute = TrainConfig {
            remat: Policy::EveryK(1),
            ..piped.clone()
        };
        let (p, r) = (est(&piped), est(&recompute));
        // 2 of 8 microbatches in flight: a quarter of the activations (plus the same weights
        // and logits); recomputing stages: none.
        assert!(r < p && p < plain, "{r} {p} {plain}");
        let acts = |x: u64| x - r;
        assert_eq!(acts(p) * 4, acts(plain));
    }
}
