//! What a training step needs in memory, estimated from the configuration alone (before
//! anything is allocated), and the refusal of runs that cannot fit.

use std::cell::RefCell;

use candle_core::{DType, Device, Tensor};
use candle_fused::nf4::{Nf4Weight, BLOCK, NESTED_BLOCK};
use candle_remat::{Plan, Policy};

use super::pipeline::ExecutorSettings;
use crate::config::{Parallelism, TargetModules};
use crate::load::sized_floor;
use crate::lora::Nf4Settings;
use crate::model::{Builder, ModelConfig};
use crate::Result;

/// What the memory estimate reads of the run config (`From<&TrainConfig>`): how a step
/// executes, what it trains (adapters) and the optimiser that keeps state.
#[derive(Clone, Debug)]
pub struct MemorySettings {
    /// How a step executes: its sizes, precision, remat and pipeline.
    pub(crate) run: ExecutorSettings,
    /// The adapters' rank; 0 for full training.
    pub(crate) lora_r: usize,
    /// The layers the adapters wrap.
    pub(crate) lora_targets: TargetModules,
    /// Bytes of state the run's optimiser holds per parameter element
    /// ([`crate::optim::state_bytes_per_param`]).
    pub(crate) optimizer_state_bytes: usize,
    /// A LoRA run's base held in 4 bits: which linear layers, with double quantization or not.
    pub(crate) nf4: Option<Nf4Settings>,
}

/// Estimated peak bytes of one training step: f32 weights, gradients and the optimiser's state
/// ([`trained_bytes_per_param`])
/// (plus a compute-dtype copy of the weights in mixed precision; a LoRA run's frozen base
/// only its f32 weights), the activations of one
/// micro-batch as the remat planner models them (`plan`'s predicted peak, or every block's
/// activations without checkpointing; with pipeline stages, the microbatches a stage holds at
/// once, or nothing when stages recompute), and the f32 logits with their gradient.
///
/// A lower bound more than a prediction: it is used to refuse runs that cannot fit (e.g. a
/// `block_size` of 100000) before they allocate, not to size runs that can.
pub fn estimate_step_bytes(
    config: &MemorySettings,
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
        let costs = model.chain_costs(rows, config.run.block_size, dtype, config.run.kernels);
        costs
            .blocks
            .iter()
            .map(|b| b.act_bytes)
            .fold(costs.input_bytes, u64::saturating_add)
    };
    let activations = match (plan, config.run.parallelism.clone()) {
        (Some(p), _) => p.predicted_peak_bytes,
        // Stages recompute their blocks: at least nothing (a lower bound).
        (None, Parallelism::Pipeline { .. }) if config.run.remat != Policy::None => 0,
        // Every block holds up to min(microbatches, stages) microbatches at once (1F1B's
        // first worker; GPipe holds more).
        (
            None,
            Parallelism::Pipeline {
                stages,
                microbatches,
                ..
            },
        ) => all_blocks(config.run.batch_size.div_ceil(microbatches))
            .saturating_mul(microbatches.min(stages) as u64),
        (None, Parallelism::None) => all_blocks(config.run.batch_size),
    };
    let tokens = (config.run.batch_size as u64).saturating_mul(config.run.block_size as u64);
    let logits = tokens
        .saturating_mul(model.vocab_size() as u64)
        .saturating_mul(4 * 2);
    // A LoRA run's base is frozen: read in f32 (then cast), or held in 4 bits, with no
    // gradient and no optimiser state (the adapters' are small).
    let weights = match config.lora_r > 0 {
        true => {
            frozen_base_bytes(config, model).saturating_add(adapter_bytes(config, model, dtype))
        }
        false => n_params
            .saturating_mul(trained_bytes_per_param(config))
            .saturating_add(cast_copy),
    };
    weights.saturating_add(activations).saturating_add(logits)
}

/// Bytes of a LoRA run's frozen base: 4 (f32) per parameter, except in the linear layers a
/// 4-bit base holds (`config.nf4`), which hold their codes and absmaxes ([`nf4_bytes`]).
pub(crate) fn frozen_base_bytes(config: &MemorySettings, model: &dyn ModelConfig) -> u64 {
    let n_params = model.num_params() as u64;
    let Some(nf4) = &config.nf4 else {
        return n_params.saturating_mul(4);
    };
    let quantized: Vec<u64> = linear_layers(model)
        .into_iter()
        .filter(|(path, _)| !nf4.skips(path))
        .map(|(_, n)| n)
        .collect();
    let plain = n_params.saturating_sub(quantized.iter().sum());
    quantized
        .iter()
        .map(|&n| nf4_bytes(n, nf4.double))
        .fold(plain.saturating_mul(4), u64::saturating_add)
}

/// Bytes of a weight of `n` values in NF4 as bitsandbytes stores it: two codes a byte, an f32
/// absmax per block of 64, or with double quantization a u8 code per block, an f32 absmax per
/// 256 of them and the 256-entry f32 map.
pub(crate) fn nf4_bytes(n: u64, double: bool) -> u64 {
    let blocks = n.div_ceil(BLOCK as u64);
    let absmax = match double {
        false => blocks * 4,
        true => blocks + blocks.div_ceil(NESTED_BLOCK as u64) * 4 + 256 * 4,
    };
    n.div_ceil(2) + absmax
}

/// Every linear layer of `model` with its number of weight values, by module path: found by
/// building it over stand-ins that allocate nothing.
fn linear_layers(model: &dyn ModelConfig) -> Vec<(String, u64)> {
    let found = RefCell::new(Vec::new());
    let record =
        |path: &str, fan_in: usize, fan_out: usize| -> candle_models::Result<Option<Nf4Weight>> {
            found
                .borrow_mut()
                .push((path.to_string(), (fan_in * fan_out) as u64));
            Ok(None)
        };
    let stand_in = |_: &str, shape: &[usize]| -> candle_models::Result<Tensor> {
        Ok(Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(shape)?)
    };
    match model.build(&Builder::root(&stand_in).with_quant(&record)) {
        Ok(_) => found.into_inner(),
        Err(_) => Vec::new(), // a lower bound: counted as f32
    }
}

/// Bytes a trained parameter element holds: its f32 weight and gradient, and the state of the
/// config's optimiser ([`crate::optim::state_bytes_per_param`]).
pub fn trained_bytes_per_param(config: &MemorySettings) -> u64 {
    4 + 4 + config.optimizer_state_bytes as u64
}

/// A LoRA run's adapters (`lora_r` per targeted linear layer, taken as `n_embd` in and out):
/// their f32 weights, gradients and optimiser state, and the activations of one micro-batch
/// they add (see `trainer/tests/lora_memory.rs` for how close this comes to a measured run).
fn adapter_bytes(config: &MemorySettings, model: &dyn ModelConfig, dtype: DType) -> u64 {
    if config.lora_r == 0 {
        return 0;
    }
    let shape = model.shape();
    let targets = match &config.lora_targets {
        TargetModules::Names(names) => names.len().clamp(1, 7),
        TargetModules::Regex(_) => 1,
        TargetModules::AllLinear => 7, // q, k, v, o, gate, up, down
    } as u64;
    let per_layer = (config.lora_r as u64).saturating_mul(targets);
    let params = per_layer
        .saturating_mul(2 * shape.n_embd as u64)
        .saturating_mul(shape.n_layer as u64);
    // Each adapted layer keeps, per token, `A x` (lora_r wide) and its `B A x` and scaled
    // copy (out wide) for the backward, besides the base layer's own output.
    let tokens = (config.run.batch_size as u64).saturating_mul(config.run.block_size as u64);
    let acts = (targets * shape.n_layer as u64)
        .saturating_mul(tokens)
        .saturating_mul((config.lora_r as u64).saturating_add(2 * shape.n_embd as u64))
        .saturating_mul(dtype.size_in_bytes() as u64);
    params
        .saturating_mul(trained_bytes_per_param(config))
        .saturating_add(acts)
}

/// What a step needs at the least, from the config's sizes alone (layers, width, vocabulary,
/// batch, block, adapters) in O(1) time and memory: each layer's overhead and norms, the
/// token embedding, the logits and their gradient, the adapters. Checked before anything
/// proportional to a size is built (the parameter list, the cost table, the remat plan).
pub(crate) fn floor_bytes(config: &MemorySettings, model: &dyn ModelConfig, dtype: DType) -> u64 {
    // A frozen LoRA base holds its f32 weights; full training adds gradients and the
    // optimiser's state.
    let per_param: u64 = if config.lora_r > 0 {
        4
    } else {
        trained_bytes_per_param(config)
    };
    let tokens = (config.run.batch_size as u64).saturating_mul(config.run.block_size as u64);
    let logits = tokens
        .saturating_mul(model.vocab_size() as u64)
        .saturating_mul(8);
    sized_floor(model, per_param)
        .saturating_add(logits)
        .saturating_add(adapter_bytes(config, model, dtype))
}

/// Refuses a run whose step cannot fit in the memory available to this process (RAM, or the
/// cgroup's limit in a container), from the configurations alone: called before the model is
/// allocated, on every path that builds one for training (fresh, `--init-from`, resume). Only
/// checked on the CPU (a GPU reports its own out-of-memory errors; the CPU allocator aborts the
/// process).
pub(crate) fn check_run_fits(
    config: &MemorySettings,
    model: &dyn ModelConfig,
    device: &Device,
) -> Result<()> {
    if !device.is_cpu() {
        return Ok(());
    }
    let dtype = config.run.dtype;
    let what = format!(
        "this run ({}, batch_size {} x block_size {}) per step",
        model.describe(),
        config.run.batch_size,
        config.run.block_size
    );
    let advice = "lower batch_size, block_size or lora_r, or use --remat";
    // The sizes first, in O(1): what comes next builds tables of one entry per layer.
    crate::load::check_fits(floor_bytes(config, model, dtype), &what, advice)?;
    let plan = match config.run.parallelism {
        Parallelism::Pipeline { .. } => None, // stages plan their own blocks
        Parallelism::None => super::executor::remat_plan(&config.run, model, dtype)?,
    };
    let need = estimate_step_bytes(config, model, dtype, plan.as_ref())
        .max(floor_bytes(config, model, dtype));
    Ok(crate::load::check_fits(need, &what, advice)?)
}

/// [`check_run_fits`] for a model being loaded for the run (`load::Checks::train`): over a
/// base saved in 4 bits (`saved_4bit`: `Some(double quantization)`), the step holds it so.
pub(crate) fn check_loaded_fits(
    config: &MemorySettings,
    model: &dyn ModelConfig,
    device: &Device,
    saved_4bit: Option<bool>,
) -> Result<()> {
    let mut settings = config.clone();
    if let Some(double) = saved_4bit {
        settings.nf4 = Some(Nf4Settings {
            double,
            ..Default::default()
        });
    }
    check_run_fits(&settings, model, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;

    #[test]
    fn pipeline_stages_hold_fewer_activations() {
        let config = TrainConfig {
            n_layer: 8,
            block_size: 256,
            batch_size: 32,
            ..TrainConfig::default()
        };
        let gpt = config.gpt_config(64);
        let est = |c: &TrainConfig| estimate_step_bytes(&c.into(), &gpt, DType::F32, None);
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

    #[test]
    fn a_4bit_base_counts_its_codes_and_absmaxes() {
        // A fresh Llama of 2 layers, 64 wide, vocabulary 128 (its head tied to the embedding):
        // 7 projections a layer in 4 bits, the embedding and norms in f32.
        let config = TrainConfig {
            arch: "llama".parse().unwrap(),
            n_layer: 2,
            n_embd: 64,
            n_head: 4,
            lora_r: 4,
            ..TrainConfig::default()
        };
        let llama = config.model_config(128).unwrap();
        let layers = linear_layers(llama.as_ref());
        let projections: u64 = layers
            .iter()
            .filter(|(p, _)| p != crate::lora::OUTPUT_HEAD)
            .map(|(_, n)| n)
            .sum();
        assert_eq!(layers.len(), 2 * 7, "{layers:?}");
        let n = llama.num_params() as u64;
        let base = |nf4: Option<Nf4Settings>| {
            let settings = MemorySettings {
                nf4,
                ..MemorySettings::from(&config)
            };
            frozen_base_bytes(&settings, llama.as_ref())
        };
        assert_eq!(base(None), 4 * n);
        // Plain: half a byte a value and an f32 per 64 values (4.5 bits a value).
        let q = |double| {
            Some(Nf4Settings {
                double,
                ..Nf4Settings::default()
            })
        };
        let each = |f: &dyn Fn(u64) -> u64| -> u64 {
            layers
                .iter()
                .filter(|(p, _)| p != crate::lora::OUTPUT_HEAD)
                .map(|(_, n)| f(*n))
                .sum()
        };
        let plain = 4 * (n - projections) + each(&|v| v / 2 + v / 64 * 4);
        assert_eq!(base(q(false)), plain);
        // Double: a byte per block, an f32 per 256 blocks and the 1 KiB map, per weight.
        let double =
            4 * (n - projections) + each(&|v| v / 2 + v / 64 + (v / 64).div_ceil(256) * 4 + 1024);
        assert_eq!(base(q(true)), double);
        assert!(base(q(false)) < base(None) / 2);
    }
}
