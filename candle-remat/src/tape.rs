//! The tape: checkpointed segments and the backward driver.
//!
//! # Why a tape, and not a graph rewrite
//!
//! Candle's autodiff graph is private: `Tensor::op()` is `pub(crate)`, `backward()` always seeds
//! the root with ones, and every op keeps its inputs alive until the loss is dropped. So a
//! checkpoint cannot splice a "recompute me" node into an existing graph. What *is* possible from
//! outside is:
//!
//! * running a function on **detached** inputs, so that the activations it creates are only
//!   owned by its outputs, then keeping a **copy of the outputs as fresh `Var` leaves**: the loss
//!   built on top of them does not own the segment's activations, they are freed at once;
//! * pushing an upstream gradient `g` into a recomputed output `y` with the surrogate
//!   `(y * g).sum_all().backward()` (the gradient of that scalar w.r.t. `y` is exactly `g`);
//! * reading which `Var`s a graph reaches with the public [`Tensor::sorted_nodes`].
//!
//! [`Tape`] records, for each checkpointed segment, its closure, its *original* inputs (with
//! whatever graph they carry from glue code: embeddings, residual adds or non-checkpointed
//! blocks before it) and the ids of its leaf outputs. [`Tape::backward`] runs `loss.backward()`,
//! then walks the segments in reverse: it re-runs the closure on the original inputs (same seed,
//! see [`crate::seed`]), backpropagates the surrogate built from the leaves' gradients, which
//! reaches the parameters used inside the segment *and* flows through the inputs' own graph to
//! earlier leaves and parameters, then drops that recomputed graph before the next segment.
//! Peak memory in backward is therefore one segment's activations plus the boundaries.
//!
//! # Exactness
//!
//! Candle accumulates the gradient of a tensor with several consumers as a left fold
//! `((0 + c1) + c2) + ...` in topological order. When a `Var` (parameter or boundary leaf)
//! receives contributions from several passes, a naive `GradStore::extend` would compute
//! `c1 + (c2 + c3)` and break bit-identity. Instead each pass *injects* the gradient accumulated
//! so far as the first contribution: it differentiates `root + Σ_v sum(v * acc_v)`, and Candle's
//! topological order visits the injected term (the right operand) before anything else, so the
//! pass continues the same left fold. With this, gradients are bit-identical to a plain
//! `loss.backward()` whenever the passes see each tensor's consumers in the same order as the
//! plain graph does, which is the case for chains of blocks (residuals inside or outside the
//! checkpoint), tied embeddings, several inputs/outputs and nesting (see the tests). The one
//! known exception: a segment input that is a *non-leaf* glue tensor also consumed outside that
//! segment (e.g. `x = a + b; y = x + ckpt(x)`) gets its two gradient contributions propagated
//! separately through the ops that produced it, so results differ by float reassociation
//! (relative error ~1e-7 in f32). Wrap such inputs in [`Tape::boundary`], or move the glue
//! inside the segment, to stay bit-exact.

use crate::error::{RematError, Result};
use crate::seed::{self, mix, Ctx};
use crate::verify::{first_in_forward_order, verify_same};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, TensorId, Var};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

type SegFn<'a> = Rc<dyn Fn(&Tape<'a>, &[Tensor]) -> candle_core::Result<Vec<Tensor>> + 'a>;
type Grads = HashMap<TensorId, Tensor>;

enum SavedInput {
    Kept(Tensor),
    Offloaded {
        copy: Tensor,
        id: TensorId,
        device: Device,
    },
}

struct OutLeaf {
    id: TensorId,
    keep: Option<Tensor>,
}

struct Record<'a> {
    path: String,
    seed: u64,
    f: SegFn<'a>,
    inputs: Vec<SavedInput>,
    outputs: Vec<Option<OutLeaf>>,
}

struct Frame<'a> {
    recording: bool,
    records: Vec<Record<'a>>,
}

/// Records checkpointed segments during the forward pass and drives their recomputation in
/// [`Tape::backward`].
///
/// A tape covers one training step: create it with a step-dependent seed, run the forward with
/// [`Tape::checkpoint`] (or a [`crate::Plan`]), then call [`Tape::backward`] instead of
/// `loss.backward()`. The lifetime `'a` is that of whatever the segment closures borrow (usually
/// the model).
///
/// ```
/// use candle_core::{Device, Tensor, Var, DType};
/// use candle_remat::Tape;
/// let dev = Device::Cpu;
/// let w = Var::randn(0f32, 1.0, (8, 8), &dev)?;
/// let x = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
/// let tape = Tape::new(0);
/// let h = tape.checkpoint1(&x, |x| x.matmul(w.as_tensor())?.tanh())?;
/// let loss = h.sqr()?.sum_all()?;
/// let grads = tape.backward(&loss)?;
/// let plain = x.matmul(w.as_tensor())?.tanh()?.sqr()?.sum_all()?.backward()?;
/// let (a, b) = (grads.get(&w).unwrap(), plain.get(&w).unwrap());
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
/// # Ok::<(), candle_remat::RematError>(())
/// ```
pub struct Tape<'a> {
    seed: u64,
    verify: bool,
    offload: Option<Device>,
    root_children: Cell<u64>,
    root_draws: Cell<u64>,
    frames: RefCell<Vec<Frame<'a>>>,
    leaf_ids: RefCell<HashSet<TensorId>>,
}

/// Pops a frame pushed on the tape when dropped.
struct FrameGuard<'t, 'a> {
    tape: &'t Tape<'a>,
    popped: bool,
}

impl<'a> FrameGuard<'_, 'a> {
    fn finish(mut self) -> Vec<Record<'a>> {
        self.popped = true;
        self.tape
            .frames
            .borrow_mut()
            .pop()
            .map(|f| f.records)
            .unwrap_or_default()
    }
}

impl Drop for FrameGuard<'_, '_> {
    fn drop(&mut self) {
        if !self.popped {
            self.tape.frames.borrow_mut().pop();
        }
    }
}

impl<'a> Tape<'a> {
    /// A new tape. `seed` keys every random draw made through [`crate::dropout`],
    /// [`crate::seeded_rng`] and [`Tape::dropout`]; use a different seed per step.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            verify: false,
            offload: None,
            root_children: Cell::new(0),
            root_draws: Cell::new(0),
            frames: RefCell::new(vec![Frame {
                recording: true,
                records: Vec::new(),
            }]),
            leaf_ids: RefCell::new(HashSet::new()),
        }
    }

    /// Verification mode: on recompute, compare every output with the value the forward
    /// produced (kept anyway as the segment's boundary leaf, so this costs no memory unless
    /// boundaries are offloaded) and fail with [`RematError::RecomputeMismatch`] naming the
    /// first segment, in forward order, whose recompute differs.
    ///
    /// The backward recomputes segments last to first, so it finishes the backward before
    /// reporting, then names the mismatching segment whose outputs the forward produced
    /// first: the lowest top-level index, and a nested segment before the segment that
    /// contains it (its outputs are complete before the outer segment's are).
    pub fn with_verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Offload boundaries: a segment input that is the boundary output of an earlier segment is
    /// kept on `device` (e.g. `Device::Cpu` while computing on a GPU) instead of the compute
    /// device, and copied back when the segment is recomputed. Gradients are unchanged (still
    /// bit-identical).
    pub fn with_offload(mut self, device: Device) -> Self {
        self.offload = Some(device);
        self
    }

    /// The seed given to [`Tape::new`].
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Number of top-level segments currently recorded (not yet consumed by
    /// [`Tape::backward`]).
    pub fn num_segments(&self) -> usize {
        self.frames.borrow().first().map_or(0, |f| f.records.len())
    }

    fn child(&self) -> (u64, String) {
        seed::child_of_current().unwrap_or_else(|| {
            let i = self.root_children.get();
            self.root_children.set(i + 1);
            (mix(self.seed, mix(0xC41D_0000, i)), i.to_string())
        })
    }

    fn push_frame(&self, recording: bool) -> FrameGuard<'_, 'a> {
        self.frames.borrow_mut().push(Frame {
            recording,
            records: Vec::new(),
        });
        FrameGuard {
            tape: self,
            popped: false,
        }
    }

    fn recording(&self) -> bool {
        self.frames.borrow().last().is_some_and(|f| f.recording)
    }

    /// Runs `f` with a seed scope keyed by `key` alone (independent of where it is called), so
    /// that [`crate::dropout`] inside it draws the same masks whatever the checkpointing policy.
    /// [`crate::Plan::forward`] wraps every block `i` in `scope(i, ..)`.
    pub fn scope<T>(&self, key: u64, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _g = seed::push(Ctx::new(
            mix(self.seed, mix(0x5C0E_0000, key)),
            format!("k{key}"),
        ));
        f()
    }

    /// Dropout for glue code: inside a scope or segment it is [`crate::dropout`]; outside, it
    /// draws from the tape's own stream (glue code is never recomputed).
    pub fn dropout(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        if seed::in_scope() {
            return seed::dropout(x, p);
        }
        seed::check_p(p)?;
        let d = self.root_draws.get();
        self.root_draws.set(d + 1);
        if p == 0.0 {
            return Ok(x.clone());
        }
        let mask = seed::dropout_mask(x, p, mix(self.seed, mix(0x6C0E_0000, d)))?;
        Ok(x.mul(&mask)?)
    }

    /// Checkpoints `f` applied to `inputs`: runs it now on detached inputs, keeps only the
    /// inputs, and returns its float outputs as fresh leaves (integer outputs are returned
    /// detached). In [`Tape::backward`] it is re-run on the original inputs. `f` must be
    /// deterministic given its inputs and the tape seed (use [`crate::dropout`] for randomness).
    ///
    /// Inputs may need no gradient (token ids, masks); outputs may be used any number of times.
    pub fn checkpoint<F>(&self, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>> + 'a,
    {
        self.checkpoint_nested(inputs, move |_, xs| f(xs))
    }

    /// [`Tape::checkpoint`] for one input and one output: `x = tape.checkpoint1(&x, |x|
    /// block.forward(x))?`.
    pub fn checkpoint1<F>(&self, x: &Tensor, f: F) -> Result<Tensor>
    where
        F: Fn(&Tensor) -> candle_core::Result<Tensor> + 'a,
    {
        let mut ys = self.checkpoint_nested(&[x], move |_, xs| Ok(vec![f(&xs[0])?]))?;
        ys.pop()
            .ok_or_else(|| RematError::InvalidPlan("checkpoint1: no output".into()))
    }

    /// Turns a glue tensor into a boundary: returns a leaf copy of `x` whose gradient is
    /// accumulated over *all* its consumers before being pushed back through `x`'s own graph.
    ///
    /// Use it on a non-leaf tensor that feeds a checkpoint **and** other code, e.g. a residual
    /// add written outside the checkpointed function:
    /// `let h = tape.boundary(&h)?; let h = (&h + tape.checkpoint1(&h, f)?)?;`. Without it the
    /// gradients are still correct but only equal to plain Candle's up to float reassociation
    /// (see the module docs); with it they are bit-identical. Costs one copy of `x`.
    pub fn boundary(&self, x: &Tensor) -> Result<Tensor> {
        self.checkpoint1(x, |x| Ok(x.clone()))
    }

    /// [`Tape::checkpoint`] when `enabled`; otherwise runs `f` inline (plain Candle graph) in the
    /// same seed scope, so dropout masks do not depend on `enabled`.
    pub fn checkpoint_if<F>(&self, enabled: bool, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>> + 'a,
    {
        if enabled {
            return self.checkpoint(inputs, f);
        }
        let (seed, path) = self.child();
        let _g = seed::push(Ctx::new(seed, path));
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        Ok(f(&owned)?)
    }

    /// [`Tape::checkpoint`] whose closure also receives the tape, for **nested** checkpoints
    /// (`t.checkpoint(..)` inside). While the outer segment runs its forward, inner checkpoints
    /// just run inline (nothing of the outer segment is kept); when the outer segment is
    /// recomputed in backward, the inner ones are recorded and recomputed in turn.
    pub fn checkpoint_nested<F>(&self, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&Tape<'a>, &[Tensor]) -> candle_core::Result<Vec<Tensor>> + 'a,
    {
        let (seed, path) = self.child();
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        if !self.recording() {
            let _g = seed::push(Ctx::new(seed, path));
            return Ok(f(self, &owned)?);
        }
        let detached: Vec<Tensor> = owned.iter().map(Tensor::detach).collect();
        let ys = {
            let _frame = self.push_frame(false);
            let _g = seed::push(Ctx::new(seed, path.clone()));
            f(self, &detached)?
        };
        drop(detached);
        let mut outs = Vec::with_capacity(ys.len());
        let mut leaves = Vec::with_capacity(ys.len());
        for y in ys {
            if y.dtype().is_float() {
                let leaf = Var::from_tensor(&y.detach())?.into_inner();
                drop(y);
                self.leaf_ids.borrow_mut().insert(leaf.id());
                let keep = match &self.offload {
                    None => Some(leaf.clone()),
                    Some(dev) if self.verify => Some(leaf.to_device(dev)?),
                    Some(_) => None,
                };
                leaves.push(Some(OutLeaf {
                    id: leaf.id(),
                    keep,
                }));
                outs.push(leaf);
            } else {
                leaves.push(None);
                outs.push(y.detach());
            }
        }
        let mut saved = Vec::with_capacity(owned.len());
        for t in owned {
            match &self.offload {
                Some(dev) if self.leaf_ids.borrow().contains(&t.id()) => {
                    saved.push(SavedInput::Offloaded {
                        copy: t.to_device(dev)?,
                        id: t.id(),
                        device: t.device().clone(),
                    })
                }
                _ => saved.push(SavedInput::Kept(t)),
            }
        }
        let rec = Record {
            path,
            seed,
            f: Rc::new(f),
            inputs: saved,
            outputs: leaves,
        };
        if let Some(fr) = self.frames.borrow_mut().last_mut() {
            fr.records.push(rec);
        }
        Ok(outs)
    }

    /// Computes the gradients of `loss`, recomputing every checkpointed segment in reverse
    /// order. The result contains the same entries as `loss.backward()` would for every `Var`,
    /// and no entry for the internal boundary leaves. Consumes the recorded segments.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let records = self
            .frames
            .borrow_mut()
            .first_mut()
            .map(|f| std::mem::take(&mut f.records))
            .unwrap_or_default();
        let mut m: Grads = HashMap::new();
        pass(loss.clone(), &mut m, &HashSet::new())?;
        let mut mismatches = Vec::new();
        let done = self.process(records, &mut m, &mut mismatches);
        let leaf_ids = std::mem::take(&mut *self.leaf_ids.borrow_mut());
        // A mismatch is the root cause of any later failure (e.g. a recompute of another
        // shape): report it first.
        if let Some(e) = first_in_forward_order(mismatches) {
            return Err(e);
        }
        done?;
        let mut out = GradStore::default();
        for (id, g) in m {
            if !leaf_ids.contains(&id) {
                out.insert_id(id, g);
            }
        }
        Ok(out)
    }

    /// Recomputes `records` last to first and backpropagates through them. In verify mode,
    /// every segment whose recompute differs is pushed on `mismatches` (and the backward goes
    /// on, so that the caller can name the first one in forward order).
    fn process(
        &self,
        records: Vec<Record<'a>>,
        m: &mut Grads,
        mismatches: &mut Vec<RematError>,
    ) -> Result<()> {
        for rec in records.into_iter().rev() {
            let mut out_grads = Vec::new();
            for (j, o) in rec.outputs.iter().enumerate() {
                if let Some(g) = o.as_ref().and_then(|o| m.remove(&o.id)) {
                    out_grads.push((j, g));
                }
            }
            if out_grads.is_empty() {
                tracing::trace!(segment = %rec.path, "no gradient reaches segment, skipped");
                continue;
            }
            let mut inputs = Vec::with_capacity(rec.inputs.len());
            let mut remap = Vec::new();
            for si in &rec.inputs {
                match si {
                    SavedInput::Kept(t) => inputs.push(t.clone()),
                    SavedInput::Offloaded { copy, id, device } => {
                        let v = Var::from_tensor(&copy.to_device(device)?)?.into_inner();
                        if let Some(g) = m.remove(id) {
                            m.insert(v.id(), g);
                        }
                        remap.push((*id, v.id()));
                        inputs.push(v);
                    }
                }
            }
            let (ys, inner) = {
                let frame = self.push_frame(true);
                let _g = seed::push(Ctx::new(rec.seed, rec.path.clone()));
                let ys = (rec.f)(self, &inputs)?;
                (ys, frame.finish())
            };
            drop(inputs);
            if ys.len() != rec.outputs.len() {
                return Err(RematError::OutputCountMismatch {
                    segment: rec.path.clone(),
                    forward: rec.outputs.len(),
                    recompute: ys.len(),
                });
            }
            if self.verify {
                for (j, o) in rec.outputs.iter().enumerate() {
                    if let Some(keep) = o.as_ref().and_then(|o| o.keep.as_ref()) {
                        if let Some(e) = verify_same(&rec.path, j, &ys[j], keep)? {
                            mismatches.push(e);
                            break;
                        }
                    }
                }
            }
            let mut root: Option<Tensor> = None;
            let mut skip = HashSet::new();
            for (j, g) in out_grads {
                skip.insert(g.id());
                // Scalar terms summed in f32 so outputs of different dtypes can be mixed; the
                // cast's backward hands exactly `g` to `ys[j]` (1.0 is exact in every dtype).
                let t = ys[j].mul(&g)?.sum_all()?.to_dtype(DType::F32)?;
                root = Some(match root {
                    None => t,
                    Some(a) => a.add(&t)?,
                });
            }
            drop(ys);
            if let Some(root) = root {
                pass(root, m, &skip)?;
            }
            self.process(inner, m, mismatches)?;
            for (orig, fresh) in remap {
                if let Some(g) = m.remove(&fresh) {
                    m.insert(orig, g);
                }
            }
            tracing::trace!(segment = %rec.path, "segment recomputed");
        }
        Ok(())
    }
}

/// One Candle backward pass from `root`, continuing the accumulation of every `Var` it reaches
/// that already has a gradient in `m` (see the module docs), then merging into `m`.
fn pass(root: Tensor, m: &mut Grads, skip: &HashSet<TensorId>) -> Result<()> {
    let vars: Vec<Tensor> = root
        .sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable() && m.contains_key(&n.id()))
        .cloned()
        .collect();
    let mut skip = skip.clone();
    let root = if vars.is_empty() {
        root
    } else {
        let mut inj: Option<Tensor> = None;
        for v in &vars {
            if let Some(prev) = m.remove(&v.id()) {
                skip.insert(prev.id());
                // Summed in f32: segments may mix dtypes (f16/bf16 activations, f32 master
                // weights). Only the gradient of this term matters (it is exactly `prev`).
                let t = v.mul(&prev)?.sum_all()?.to_dtype(DType::F32)?;
                inj = Some(match inj {
                    None => t,
                    Some(a) => a.add(&t)?,
                });
            }
        }
        let base = if root.rank() == 0 {
            root
        } else {
            root.sum_all()?
        }
        .to_dtype(DType::F32)?;
        match inj {
            Some(inj) => base.add(&inj)?,
            None => base,
        }
    };
    let g = root.backward()?;
    drop(root);
    let ids: Vec<TensorId> = g.get_ids().copied().collect();
    for id in ids {
        if skip.contains(&id) {
            continue;
        }
        if let Some(t) = g.get_id(id) {
            // Candle leaves the gradients of leaves undetached (they may carry the graph of
            // the backward computation, e.g. through the forward activations): detach, or the
            // next pass would differentiate through them.
            let t = t.detach();
            match m.get(&id) {
                Some(prev) => {
                    let s = prev.add(&t)?.detach();
                    m.insert(id, s);
                }
                None => {
                    m.insert(id, t);
                }
            }
        }
    }
    Ok(())
}
