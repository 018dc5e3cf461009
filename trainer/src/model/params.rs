//! Named trainable parameters in a deterministic (sorted) order.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};

use candle_core::{DType, Device, Tensor, TensorId, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::{Builder, GptConfig};
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

    /// Names and shapes a GPT with `config` has, in sorted order: the names the model's
    /// structure asks for ([`Gpt::build`](super::Gpt::build)).
    pub fn gpt_shapes(config: &GptConfig) -> BTreeMap<String, Vec<usize>> {
        let shapes = RefCell::new(BTreeMap::new());
        let record = |name: &str, shape: &[usize]| -> Result<Tensor> {
            shapes.borrow_mut().insert(name.to_string(), shape.to_vec());
            // A stand-in that allocates nothing: only the names and shapes are wanted.
            Ok(Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(shape)?)
        };
        // Building only fails if the source does, and this one does not.
        if let Err(e) = super::Gpt::build(config, &Builder::root(&record)) {
            unreachable!("recording names and shapes cannot fail: {e}");
        }
        shapes.into_inner()
    }

    /// The variables whose tensors are among `weights` (e.g. a [`Link`](super::Link)'s
    /// weights), in sorted name order.
    pub fn vars_of(&self, weights: &[Tensor]) -> Vec<Var> {
        let ids: HashSet<TensorId> = weights.iter().map(|t| t.id()).collect();
        self.vars
            .values()
            .filter(|v| ids.contains(&v.as_tensor().id()))
            .cloned()
            .collect()
    }

    /// GPT-2 initialisation: weights ~ N(0, 0.02), residual projections (`c_proj`) scaled by
    /// `1/sqrt(2 n_layer)`, biases 0, LayerNorm scales 1. Numbers come from a ChaCha RNG seeded
    /// with `seed`, so the result is the same on every device.
    pub fn init_gpt(config: &GptConfig, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let proj_std = 0.02 / (2.0 * config.n_layer as f64).sqrt();
        let mut vars = BTreeMap::new();
        for (name, shape) in Self::gpt_shapes(config) {
            let n: usize = shape.iter().product();
            let is_ln = name.contains(".ln_");
            let data: Vec<f32> = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if is_ln {
                vec![1.0; n]
            } else {
                let std = if name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    0.02
                };
                let normal = Normal::new(0.0f32, std as f32)
                    .map_err(|e| Error::Config(format!("init std {std}: {e}")))?;
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            };
            let t = Tensor::from_vec(data, shape, device)?;
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Params { vars })
    }

    /// Checks that the parameters are exactly those of a GPT with `config` (names and shapes),
    /// listing what is missing, unexpected or mis-shaped.
    pub fn check_gpt(&self, config: &GptConfig) -> Result<()> {
        let want = Self::gpt_shapes(config);
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
