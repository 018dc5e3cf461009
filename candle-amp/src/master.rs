//! f32 master weights and their low-precision compute views.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{AmpError, Result};

/// How the model sees the master weights in the compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightMode {
    /// The model uses the f32 master `Var`s and casts them in its forward
    /// (`w.to_dtype(F16)`).
    /// `to_dtype`'s backward casts the gradient back, so gradients arrive on the masters in
    /// f32. Nothing to refresh; one cast per weight per forward.
    Cast,
    /// Separate compute `Var`s in the compute dtype (see
    /// [`MasterWeights::compute_varmap`]); gradients arrive on them and are upcast to f32
    /// for the optimiser; the copies are refreshed from the masters after every applied step.
    Copies,
}

/// One registered parameter.
#[derive(Debug, Clone)]
pub(crate) struct MasterParam {
    name: String,
    master: Var,
    compute: Option<Var>,
}

impl MasterParam {
    /// The registered name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The variable the model differentiates against.
    fn grad_key(&self) -> &Var {
        self.compute.as_ref().unwrap_or(&self.master)
    }
}

/// Named f32 master weights with an optional low-precision copy each.
///
/// ```
/// use candle_amp::{MasterWeights, WeightMode};
/// use candle_core::{DType, Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let w = Var::from_tensor(&Tensor::ones((2, 2), DType::F32, &dev)?)?;
/// let mw = MasterWeights::new([("w".to_string(), w)], DType::F16, WeightMode::Copies)?;
/// assert_eq!(mw.compute_var("w").unwrap().dtype(), DType::F16);
/// # Ok::<(), candle_amp::AmpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct MasterWeights {
    params: Vec<MasterParam>,
    compute_dtype: DType,
    mode: WeightMode,
}

impl MasterWeights {
    /// Registers named f32 master variables (order is kept and used in reports).
    ///
    /// Fails if a name repeats or a variable is not f32. In [`WeightMode::Copies`] a
    /// compute copy in `compute_dtype` is created for each (a real copy, also for f32).
    pub fn new(
        named: impl IntoIterator<Item = (String, Var)>,
        compute_dtype: DType,
        mode: WeightMode,
    ) -> Result<Self> {
        if !compute_dtype.is_float() {
            return Err(AmpError::Config(format!(
                "compute dtype {compute_dtype:?} is not a float type"
            )));
        }
        let mut seen = HashSet::new();
        let mut params = Vec::new();
        for (name, master) in named {
            if master.dtype() != DType::F32 {
                return Err(AmpError::Param {
                    name,
                    reason: format!("master weights must be f32, got {:?}", master.dtype()),
                });
            }
            if !seen.insert(name.clone()) {
                return Err(AmpError::Param {
                    name,
                    reason: "registered twice".into(),
                });
            }
            let compute = match mode {
                WeightMode::Cast => None,
                WeightMode::Copies => {
                    let t = master.as_tensor().detach().to_dtype(compute_dtype)?;
                    let t = if compute_dtype == DType::F32 {
                        t.copy()?
                    } else {
                        t
                    };
                    Some(Var::from_tensor(&t)?)
                }
            };
            params.push(MasterParam {
                name,
                master,
                compute,
            });
        }
        Ok(Self {
            params,
            compute_dtype,
            mode,
        })
    }

    /// Registers every variable of a `VarMap`, sorted by name (a `VarMap` iterates in
    /// `HashMap` order, which differs per process).
    pub fn from_varmap(varmap: &VarMap, compute_dtype: DType, mode: WeightMode) -> Result<Self> {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| AmpError::Config("VarMap mutex is poisoned".into()))?;
        let mut named: Vec<(String, Var)> =
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        drop(data);
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Self::new(named, compute_dtype, mode)
    }

    /// The registered parameters, in registration order.
    pub(crate) fn params(&self) -> &[MasterParam] {
        &self.params
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// True if no parameter is registered.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The compute dtype.
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// The weight mode.
    pub fn mode(&self) -> WeightMode {
        self.mode
    }

    /// The parameter names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(|p| p.name.as_str())
    }

    /// Clones of the f32 master variables, to build the optimiser with.
    pub fn master_vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.master.clone()).collect()
    }

    /// The master variable registered under `name`.
    pub fn master(&self, name: &str) -> Option<&Var> {
        self.find(name).map(|p| &p.master)
    }

    /// The compute copy registered under `name` ([`WeightMode::Copies`] only).
    pub fn compute_var(&self, name: &str) -> Option<&Var> {
        self.find(name).and_then(|p| p.compute.as_ref())
    }

    /// A `VarMap` holding the variables the model should be built from: the compute copies
    /// in [`WeightMode::Copies`], the masters in [`WeightMode::Cast`]. The variables are
    /// shared, not copied, so a `VarBuilder::from_varmap(&map, dtype, &device)` model trains
    /// the registered weights.
    pub fn compute_varmap(&self) -> Result<VarMap> {
        let map = VarMap::new();
        {
            let mut data = map
                .data()
                .lock()
                .map_err(|_| AmpError::Config("VarMap mutex is poisoned".into()))?;
            for p in &self.params {
                data.insert(p.name.clone(), p.grad_key().clone());
            }
        }
        Ok(map)
    }

    /// Copies the masters into the compute copies (no-op in [`WeightMode::Cast`]).
    /// Called by [`Amp::step`](crate::Amp::step) after every applied step; call it yourself
    /// after changing the masters by other means (e.g. loading a checkpoint).
    pub fn refresh(&self) -> Result<()> {
        for p in &self.params {
            if let Some(c) = &p.compute {
                c.set(&p.master.as_tensor().to_dtype(self.compute_dtype)?)?;
            }
        }
        Ok(())
    }

    /// The gradient of parameter `i` in a store produced by the model's backward.
    pub(crate) fn grad<'a>(&self, i: usize, grads: &'a GradStore) -> Option<&'a Tensor> {
        grads.get(self.params[i].grad_key())
    }

    /// The gradients of the compute copies ([`WeightMode::Copies`]) upcast to f32 and keyed
    /// by the masters, for the optimiser (the upcast is free for f32 copies).
    pub(crate) fn master_grads(&self, grads: &GradStore) -> Result<GradStore> {
        let mut out = GradStore::default();
        for (i, p) in self.params.iter().enumerate() {
            if let Some(g) = self.grad(i, grads) {
                out.insert(&p.master, g.to_dtype(DType::F32)?);
            }
        }
        Ok(out)
    }

    fn find(&self, name: &str) -> Option<&MasterParam> {
        self.params.iter().find(|p| p.name == name)
    }
}
