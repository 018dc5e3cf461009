//! ZeRO stage 1: the optimiser state (and the update) sharded across data-parallel ranks.
//!
//! Parameters are assigned whole to ranks, largest first to the least-loaded rank (the way
//! PyTorch's `ZeroRedundancyOptimizer` partitions), so each rank keeps the optimiser state of
//! about `1 / world_size` of the parameters (whatever state the [`Optimizer`] reports for
//! them, by name: `{param}.{what}` goes with `param`). Every rank still holds all weights and the averaged
//! gradients: clipping and the non-finite check see the same values everywhere; each rank then
//! updates its own parameters, and one broadcast per rank (its parameters flattened into one
//! buffer) hands the updated weights to the others. The arithmetic of every update is the same
//! as without sharding, so ZeRO-1 and plain data parallel give bit-identical weights.
//!
//! Checkpoints hold the whole optimiser state (gathered on rank 0 when saving), in the same
//! format as a run without ZeRO: a run can resume with or without it.

use std::collections::HashMap;

use candle_comm::Communicator;
use candle_core::{DType, Shape, Tensor, Var};

use crate::model::Params;
use crate::optim::{Optimizer, OptimizerState};
use crate::{Error, Result};

/// Which rank updates which parameter.
#[derive(Debug, Clone)]
pub struct Shards {
    /// Parameters in the trainer's order, with their owner.
    params: Vec<(String, Var, usize)>,
    /// The optimiser's state tensors over every parameter, in its order, with their owner.
    state: Vec<(String, Shape, usize)>,
    world: usize,
}

impl Shards {
    /// No sharding: rank 0 of a world of one owns everything.
    pub fn none() -> Self {
        Shards {
            params: Vec::new(),
            state: Vec::new(),
            world: 1,
        }
    }

    /// Parameters balanced over `world` ranks by element count (largest first, ties by name,
    /// to the least-loaded rank, ties to the lowest rank): the same on every rank. Each state
    /// tensor of `optimizer` (which holds every parameter's, before it keeps its shard) goes
    /// with its parameter: the longest parameter name it starts with followed by a dot (state
    /// of no parameter stays with rank 0).
    pub fn balanced(params: &Params, world: usize, optimizer: &dyn Optimizer) -> Self {
        let mut order: Vec<(String, Var)> =
            params.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        order.sort_by(|a, b| b.1.elem_count().cmp(&a.1.elem_count()).then(a.0.cmp(&b.0)));
        let mut load = vec![0usize; world];
        let mut owner: HashMap<String, usize> = HashMap::new();
        for (name, var) in &order {
            let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            load[r] += var.elem_count();
            owner.insert(name.clone(), r);
        }
        let state = optimizer
            .state()
            .into_iter()
            .map(|(name, t)| {
                let param = params
                    .iter()
                    .map(|(p, _)| p)
                    .filter(|p| {
                        name.strip_prefix(p.as_str())
                            .is_some_and(|r| r.starts_with('.'))
                    })
                    .max_by_key(|p| p.len());
                let rank = param.and_then(|p| owner.get(p)).copied().unwrap_or(0);
                (name, t.shape().clone(), rank)
            })
            .collect();
        Shards {
            params: params
                .iter()
                .map(|(n, v)| (n.clone(), v.clone(), owner.get(n).copied().unwrap_or(0)))
                .collect(),
            state,
            world,
        }
    }

    /// Whether parameters are sharded (more than one rank).
    pub(crate) fn is_sharded(&self) -> bool {
        self.world > 1
    }

    /// The rank that updates parameter `name`.
    pub(crate) fn owner(&self, name: &str) -> usize {
        self.params
            .iter()
            .find(|(n, _, _)| n == name)
            .map_or(0, |p| p.2)
    }

    /// After each rank updated its parameters: every rank receives every other rank's updated
    /// parameters (one broadcast per rank).
    pub(crate) fn share_updated_weights(&self, comm: &dyn Communicator) -> Result<()> {
        if !self.is_sharded() {
            return Ok(());
        }
        for owner in 0..self.world {
            let vars: Vec<&Var> = self.owned_by(owner).map(|(_, v)| v).collect();
            let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let flat = self.broadcast_flat(comm, owner, &tensors)?;
            if comm.rank() != owner {
                let mut offset = 0;
                for v in vars {
                    let n = v.elem_count();
                    v.set(&flat.narrow(0, offset, n)?.reshape(v.shape())?)?;
                    offset += n;
                }
            }
        }
        Ok(())
    }

    /// The whole optimiser state, gathered from the ranks' shards (a collective: every rank
    /// calls it), in the order of the unsharded optimiser's: what a checkpoint saves.
    pub(crate) fn gather_optimizer(
        &self,
        comm: &dyn Communicator,
        shard: &dyn Optimizer,
    ) -> Result<OptimizerState> {
        let mine: HashMap<String, Tensor> = shard.state().into_iter().collect();
        let device = self
            .params
            .first()
            .map_or(candle_core::Device::Cpu, |p| p.1.device().clone());
        let mut all = HashMap::new();
        for owner in 0..self.world {
            let owned: Vec<&(String, Shape, usize)> =
                self.state.iter().filter(|s| s.2 == owner).collect();
            let tensors = owned
                .iter()
                .map(|(name, shape, _)| match mine.get(name) {
                    Some(t) if comm.rank() == owner => Ok(t.clone()),
                    _ if comm.rank() == owner => Err(Error::Config(format!(
                        "ZeRO-1: this rank's {} shard has no `{name}`",
                        shard.name()
                    ))),
                    // Not ours: a placeholder of the right size.
                    _ => Ok(Tensor::zeros(shape, DType::F32, &device)?),
                })
                .collect::<Result<Vec<Tensor>>>()?;
            let flat = self.broadcast_flat(comm, owner, &tensors)?;
            let mut offset = 0;
            for (name, shape, _) in owned {
                let n = shape.elem_count();
                all.insert(name.clone(), flat.narrow(0, offset, n)?.reshape(shape)?);
                offset += n;
            }
        }
        let tensors = self
            .state
            .iter()
            .map(|(name, ..)| {
                all.remove(name)
                    .map(|t| (name.clone(), t))
                    .ok_or_else(|| Error::Config(format!("ZeRO-1: `{name}` was gathered twice")))
            })
            .collect::<Result<_>>()?;
        Ok(OptimizerState {
            tensors,
            step_count: shard.step_count(),
        })
    }

    fn owned_by(&self, rank: usize) -> impl Iterator<Item = (&String, &Var)> {
        self.params
            .iter()
            .filter(move |p| p.2 == rank)
            .map(|(n, v, _)| (n, v))
    }

    /// `tensors` flattened into one f32 buffer, as rank `owner` has them, on every rank.
    fn broadcast_flat(
        &self,
        comm: &dyn Communicator,
        owner: usize,
        tensors: &[Tensor],
    ) -> Result<Tensor> {
        let flat: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.flatten_all()?.to_dtype(DType::F32))
            .collect::<candle_core::Result<_>>()?;
        if flat.is_empty() {
            return Ok(Tensor::zeros(0, DType::F32, &candle_core::Device::Cpu)?);
        }
        let flat = Tensor::cat(&flat, 0)?;
        Ok(comm.broadcast(&flat, owner)?)
    }
}
