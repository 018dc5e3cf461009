//! Stages: the unit of model a pipeline worker runs, and adapters from a plain layer chain.

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Module, Result as CResult, Tensor, Var};

use crate::error::{PipelineError, Result};

/// Which forward call a stage is running: the microbatch, the (virtual) stage, the
/// microbatch's first row in the whole batch and the batch's key (see
/// [`Microbatches::with_key`](crate::Microbatches::with_key)).
///
/// A stage that draws random numbers (dropout) derives them from the call, so that a
/// microbatch's masks are the same in its forward and in a recompute, and, keyed by `row`, the
/// same rows of the mask the whole batch would draw in one process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Call {
    /// The microbatch.
    pub mb: usize,
    /// The (virtual) stage.
    pub stage: usize,
    /// Index of the microbatch's first row in the whole batch.
    pub row: usize,
    /// The batch's key (e.g. a dropout seed for this step), the same for every microbatch.
    pub key: u64,
}

/// Backward of a stage forward that does not keep its whole graph: given the scalar the
/// pipeline backpropagates (built on the stage output), the gradients of every tensor the
/// stage's plain backward would reach (at least its parameters and its input).
pub type StageBackward = dyn FnOnce(&Tensor) -> CResult<GradStore> + Send;

/// The result of [`Stage::forward_call`]: the output, and how to backpropagate it when the
/// stage recomputes activations instead of keeping them (plain `backward()` otherwise).
pub struct StageForward {
    output: Tensor,
    backward: Option<Box<StageBackward>>,
}

impl std::fmt::Debug for StageForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageForward")
            .field("output", &self.output.shape())
            .field("own_backward", &self.backward.is_some())
            .finish()
    }
}

impl StageForward {
    /// An output whose graph is kept: the pipeline runs Candle's `backward()` on it.
    pub fn new(output: Tensor) -> Self {
        Self {
            output,
            backward: None,
        }
    }

    /// An output with its own backward (e.g. recomputing checkpointed layers).
    pub fn with_backward(
        output: Tensor,
        backward: impl FnOnce(&Tensor) -> CResult<GradStore> + Send + 'static,
    ) -> Self {
        Self {
            output,
            backward: Some(Box::new(backward)),
        }
    }

    /// The stage output.
    pub fn output(&self) -> &Tensor {
        &self.output
    }

    /// Splits into the output and the backward (`None`: plain `backward()`).
    pub fn into_parts(self) -> (Tensor, Option<Box<StageBackward>>) {
        (self.output, self.backward)
    }

    /// Gradients of `root` (a scalar built on the output): the stage's own backward, or
    /// Candle's.
    pub fn backward(backward: Option<Box<StageBackward>>, root: &Tensor) -> CResult<GradStore> {
        match backward {
            Some(b) => b(root),
            None => root.backward(),
        }
    }
}

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
    /// The forward pass the pipeline runs: told which microbatch it is for, and free to keep
    /// less than its whole graph by returning its own backward (see [`StageForward`]).
    /// Defaults to [`Stage::forward`] with the plain backward.
    fn forward_call(&self, x: &Tensor, call: &Call) -> CResult<StageForward> {
        let _ = call;
        Ok(StageForward::new(self.forward(x)?))
    }
}

/// A boxed or shared stage is a stage.
macro_rules! stage_through_pointer {
    ($($ptr:ident),*) => {$(
        impl<S: Stage + ?Sized> Stage for $ptr<S> {
            fn forward(&self, x: &Tensor) -> CResult<Tensor> {
                (**self).forward(x)
            }
            fn vars(&self) -> Vec<Var> {
                (**self).vars()
            }
            fn forward_call(&self, x: &Tensor, call: &Call) -> CResult<StageForward> {
                (**self).forward_call(x, call)
            }
        }
    )*};
}
stage_through_pointer!(Box, Arc);

type LayerFn = dyn Fn(&Tensor, &Call) -> CResult<Tensor> + Send + Sync;

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
        Self::with_call(vars, move |x, _| f(x))
    }

    /// A layer that is told which [`Call`] it runs for (e.g. to key its dropout masks by the
    /// microbatch), e.g. `Layer::with_call(vars, move |x, call| block.forward(x, call.key))`.
    pub fn with_call<F>(vars: Vec<Var>, f: F) -> Self
    where
        F: Fn(&Tensor, &Call) -> CResult<Tensor> + Send + Sync + 'static,
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

    /// Runs the layer (for the default [`Call`]).
    pub fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        (self.f)(x, &Call::default())
    }

    /// Runs the layer for `call`.
    pub fn forward_call(&self, x: &Tensor, call: &Call) -> CResult<Tensor> {
        (self.f)(x, call)
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

/// A stage made of consecutive [`Layer`]s, applied in order; optionally some runs of layers
/// are recomputed in backward instead of keeping their activations
/// ([`Sequential::with_recompute`]).
#[derive(Clone, Debug, Default)]
pub struct Sequential {
    layers: Vec<Layer>,
    /// Ranges of layers recomputed in backward (sorted, disjoint).
    recompute: Vec<Range<usize>>,
}

fn run_layers(layers: &[Layer], x: &Tensor, call: &Call) -> CResult<Tensor> {
    let mut h = x.clone();
    for l in layers {
        h = l.forward_call(&h, call)?;
    }
    Ok(h)
}

/// Adds the gradients of `part` into `total` (a tensor reached by both gets the sum).
fn merge_grads(total: &mut GradStore, part: GradStore) -> CResult<()> {
    for &id in part.get_ids() {
        let Some(g) = part.get_id(id).cloned() else {
            continue;
        };
        let sum = match total.get_id(id) {
            Some(prev) => (prev + &g)?,
            None => g,
        };
        total.insert_id(id, sum);
    }
    Ok(())
}

impl Sequential {
    /// A stage running `layers` one after the other.
    pub fn new(layers: Vec<Layer>) -> Self {
        Self {
            layers,
            recompute: Vec::new(),
        }
    }

    /// Activation checkpointing inside the stage: each range of layers in `ranges` keeps only
    /// its input in the forward pass and is recomputed (for the same [`Call`], so with the same
    /// dropout masks) when the backward reaches it. The other layers keep their graph.
    ///
    /// Gradients equal the plain backward's up to the order of float additions where a tensor
    /// gets contributions from two passes (none for a chain of layers with distinct
    /// parameters). Fails if the ranges are empty, overlap, are unsorted or exceed the layers.
    pub fn with_recompute(mut self, ranges: Vec<Range<usize>>) -> Result<Self> {
        let mut end = 0;
        for r in &ranges {
            if r.start < end || r.start >= r.end || r.end > self.layers.len() {
                return Err(PipelineError::Config(format!(
                    "recompute ranges {ranges:?} must be sorted, disjoint, non-empty and within \
                     the stage's {} layers",
                    self.layers.len()
                )));
            }
            end = r.end;
        }
        self.recompute = ranges;
        Ok(self)
    }

    /// The layers of the stage.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The ranges of layers recomputed in backward.
    pub fn recomputed(&self) -> &[Range<usize>] {
        &self.recompute
    }
}

impl Stage for Sequential {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        run_layers(&self.layers, x, &Call::default())
    }

    fn forward_call(&self, x: &Tensor, call: &Call) -> CResult<StageForward> {
        if self.recompute.is_empty() {
            return Ok(StageForward::new(run_layers(&self.layers, x, call)?));
        }
        // (layers, input with its graph, output leaf) of each recomputed range.
        let mut saved: Vec<(Range<usize>, Tensor, Var)> = Vec::new();
        let mut h = x.clone();
        let mut at = 0;
        for r in &self.recompute {
            h = run_layers(&self.layers[at..r.start], &h, call)?;
            // Run on a detached input and keep a copy of the output as a fresh leaf: the
            // range's activations are owned by `out` alone and freed with it.
            let out = run_layers(&self.layers[r.clone()], &h.detach(), call)?;
            let leaf = Var::from_tensor(&out.detach())?;
            drop(out);
            saved.push((r.clone(), h, leaf.clone()));
            h = leaf.as_tensor().clone();
            at = r.end;
        }
        let y = run_layers(&self.layers[at..], &h, call)?;
        let (layers, call) = (self.layers.clone(), *call);
        Ok(StageForward::with_backward(y, move |root| {
            let mut total = root.backward()?;
            for (r, input, leaf) in saved.into_iter().rev() {
                let Some(g) = total.remove(leaf.as_tensor()) else {
                    continue; // no gradient reaches this range
                };
                let out = run_layers(&layers[r], &input, &call)?;
                let part = (out * g.detach())?.sum_all()?.backward()?;
                merge_grads(&mut total, part)?;
            }
            Ok(total)
        }))
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
    /// The hook wraps the inner stage's call; an inner stage with its own backward (recomputed
    /// layers) cannot be wrapped, since the hook only returns a tensor.
    fn forward_call(&self, x: &Tensor, call: &Call) -> CResult<StageForward> {
        let y = self.hook.run(
            &|x| {
                let (y, own) = self.stage.forward_call(x, call)?.into_parts();
                if own.is_some() {
                    candle_core::bail!(
                        "a ForwardHook cannot wrap a stage with its own backward (recomputed \
                         layers): checkpoint inside the stage or in the hook, not both"
                    );
                }
                Ok(y)
            },
            x,
        )?;
        Ok(StageForward::new(y))
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
