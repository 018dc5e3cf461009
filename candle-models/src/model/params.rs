//! Named trainable parameters in a deterministic (sorted) order.

use std::collections::{BTreeMap, HashMap, HashSet};

use candle_core::{DType, Device, Tensor, TensorId, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::{Link, ModelConfig};
use crate::{Error, Result};

/// Trainable parameters by Hugging Face name, iterated in sorted name order (unlike
/// `candle_nn::VarMap`, whose `HashMap` order changes between processes).
#[derive(Clone, Debug, Default)]
pub struct Params {
    vars: BTreeMap<String, Var>,
}

impl Params {
    /// Wraps named variables.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, Var)>) -> Self {
        Params {
            vars: vars.into_iter().collect(),
        }
    }

    /// Makes a variable of every tensor (copying it).
    pub fn from_tensors(tensors: impl IntoIterator<Item = (String, Tensor)>) -> Result<Self> {
        let mut vars = BTreeMap::new();
        for (name, t) in tensors {
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Params { vars })
    }

    /// The variable called `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    /// The tensor of the variable called `name`, or a checkpoint error naming it.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.vars
            .get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| Error::checkpoint("<params>", format!("missing parameter `{name}`")))
    }

    /// `(name, var)` in sorted name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter()
    }

    /// The variables in sorted name order.
    pub fn vars(&self) -> Vec<Var> {
        self.vars.values().cloned().collect()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// Copies every parameter into a new variable of `dtype` (e.g. f64 for gradient checks).
    pub fn to_dtype(&self, dtype: DType) -> Result<Params> {
        Params::from_tensors(
            self.vars
                .iter()
                .map(|(n, v)| v.as_tensor().to_dtype(dtype).map(|t| (n.clone(), t)))
                .collect::<candle_core::Result<Vec<_>>>()?,
        )
    }

    /// Total number of scalar parameters.
    pub fn num_elements(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum()
    }

    /// The variables whose tensors are among `weights` (e.g. a [`Link`]'s
    /// weights), in sorted name order.
    pub fn vars_of(&self, weights: &[Tensor]) -> Vec<Var> {
        let ids: HashSet<TensorId> = weights.iter().map(|t| t.id()).collect();
        self.vars
            .values()
            .filter(|v| ids.contains(&v.as_tensor().id()))
            .cloned()
            .collect()
    }

    /// Fresh parameters for `config`: [`ModelConfig::init`] over its parameters in sorted
    /// name order, from a ChaCha RNG seeded with `seed` (the same on every device).
    pub fn init(config: &dyn ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut vars = BTreeMap::new();
        for (name, shape) in config.shapes() {
            let data = config.init(&name, &shape, &mut rng)?;
            let t = Tensor::from_vec(data, shape, device)?;
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Params { vars })
    }

    /// Checks that every parameter is owned by exactly one link of `links`, and that every
    /// weight a link declares tied is owned by another link: no parameter is lost by a link
    /// list, a pipeline stage or a data-parallel bucket, and none is counted twice.
    pub fn check_ownership(&self, links: &[Link]) -> Result<()> {
        let mut owner: HashMap<TensorId, usize> = HashMap::new();
        let mut problems = Vec::new();
        let name_of = |id: TensorId| {
            self.vars
                .iter()
                .find(|(_, v)| v.as_tensor().id() == id)
                .map_or_else(|| "<not a parameter>".to_string(), |(n, _)| n.clone())
        };
        for (i, link) in links.iter().enumerate() {
            for w in link.params() {
                if let Some(j) = owner.insert(w.id(), i) {
                    problems.push(format!(
                        "`{}` is owned by links {j} and {i}",
                        name_of(w.id())
                    ));
                }
            }
        }
        for (i, link) in links.iter().enumerate() {
            for w in link.tied() {
                match owner.get(&w.id()) {
                    None => problems.push(format!(
                        "link {i} ties `{}`, which no link owns",
                        name_of(w.id())
                    )),
                    Some(&j) if j == i => problems.push(format!(
                        "link {i} ties `{}`, which it owns itself",
                        name_of(w.id())
                    )),
                    _ => {}
                }
            }
        }
        for (name, v) in &self.vars {
            if !owner.contains_key(&v.as_tensor().id()) {
                problems.push(format!("`{name}` is owned by no link"));
            }
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(Error::Config(format!(
            "the model's links do not partition its parameters: {}",
            problems.join("; ")
        )))
    }

    /// Checks that the parameters are exactly those of a model with `config` (names and
    /// shapes), listing what is missing, unexpected or mis-shaped.
    pub fn check(&self, config: &dyn ModelConfig) -> Result<()> {
        let want = config.shapes();
        let mut problems = Vec::new();
        for (name, shape) in &want {
            match self.vars.get(name) {
                None => problems.push(format!("missing `{name}`")),
                Some(v) if v.dims() != shape.as_slice() => problems.push(format!(
                    "`{name}` has shape {:?}, the config needs {:?}",
                    v.dims(),
                    shape
                )),
                _ => {}
            }
        }
        for name in self.vars.keys() {
            if !want.contains_key(name) {
                problems.push(format!("unexpected `{name}`"));
            }
        }
        if problems.is_empty() {
            return Ok(());
        }
        let n = problems.len();
        problems.truncate(5);
        let more = if n > 5 {
            format!(" (and {} more)", n - 5)
        } else {
            String::new()
        };
        Err(Error::checkpoint(
            "<params>",
            format!(
                "parameters do not match the model config: {}{more}",
                problems.join("; ")
            ),
        ))
    }
}

/// transformers' initial value of the parameter `name` of `shape`: 0 for a bias, 1 for a norm
/// scale (`scale`), else drawn from `N(0, std)` by `rng`.
pub(crate) fn init_values(
    name: &str,
    shape: &[usize],
    scale: bool,
    std: f32,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<f32>> {
    let n: usize = shape.iter().product();
    if name.ends_with(".bias") {
        return Ok(vec![0.0; n]);
    }
    if scale {
        return Ok(vec![1.0; n]);
    }
    let normal =
        Normal::new(0.0f32, std).map_err(|e| Error::Config(format!("init std {std}: {e}")))?;
    Ok((0..n).map(|_| normal.sample(rng)).collect())
}
