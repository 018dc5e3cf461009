//! How the trainer composes the toolkit's libraries: activation checkpointing
//! (`candle-remat`) and mixed precision (`candle-amp`), chosen by config flags.

use candle_amp::{Amp, MasterWeights, ScalerConfig, WeightMode};
use candle_core::DType;
use candle_remat::{BlockCost, ChainCosts, Plan, Policy};

use crate::config::TrainConfig;
use crate::model::{GptConfig, Kernels, Params};
use crate::{Error, Result};

/// Parses a byte count: `1048576`, `512KiB`, `64MiB`, `2GiB` (also `K`, `M`, `G`, `KB`, ...,
/// all powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| Error::Config(format!("`{s}` is not a byte count")))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(Error::Config(format!(
                "unknown byte unit `{other}` in `{s}`"
            )))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| Error::Config(format!("byte count `{s}` is too large")))
}

/// The checkpointing policy named by the `remat` config value: `none`, `all` (every block),
/// `every:K` (segments of K blocks), `sqrt` or `budget:BYTES` (e.g. `budget:256MiB`).
pub fn parse_remat(s: &str) -> Result<Policy> {
    let bad = || {
        Error::Config(format!(
            "remat must be none, all, every:K, sqrt or budget:BYTES, not `{s}`"
        ))
    };
    Ok(match s {
        "none" => Policy::None,
        "all" => Policy::EveryK(1),
        "sqrt" => Policy::SqrtN,
        _ => match s.split_once(':') {
            Some(("every", k)) => match k.parse::<usize>() {
                Ok(k) if k >= 1 => Policy::EveryK(k),
                _ => return Err(bad()),
            },
            Some(("budget", b)) => Policy::Budget(parse_bytes(b)?),
            _ => return Err(bad()),
        },
    })
}

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
    let policy = parse_remat(&config.remat)?;
    if policy == Policy::None {
        return Ok(None);
    }
    let at_context = GptConfig {
        block_size: config.block_size,
        ..gpt.clone()
    };
    let costs = gpt_chain_costs(&at_context, config.batch_size, dtype, config.kernels);
    let plan = policy
        .plan(&costs)
        .map_err(|e| Error::Config(format!("remat `{}`: {e}", config.remat)))?;
    tracing::info!("activation checkpointing plan:\n{plan}");
    Ok(Some(plan))
}

/// The compute dtype named by the `dtype` config value.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => Err(Error::Config(format!(
            "dtype must be f32, f16 or bf16, not `{other}`"
        ))),
    }
}

/// The loss scaler named by `loss_scale`: `auto` (dynamic for f16, none otherwise), `dynamic`,
/// `none`, or a number (static scale).
pub fn scaler_config(loss_scale: &str, dtype: DType) -> Result<ScalerConfig> {
    Ok(match loss_scale {
        "auto" if dtype == DType::F16 => ScalerConfig::dynamic(),
        "auto" | "none" => ScalerConfig::none(),
        "dynamic" => ScalerConfig::dynamic(),
        s => match s.parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => ScalerConfig::static_scale(v),
            _ => {
                return Err(Error::Config(format!(
                    "loss_scale must be auto, dynamic, none or a positive number, not `{s}`"
                )))
            }
        },
    })
}

/// Mixed precision over the model's f32 parameters (the masters), when `dtype` is f16/bf16.
///
/// The model casts each master weight at use (`WeightMode::Cast`), so the optimiser's state
/// stays in f32 and gradients arrive in f32 through `to_dtype`'s backward.
pub fn build_amp(config: &TrainConfig, params: &Params) -> Result<Option<Amp>> {
    let dtype = parse_dtype(&config.dtype)?;
    if dtype == DType::F32 {
        return Ok(None);
    }
    let named = params.iter().map(|(n, v)| (n.clone(), v.clone()));
    let weights = MasterWeights::new(named, dtype, WeightMode::Cast)?;
    let clip = (config.grad_clip > 0.0).then_some(config.grad_clip as f64);
    let amp = Amp::new(weights, scaler_config(&config.loss_scale, dtype)?)?.with_clip_norm(clip)?;
    Ok(Some(amp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flags() {
        assert_eq!(parse_bytes("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert!(parse_bytes("12 parsecs").is_err());
        assert_eq!(parse_remat("all").unwrap(), Policy::EveryK(1));
        assert_eq!(parse_remat("every:2").unwrap(), Policy::EveryK(2));
        assert_eq!(parse_remat("budget:1KiB").unwrap(), Policy::Budget(1024));
        assert!(parse_remat("every:0").is_err());
        assert!(parse_remat("some").is_err());
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert!(parse_dtype("f8").is_err());
        assert!(scaler_config("-1", DType::F16).is_err());
    }
}
