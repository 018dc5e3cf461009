//! Direct preference optimisation: the losses of TRL's `DPOTrainer` (`sigmoid`, `ipo`,
//! `robust`) over preference pairs, each pair a chosen row followed by its rejected row.

use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

use candle_core::{DType, Tensor, D};

use super::{HeadOutput, Objective};
use crate::config::RunKeys;
use crate::data::Batch;
use crate::model::{run_links, Ctx, Model, IGNORE};
use crate::{Error, Result};

/// Which DPO loss ([`Dpo`]), as TRL's `loss_type` names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DpoLoss {
    /// `-log σ(β Δ)`, Δ the chosen minus the rejected log-ratio (the DPO paper's loss).
    #[default]
    Sigmoid,
    /// `(Δ' - 1/(2β))²`, Δ' the difference of the log-ratios averaged over each
    /// completion's tokens (IPO; TRL averages, as here).
    Ipo,
    /// `(-(1-ε) log σ(β Δ) + ε log σ(-β Δ)) / (1 - 2ε)`: robust DPO, ε the label smoothing.
    Robust,
}

impl FromStr for DpoLoss {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sigmoid" => Ok(DpoLoss::Sigmoid),
            "ipo" => Ok(DpoLoss::Ipo),
            "robust" => Ok(DpoLoss::Robust),
            _ => Err(Error::Config(format!(
                "dpo loss `{s}` is not known (known: sigmoid, ipo, robust)"
            ))),
        }
    }
}

impl fmt::Display for DpoLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DpoLoss::Sigmoid => "sigmoid",
            DpoLoss::Ipo => "ipo",
            DpoLoss::Robust => "robust",
        })
    }
}

/// Direct preference optimisation (TRL's `DPOTrainer` losses).
///
/// A batch holds pairs: row `2i` is pair `i`'s prompt + chosen completion, row `2i + 1` its
/// prompt + rejected completion, with the loss mask over the completion tokens only. A row's
/// log-probability is the sum of its counted targets' log-probabilities; the reference model's
/// (the base with the adapters off under LoRA, or values computed once before training) come
/// in [`Ctx::reference`] ([`reference_log_probs`]). The loss is the mean over the batch's
/// pairs; each row weighs half a pair, and a pair is never split ([`Objective::rows_per_group`]
/// is 2).
///
/// ```
/// use trainer::objective::{Dpo, DpoLoss, Objective};
/// let dpo = Dpo::new(DpoLoss::Robust, 0.1, 0.1)?;
/// assert_eq!((dpo.name(), dpo.rows_per_group()), ("dpo", 2));
/// assert!(Dpo::new(DpoLoss::Robust, 0.1, 0.5).is_err());
/// # Ok::<(), trainer::Error>(())
/// ```
#[derive(Debug)]
pub struct Dpo {
    loss: DpoLoss,
    beta: f64,
    label_smoothing: f64,
    /// Per-pair rewards and log-probabilities (`[4, P]`, detached) of the losses computed
    /// since the last [`Objective::take_metrics`].
    seen: Mutex<Vec<Tensor>>,
}

impl Default for Dpo {
    /// TRL's defaults: `sigmoid`, β 0.1, no label smoothing.
    fn default() -> Self {
        Dpo {
            loss: DpoLoss::Sigmoid,
            beta: 0.1,
            label_smoothing: 0.0,
            seen: Mutex::default(),
        }
    }
}

/// What [`Dpo::terms`] computes for a batch: the loss and each pair's log-probabilities and
/// rewards (`[P]` tensors, P pairs; the rewards detached), from which TRL's logged metrics come.
#[derive(Clone, Debug)]
pub struct DpoTerms {
    /// The mean loss over the pairs (differentiable).
    pub loss: Tensor,
    /// The policy's summed log-probability of each chosen completion.
    pub chosen_logps: Tensor,
    /// The policy's summed log-probability of each rejected completion.
    pub rejected_logps: Tensor,
    /// `β (log π(chosen) - log π_ref(chosen))`, detached.
    pub chosen_rewards: Tensor,
    /// `β (log π(rejected) - log π_ref(rejected))`, detached.
    pub rejected_rewards: Tensor,
}

impl DpoTerms {
    /// TRL's six logged metrics, the means over the pairs: `rewards/chosen`,
    /// `rewards/rejected`, `rewards/accuracies` (the share of pairs whose chosen reward is the
    /// larger), `rewards/margins`, `logps/chosen`, `logps/rejected` (one read back).
    pub fn metrics(&self) -> candle_core::Result<Vec<(&'static str, f64)>> {
        means(&self.stats()?)
    }

    /// The per-pair values the metrics are means of, `[4, P]`: chosen and rejected rewards
    /// and log-probabilities (detached).
    fn stats(&self) -> candle_core::Result<Tensor> {
        Tensor::stack(
            &[
                self.chosen_rewards.detach(),
                self.rejected_rewards.detach(),
                self.chosen_logps.detach(),
                self.rejected_logps.detach(),
            ],
            0,
        )
    }
}

/// [`DpoTerms::metrics`] of per-pair stats `[4, P]` (one read back).
fn means(stats: &Tensor) -> candle_core::Result<Vec<(&'static str, f64)>> {
    let s = stats.to_dtype(DType::F64)?;
    let row = |i| s.narrow(0, i, 1);
    let (c, r) = (row(0)?, row(1)?);
    let acc = c.gt(&r)?.to_dtype(DType::F64)?;
    let margins = (&c - &r)?;
    let all = Tensor::cat(&[c, r, acc, margins, row(2)?, row(3)?], 0)?.mean(1)?;
    let v = crate::transfer::read_vec1::<f64>(&all)?;
    Ok(DPO_METRICS.iter().copied().zip(v).collect())
}

/// The names of [`DpoTerms::metrics`], as TRL logs them.
pub const DPO_METRICS: [&str; 6] = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
];

impl Dpo {
    /// A DPO objective: `beta` > 0 (TRL's β); `label_smoothing` (ε) in `[0, 0.5)`, used by
    /// [`DpoLoss::Robust`] only (TRL's range; an error otherwise).
    pub fn new(loss: DpoLoss, beta: f64, label_smoothing: f64) -> Result<Self> {
        if !(beta.is_finite() && beta > 0.0) {
            return Err(Error::Config(format!(
                "dpo beta must be a number > 0, got {beta}"
            )));
        }
        if !(0.0..0.5).contains(&label_smoothing) {
            return Err(Error::Config(format!(
                "dpo label smoothing must lie in [0, 0.5), got {label_smoothing}"
            )));
        }
        Ok(Dpo {
            loss,
            beta,
            label_smoothing,
            seen: Mutex::default(),
        })
    }

    /// The run's DPO ([`super::build`]'s `dpo`): its keys `dpo_loss`, `dpo_beta` and
    /// `dpo_label_smoothing`, checked as [`Dpo::new`] does; it takes no `objective_options`.
    pub(crate) fn from_keys(run: &RunKeys) -> Result<Box<dyn Objective>> {
        let mut keys = run.part("objective_options", "dpo");
        let loss: String = keys.key("dpo_loss")?;
        let (beta, smoothing) = (keys.key("dpo_beta")?, keys.key("dpo_label_smoothing")?);
        keys.finish()?;
        Ok(Box::new(Dpo::new(loss.parse()?, beta, smoothing)?))
    }

    /// The loss kind.
    pub fn loss_kind(&self) -> DpoLoss {
        self.loss
    }

    /// The loss, the pairs' log-probabilities and rewards of the rows the head saw, against
    /// the reference values in the context ([`Ctx::reference`]; an error without them).
    pub fn terms(&self, out: &HeadOutput<'_>) -> candle_core::Result<DpoTerms> {
        let lp = out.token_log_probs()?;
        let (b, _) = lp.dims2()?;
        if b % 2 != 0 {
            candle_core::bail!("dpo: a batch of {b} rows does not hold whole pairs");
        }
        let Some(reference) = out.ctx().reference.as_ref() else {
            candle_core::bail!(
                "dpo needs the reference model's log-probabilities of the batch's rows \
                 (Ctx::reference), and none were given"
            )
        };
        let dtype = lp.dtype();
        let pairs = |t: &Tensor| t.reshape((b / 2, 2));
        let logps = pairs(&lp.sum(D::Minus1)?)?;
        let ref_logps = pairs(&reference.to_dtype(dtype)?.detach())?;
        let ratios = (&logps - &ref_logps)?;
        let (chosen, rejected) = (ratios.narrow(1, 0, 1)?, ratios.narrow(1, 1, 1)?);
        let delta = match self.loss {
            DpoLoss::Ipo => {
                // the log-ratios averaged over each completion's counted tokens
                let counted = out.targets().ne(IGNORE)?.to_dtype(dtype)?.sum(D::Minus1)?;
                let counted = pairs(&counted.maximum(1.0)?)?;
                let avg = (&ratios / counted)?;
                (avg.narrow(1, 0, 1)? - avg.narrow(1, 1, 1)?)?
            }
            _ => (&chosen - &rejected)?,
        };
        let beta = self.beta;
        let eps = self.label_smoothing;
        let per_pair = match self.loss {
            DpoLoss::Sigmoid => log_sigmoid(&delta.affine(beta, 0.0)?)?.neg()?,
            DpoLoss::Ipo => (delta - 1.0 / (2.0 * beta))?.sqr()?,
            DpoLoss::Robust => {
                let clean = log_sigmoid(&delta.affine(beta, 0.0)?)?.affine(-(1.0 - eps), 0.0)?;
                let flipped = log_sigmoid(&delta.affine(-beta, 0.0)?)?.affine(eps, 0.0)?;
                (clean + flipped)?.affine(1.0 / (1.0 - 2.0 * eps), 0.0)?
            }
        };
        let rewards = ratios.detach().affine(beta, 0.0)?;
        Ok(DpoTerms {
            loss: per_pair.mean_all()?,
            chosen_logps: logps.narrow(1, 0, 1)?.squeeze(1)?,
            rejected_logps: logps.narrow(1, 1, 1)?.squeeze(1)?,
            chosen_rewards: rewards.narrow(1, 0, 1)?.squeeze(1)?,
            rejected_rewards: rewards.narrow(1, 1, 1)?.squeeze(1)?,
        })
    }
}

/// `log σ(x) = min(x, 0) - log(1 + exp(-|x|))`, stable for large |x| (as torch's).
fn log_sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    let tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
    x.minimum(0.0)? - tail
}

impl Objective for Dpo {
    fn name(&self) -> &str {
        "dpo"
    }

    /// Half a pair a row: a batch weighs its pairs.
    fn row_units(&self, batch: &Batch) -> candle_core::Result<Vec<f64>> {
        Ok(vec![0.5; batch.x.dim(0)?])
    }

    fn rows_per_group(&self) -> usize {
        2
    }

    fn needs_reference(&self) -> bool {
        true
    }

    fn loss(&self, out: &HeadOutput<'_>) -> candle_core::Result<Tensor> {
        let terms = self.terms(out)?;
        let stats = terms.stats()?;
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(stats);
        Ok(terms.loss)
    }

    fn take_metrics(&self) -> candle_core::Result<Vec<(String, f64)>> {
        let seen = std::mem::take(&mut *self.seen.lock().unwrap_or_else(|e| e.into_inner()));
        if seen.is_empty() {
            return Ok(Vec::new());
        }
        let all = Tensor::cat(&seen, 1)?;
        Ok(means(&all)?
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect())
    }
}

/// The summed log-probability of each row's counted targets under `model` (`[B]`, detached):
/// the reference values [`Dpo`] reads from [`Ctx::reference`]. Under LoRA the reference is the
/// base: pass [`crate::lora::Tuning::without_adapters`]'s view and
/// [`Ctx::without_adapters`].
pub fn reference_log_probs(model: &dyn Model, batch: &Batch, ctx: &Ctx) -> Result<Tensor> {
    let links = model.links();
    let Some((head, body)) = links.split_last() else {
        return Err(Error::Config("a model needs at least one link".into()));
    };
    let h = run_links(body, &batch.x, ctx)?.detach();
    let targets = batch.targets()?;
    let lp = HeadOutput::new(head, &h, &targets, ctx).token_log_probs()?;
    Ok(lp.sum(D::Minus1)?.detach())
}
