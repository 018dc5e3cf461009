//! The objectives a run can name: one line each in [`build`]'s table.

use super::{CrossEntropy, Dpo, Objective};
use crate::{Error, Result};

/// What a run says of its objective: the registered name and the options of the one it names
/// (a [`TrainConfig`](crate::config::TrainConfig) converts, from its `objective` and `dpo_*`
/// fields).
#[derive(Clone, Debug, PartialEq)]
pub struct ObjectiveConfig {
    /// The registered name (`cross-entropy`, `dpo`).
    pub name: String,
    /// `dpo`: the loss kind (`sigmoid`, `ipo`, `robust`).
    pub dpo_loss: String,
    /// `dpo`: β.
    pub dpo_beta: f64,
    /// `dpo`, `robust`: the assumed share of flipped labels.
    pub dpo_label_smoothing: f64,
}

/// How [`build`]'s table makes an objective.
type Make = fn(&ObjectiveConfig) -> Result<Box<dyn Objective>>;

/// The objective `config` names, with its options: `cross-entropy` (next-token cross-entropy,
/// [`CrossEntropy`]) or `dpo` ([`Dpo`], its `dpo_*` options). A run's config converts (its
/// `objective` and `dpo_*` fields).
///
/// ```
/// use trainer::config::TrainConfig;
/// let mut config = TrainConfig::default();
/// assert_eq!(trainer::objective::build(&config)?.name(), "cross-entropy");
/// config.objective = "dpo".into();
/// assert_eq!(trainer::objective::build(&config)?.rows_per_group(), 2);
/// config.objective = "ppo".into();
/// assert!(trainer::objective::build(&config).is_err());
/// # Ok::<(), trainer::Error>(())
/// ```
pub fn build(config: impl Into<ObjectiveConfig>) -> Result<Box<dyn Objective>> {
    let config = config.into();
    // The registry: one line per objective.
    let known: &[(&str, Make)] = &[
        ("cross-entropy", |_| Ok(Box::new(CrossEntropy))),
        ("dpo", |c| {
            let dpo = Dpo::new(c.dpo_loss.parse()?, c.dpo_beta, c.dpo_label_smoothing)?;
            Ok(Box::new(dpo))
        }),
    ];
    let name = config.name.as_str();
    match known.iter().find(|(n, _)| *n == name) {
        Some((_, make)) => make(&config),
        None => Err(Error::Config(format!(
            "objective `{name}` is not known (known: {})",
            known.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        ))),
    }
}
