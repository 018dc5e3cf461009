//! The objectives a run can name: one line each in [`build`]'s table.

use super::{CrossEntropy, Dpo, Objective};
use crate::config::RunKeys;
use crate::{Error, Result};

/// How [`build`]'s table makes an objective: from the run's keys (the module reads and checks
/// the options it takes).
type Make = fn(&RunKeys) -> Result<Box<dyn Objective>>;

/// The objective the run's config (a [`TrainConfig`](crate::config::TrainConfig), or its
/// [`RunKeys`]) names (`objective`), with its options: `cross-entropy` (next-token
/// cross-entropy, [`CrossEntropy`]) or `dpo` ([`Dpo`], its `dpo_*` keys). An unknown name, or
/// options the objective does not take or refuses, is an error naming the key.
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
pub fn build(config: impl Into<RunKeys>) -> Result<Box<dyn Objective>> {
    // The registry: one line per objective.
    let known: &[(&str, Make)] = &[
        ("cross-entropy", CrossEntropy::from_keys),
        ("dpo", Dpo::from_keys),
    ];
    let run = config.into();
    let name: String = run.get("objective")?;
    match known.iter().find(|(n, _)| *n == name) {
        Some((_, make)) => make(&run),
        None => Err(Error::Config(format!(
            "objective `{name}` is not known (known: {})",
            known.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        ))),
    }
}
