//! Stages: the unit of model a pipeline worker runs, and adapters from a plain layer chain.

use std::sync::Arc;

use candle_core::{Module, Result as CResult, Tensor, Var};

/// One (virtual) pipeline stage: a differentiable function of its input activation, with the
/// parameters it owns.
///
/// `forward` runs on the worker that hosts the stage; its parameters must live on that worker's
/// device. The loss is not part of the stage: the pipeline's loss function is evaluated on the
/// worker that hosts the last stage.
pub trait Stage: Send + Sync {
    /// Forward pass of the stage. Must be built from differentiable Candle ops.
    fn forward(&self, x: &Tensor) -> CResult<Tensor>;
    /// The parameters of the stage. Only gradients of these are kept in the returned `GradStore`.
    fn vars(&self) -> Vec<Var>;
}

impl<S: Stage + ?Sized> Stage for Box<S> {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        (**self).forward(x)
    }
    fn vars(&self) -> Vec<Var> {
        (**self).vars()
    }
}

impl<S: Stage + ?Sized> Stage for Arc<S> {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        (**self).forward(x)
    }
    fn vars(&self) -> Vec<Var> {
        (**self).vars()
    }
}

type LayerFn = dyn Fn(&Tensor) -> CResult<Tensor> + Send + Sync;

/// One link of a sequential model (embedding, block, head ...) with its parameters.
#[derive(Clone)]
pub struct Layer {
    f: Arc<LayerFn>,
    vars: Vec<Var>,
}

impl std::fmt::Debug for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layer")
            .field("vars", &self.vars.len())
            .field("params", &self.num_params())
            .finish()
    }
}

impl Layer {
    /// A layer from a closure, e.g. `Layer::new(vars, move |x| block.forward(x))`.
    pub fn new<F>(vars: Vec<Var>, f: F) -> Self
    where
        F: Fn(&Tensor) -> CResult<Tensor> + Send + Sync + 'static,
    {
        Self {
            f: Arc::new(f),
            vars,
        }
    }

    /// A layer from any Candle [`Module`].
    pub fn from_module<M: Module + Send + Sync + 'static>(module: M, vars: Vec<Var>) -> Self {
        Self::new(vars, move |x| module.forward(x))
    }

    /// Runs the layer.
    pub fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        (self.f)(x)
    }

    /// The parameters of the layer.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }
}

/// A stage made of consecutive [`Layer`]s, applied in order.
#[derive(Clone, Debug, Default)]
pub struct Sequential {
    layers: Vec<Layer>,
}

impl Sequential {
    /// A stage running `layers` one after the other.
    pub fn new(layers: Vec<Layer>) -> Self {
        Self { layers }
    }

    /// The layers of the stage.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }
}

impl Stage for Sequential {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }
    /// The layers' variables, each once (a weight shared by two layers of the stage, e.g. a
    /// tied embedding, must not have its gradient counted twice).
    fn vars(&self) -> Vec<Var> {
        let mut seen = std::collections::HashSet::new();
        self.layers
            .iter()
            .flat_map(|l| l.vars.iter().cloned())
            .filter(|v| seen.insert(v.id()))
            .collect()
    }
}

/// Hook wrapping the forward pass of a stage, e.g. to recompute activations in backward
/// (GPipe-style rematerialisation) with a checkpointing crate such as `candle-remat`, without
/// this crate depending on it.
///
/// The hook receives the plain forward function of the stage and the input, and must return a
/// tensor whose gradient with respect to the input and the stage parameters equals that of
/// `forward(x)`.
pub trait ForwardHook: Send + Sync {
    /// Runs `forward` on `x`, possibly wrapped (checkpointed, profiled, cast, ...).
    fn run(&self, forward: &dyn Fn(&Tensor) -> CResult<Tensor>, x: &Tensor) -> CResult<Tensor>;
}

impl<F> ForwardHook for F
where
    F: Fn(&dyn Fn(&Tensor) -> CResult<Tensor>, &Tensor) -> CResult<Tensor> + Send + Sync,
{
    fn run(&self, forward: &dyn Fn(&Tensor) -> CResult<Tensor>, x: &Tensor) -> CResult<Tensor> {
        self(forward, x)
    }
}

/// A stage whose forward pass goes through a [`ForwardHook`].
pub struct Hooked<S> {
    stage: S,
    hook: Arc<dyn ForwardHook>,
}

impl<S: Stage> Hooked<S> {
    /// Wraps `stage` so that its forward runs as `hook.run(|x| stage.forward(x), x)`.
    pub fn new(stage: S, hook: Arc<dyn ForwardHook>) -> Self {
        Self { stage, hook }
    }

    /// The wrapped stage.
    pub fn inner(&self) -> &S {
        &self.stage
    }
}

impl<S: Stage> Stage for Hooked<S> {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        self.hook.run(&|x| self.stage.forward(x), x)
    }
    fn vars(&self) -> Vec<Var> {
        self.stage.vars()
    }
}

/// The variables of a `VarMap` whose name starts with `prefix`, sorted by name
/// (`VarMap::all_vars` has no stable order).
pub fn vars_with_prefix(varmap: &candle_nn::VarMap, prefix: &str) -> Vec<Var> {
    let data = varmap.data().lock();
    let mut named: Vec<(String, Var)> = match data {
        Ok(map) => map
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        Err(poisoned) => poisoned
            .into_inner()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    };
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, v)| v).collect()
}
