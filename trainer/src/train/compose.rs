//! How the trainer composes the toolkit's libraries: activation checkpointing
//! (`candle-remat`) and mixed precision (`candle-amp`), chosen by config flags.

use candle_amp::{Amp, MasterWeights, WeightMode};
use candle_core::DType;
use candle_remat::{BlockCost, ChainCosts, Plan, Policy};

use crate::config::{Parallelism, TrainConfig};
use crate::model::{GptConfig, Kernels, Params};
use crate::{Error, Result};

/// Estimated costs of the GPT's block chain for one micro-batch, for the planner: the bytes
/// Candle keeps alive for a block's backward, its output, and a relative compute cost
/// proportional to its FLOPs.
///
/// Counted from the ops in [`crate::model::Block`]. Reference kernels: about 16 `[B, T, C]`
/// tensors incl. the 4x MLP, and 3-4 `[B, H, T, T]` attention tensors (scores, mask-add and
/// softmax in f32, a dropout mask). Fused kernels: about 14 `[B, T, C]` tensors (LayerNorm
/// inputs and outputs, qkv, attention output, the MLP's pre- and post-GELU activations,
/// residuals) plus the attention's log-sum-exp, `[B, H, T]` f32; dropout masks are
/// regenerated, not stored.
pub fn gpt_chain_costs(
    cfg: &GptConfig,
    batch: usize,
    dtype: DType,
    kernels: Kernels,
) -> ChainCosts {
    let (b, t, c, h) = (
        batch as u64,
        cfg.block_size as u64,
        cfg.n_embd as u64,
        cfg.n_head as u64,
    );
    let size = dtype.size_in_bytes() as u64;
    let btc = b * t * c * size;
    let act = match kernels {
        Kernels::Reference => {
            let att = b * h * t * t * 4; // scores, mask-add and softmax run in f32
            let dropout_att = if cfg.dropout > 0.0 {
                b * h * t * t * size
            } else {
                0
            };
            16 * btc + 3 * att + dropout_att
        }
        Kernels::Fused => 14 * btc + b * h * t * 4,
    };
    let flops = 24 * b * t * c * c + 4 * b * t * t * c;
    let block = BlockCost {
        act_bytes: act,
        out_bytes: btc,
        fwd_ns: flops / 1000 + 1,
    };
    ChainCosts::uniform(cfg.n_layer, block)
}

/// The checkpoint plan for this run, or `None` for plain backward.
///
/// Costs are counted at the run's context (`config.block_size`), which may be shorter than
/// the model's positions (`gpt.block_size`) when fine-tuning a pretrained model.
pub fn remat_plan(config: &TrainConfig, gpt: &GptConfig, dtype: DType) -> Result<Option<Plan>> {
    let policy = config.remat;
    if policy == Policy::None {
        return Ok(None);
    }
    // Activations are sized by the training context, which may be shorter than the model's
    // positions (fine-tuning a pretrained model on short blocks).
    let train = GptConfig {
        block_size: config.block_size,
        ..gpt.clone()
    };
    let costs = gpt_chain_costs(&train, config.batch_size, dtype, config.kernels);
    let plan = policy
        .plan(&costs)
        .map_err(|e| Error::Config(format!("remat `{policy}`: {e}")))?;
    tracing::info!("activation checkpointing plan:\n{plan}");
    Ok(Some(plan))
}

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
    gpt: &GptConfig,
    dtype: DType,
    plan: Option<&Plan>,
) -> u64 {
    let n_params = gpt.num_params() as u64;
    let cast_copy = if dtype == DType::F32 {
        0
    } else {
        n_params * dtype.size_in_bytes() as u64
    };
    let train = GptConfig {
        block_size: config.block_size,
        ..gpt.clone()
    };
    let all_blocks = |rows: usize| {
        let costs = gpt_chain_costs(&train, rows, dtype, config.kernels);
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
        .saturating_mul(gpt.vocab_size as u64)
        .saturating_mul(4 * 2);
    (n_params * 4 * 4 + cast_copy)
        .saturating_add(activations)
        .saturating_add(logits)
}

/// Errors if the estimate of [`estimate_step_bytes`] exceeds the memory available to this
/// process (RAM, or the cgroup's limit in a container). Only checked on the CPU.
pub fn check_memory_fits(config: &TrainConfig, estimate: u64) -> Result<()> {
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
         {} layers of width {}) but only {:.1} GiB of memory is available: lower batch_size or \
         block_size, or use --remat",
        gib(estimate),
        config.batch_size,
        config.block_size,
        config.n_layer,
        config.n_embd,
        gib(available)
    )))
}

/// The loss scaler over the model's f32 parameters (the masters), for every precision: a no-op
/// scaler in f32 (and bf16 by default), dynamic scaling for f16 by default, as `loss_scale`
/// says. Clipping at `grad_clip` is part of its step.
///
/// The model casts each master weight at use (`WeightMode::Cast`), so the optimiser's state
/// stays in f32 and gradients arrive in f32 through `to_dtype`'s backward.
pub fn build_amp(config: &TrainConfig, params: &Params) -> Result<Amp> {
    let named = params.iter().map(|(n, v)| (n.clone(), v.clone()));
    let weights = MasterWeights::new(named, config.dtype.dtype(), WeightMode::Cast)?;
    let clip = (config.grad_clip > 0.0).then_some(config.grad_clip as f64);
    let amp = Amp::new(weights, config.loss_scale.scaler(config.dtype))?.with_clip_norm(clip)?;
    Ok(amp)
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
