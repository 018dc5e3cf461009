//! The optimisers a run can name (`optimizer = "adamw"`): one line each in [`build`]'s table.

use super::{AdamW, Optimizer, Sgd};
use crate::config::RunKeys;
use crate::model::Params;
use crate::{Error, Result};

/// How [`build`]'s table makes an optimiser: from the run's keys (the module reads and checks
/// the options it takes), over `params`.
type Make = fn(&RunKeys, &Params) -> Result<Box<dyn Optimizer>>;

/// The optimiser the run's config (a [`TrainConfig`](crate::config::TrainConfig), or its
/// [`RunKeys`]) names (`optimizer`), over `params`, with its options:
/// `adamw` ([`AdamW`]: `lr`, `beta1`, `beta2`, `weight_decay`, `kernels`) or `sgd` ([`Sgd`]:
/// `lr` and `optimizer_options`). An unknown name, or options the optimiser does not take or
/// refuses, is an error naming the key.
///
/// ```
/// use trainer::config::TrainConfig;
/// use trainer::model::Params;
/// let mut config = TrainConfig::default();
/// assert_eq!(trainer::optim::build(&config, &Params::default())?.name(), "adamw");
/// config.optimizer = "sgd".into();
/// config.optimizer_options = "momentum=0.9".parse().map_err(trainer::Error::Config)?;
/// assert_eq!(trainer::optim::build(&config, &Params::default())?.name(), "sgd");
/// config.optimizer = "lion".into();
/// let e = trainer::optim::build(&config, &Params::default()).err().unwrap().to_string();
/// assert!(e.contains("optimizer `lion`") && e.contains("adamw, sgd"), "{e}");
/// # Ok::<(), trainer::Error>(())
/// ```
pub fn build(config: impl Into<RunKeys>, params: &Params) -> Result<Box<dyn Optimizer>> {
    // The registry: one line per optimiser.
    let known: &[(&str, Make)] = &[("adamw", AdamW::from_keys), ("sgd", Sgd::from_keys)];
    let run = config.into();
    let name: String = run.get("optimizer")?;
    match known.iter().find(|(n, _)| *n == name) {
        Some((_, make)) => make(&run, params),
        None => Err(Error::Config(format!(
            "optimizer `{name}` is not known (known: {})",
            known.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Bytes of state the run's optimiser holds per parameter element (for the memory estimate):
/// asked of the one [`build`] makes over no parameters; 0 when it cannot be built (the run
/// refuses it when it builds it; the estimate is a lower bound).
pub fn state_bytes_per_param(config: impl Into<RunKeys>) -> usize {
    build(config, &Params::default()).map_or(0, |o| o.state_bytes_per_param())
}
